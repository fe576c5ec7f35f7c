"""The memory tiers' costs, each beside its name: what a tier takes off the device (the memory walk, core.py, reads
it) and what it costs per step (the planner's prediction, step_time.py, reads it).

The settings are `paratrain.memory.MemoryTiers` (`[memory]`), their checks paratrain/memory.py; the runtime is
distributed/offload.py (activation offloading) and models/llama.chunked_cross_entropy. A new tier adds its field
there, its runtime, and its two terms here; or it is a capability that a layout's name switches on, with its terms as
its hooks (CPU offload, `CpuOffload` in paratrain/capabilities).
"""

from __future__ import annotations

from paratrain.estimate import activations as A
from paratrain.estimate.profile import Hardware, Link, p2p_time
from paratrain.memory import MemoryTiers
from paratrain.modes import offload_stride, offloaded_blocks


def host_link(hw: Hardware) -> Link:
    """The device <-> host link the offloading tiers copy over."""
    if hw.host is None:
        raise ValueError(f"profile {hw.name} has no host side: the offloading tiers cannot be predicted on it")
    return hw.host


# --- activation_offload: chosen blocks' saved tensors to host in forward, back for backward -----------------------

OFFLOAD_EVERY_K = 2  # memory.activation_offload_every_k of a planner candidate offloading every_k blocks (the default)


def activation_offload_plan(tiers: MemoryTiers, n_layers: int, d: A.ActDims, modes: list[str], moe_of: dict,
                            layers: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Memory: bytes each of these blocks moves to host (0: not offloaded), and which offloaded block each offloaded
    block's backward fetches ahead (the one `stride` below it, when this rank holds it)."""
    chosen = set(offloaded_blocks(tiers.activation_offload, tiers.activation_offload_every_k, n_layers)) & set(layers)
    moved = {l: A.offloaded(d, modes[l], moe_of.get(l)) if l in chosen else 0 for l in layers}
    stride = offload_stride(tiers.activation_offload, tiers.activation_offload_every_k)
    return moved, {l: l - stride for l in chosen if l - stride in chosen}


def activation_offload_s(block_bytes: int, offloaded: int, blocks: int, micro_steps: int, compute_s: float,
                         hw: Hardware) -> tuple[float, float]:
    """Time: (exposed, total) seconds per step of the copies on the busiest rank: each of the `offloaded` blocks'
    `block_bytes` go to host in its forward and come back in backward, on a side stream beside the compute of one
    block (its own forward, the block above's backward: a share `overlap` of it hides them). `compute_s`: the rank's
    compute per micro-step over its `blocks`."""
    one = p2p_time(block_bytes, host_link(hw))  # one block's copy, one way
    per_block = compute_s / max(blocks, 1) / 3  # forward; backward is twice that
    exposed = max(0.0, one - hw.overlap * per_block) + max(0.0, one - hw.overlap * 2 * per_block)
    return micro_steps * offloaded * exposed, micro_steps * offloaded * 2 * one


# --- loss_chunks: the output projection and loss in pieces, each piece's logits recomputed in backward -------------
# Memory: activations.head_saved keeps only the normed hidden states, activations.loss_backward_extra holds one
# piece's logits at a time (both read ActDims.chunks).

def chunked_loss_recompute_s(head_s: float, micro_steps: int) -> float:
    """Time: the head's forward once more, piece by piece, in backward (`head_s`: the output head's and the loss's
    forward + backward of one micro-step, as block_costs gives it; a third of it is the forward)."""
    return micro_steps * head_s / 3
