"""The memory tiers' costs where the estimator's own quantities price them: what a tier takes off the device (the
memory walk, core.py, reads it).

Every memory tier is a capability that a layout's name switches on (the chunked loss, activation offload, CPU offload:
their modules in paratrain/capabilities), with its settings, checks and terms as its hooks; this module asks them
where the walk's per-block quantities are needed.
"""

from __future__ import annotations

from paratrain.estimate import activations as A


# --- the capabilities that keep blocks' saved activations in host memory (Capability.host_activations) -------------

def saved_on_host(present: tuple, n_layers: int, d: A.ActDims, modes: list[str], moe_of: dict,
                  layers: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Memory: bytes each of these blocks moves to host (0: none) under the capabilities `present`, and which moved
    block each moved block's backward fetches ahead (the one `stride` below it, when this rank holds it)."""
    moved, ahead_of = {l: 0 for l in layers}, {}
    for capability in present:
        on_host = capability.host_activations(n_layers)
        if on_host is None:
            continue
        blocks, stride = on_host
        chosen = set(blocks) & set(layers)
        moved.update({l: A.offloaded(d, modes[l], moe_of.get(l)) for l in layers if l in chosen})
        ahead_of.update({l: l - stride for l in chosen if l - stride in chosen})
    return moved, ahead_of
