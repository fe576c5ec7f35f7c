"""The memory tiers' costs, each beside its name: what a tier takes off the device (the memory walk, core.py, reads
it) and what it costs per step (the planner's prediction, step_time.py, reads it).

The settings are `paratrain.memory.MemoryTiers` (`[memory]`), their checks paratrain/memory.py; the runtime is
models/llama.chunked_cross_entropy. A new tier adds its field there, its runtime, and its two terms here; or it is a
capability that a layout's name switches on, with its terms as its hooks (activation offload, CPU offload: their
modules in paratrain/capabilities), asked here where the estimator's own quantities price them.
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


# --- loss_chunks: the output projection and loss in pieces, each piece's logits recomputed in backward -------------
# Memory: activations.head_saved keeps only the normed hidden states, activations.loss_backward_extra holds one
# piece's logits at a time (both read ActDims.chunks).

def chunked_loss_recompute_s(head_s: float, micro_steps: int) -> float:
    """Time: the head's forward once more, piece by piece, in backward (`head_s`: the output head's and the loss's
    forward + backward of one micro-step, as block_costs gives it; a third of it is the forward)."""
    return micro_steps * head_s / 3
