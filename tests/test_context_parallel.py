"""Context parallelism: ring attention against full attention, the chunk layout, the verify rows, memory per rank,
the planner's long-context answer and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.distributed.context_parallel import (block_backward, block_forward, local_positions, shard_sequence)

TOL = 1e-5


def _qkv(B=2, Hq=4, Hkv=2, T=32, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # q laid out like the model's: (B, T, H, D) transposed, so the kernels see its strides
    q = torch.randn(B, T, Hq, D, generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype).transpose(1, 2)
    dout = torch.randn(B, Hq, T, D, generator=g, dtype=dtype)
    return q, k, v, dout


def _full(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


def test_chunk_layout_pairs_early_and_late_chunks():
    seq = torch.arange(16)[None]  # positions 0..15, cp=4: chunks of 2
    parts = [shard_sequence(seq, 4, r)[0].tolist() for r in range(4)]
    assert parts == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for r in range(4):
        assert local_positions(4, 4, r).tolist() == parts[r]  # rotary positions follow the same cut
    assert sorted(sum(parts, [])) == list(range(16))


@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_agree_with_the_math(causal):
    """The fused CPU kernel and the plain-matmul block give the same (out, lse) and gradients, GQA included."""
    q, k, v, dout = _qkv(T=16)
    scale = q.shape[-1] ** -0.5
    o1, l1 = block_forward(q, k[:, :, :12], v[:, :, :12], False, scale) if not causal else \
        block_forward(q, k, v, True, scale)
    o2, l2 = block_forward(q, k[:, :, :12], v[:, :, :12], False, scale, kernel="math") if not causal else \
        block_forward(q, k, v, True, scale, kernel="math")
    assert (o1 - o2).abs().max() < TOL and (l1 - l2).abs().max() < TOL
    kk, vv = (k, v) if causal else (k[:, :, :12], v[:, :, :12])
    g1 = block_backward(dout, q, kk, vv, o1, l1, causal, scale)
    g2 = block_backward(dout, q, kk, vv, o1, l1, causal, scale, kernel="math")
    for a, b in zip(g1, g2):
        assert a.shape == b.shape and (a - b).abs().max() < TOL


def test_cuda_flash_block_calls_match_their_schemas():
    """The CUDA bf16 kernels' calls, checked on the meta device (no GPU here): shapes of out, lse and gradients."""
    q = torch.empty(2, 8, 64, 16, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 64, 16, device="meta", dtype=torch.bfloat16)
    out, lse = block_forward(q, k, k, True, 0.25)
    assert out.shape == q.shape and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
    dq, dk, dv = block_backward(q, q, k, k, out, lse, False, 0.25)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def _ring_rank():
    """One of 4 ranks: ring attention over the whole group (cp=4) and over pairs (cp=2: ranks 0-1 and 2-3) against
    full attention over the whole sequence; returns every rank's max errors of out, dq, dk, dv."""
    import torch.distributed as dist

    from paratrain.distributed.context_parallel import ContextParallel
    from paratrain.distributed.env import init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    result = {}
    for cp, group in ((4, dist.group.WORLD), (2, pairs[dist.get_rank() // 2])):
        rank = dist.get_rank(group)
        q, k, v, dout = _qkv(T=8 * cp, seed=cp)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = _full(*leaves)
        ref.backward(dout)
        local = [shard_sequence(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
        out = ContextParallel(group).attend(*local)
        out.backward(shard_sequence(dout, cp, rank, dim=2))
        errors = [(out - shard_sequence(ref.detach(), cp, rank, dim=2)).abs().max().item()]
        errors += [(t.grad - shard_sequence(r.grad, cp, rank, dim=2)).abs().max().item() for t, r in zip(local, leaves)]
        result[cp] = errors
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def test_ring_attention_matches_full_attention():
    """Forward and dq, dk, dv of ring attention (GQA, load-balanced causal chunks) on 2 and 4 gloo ranks."""
    from paratrain.distributed.launch import launch

    per_rank = launch(_ring_rank, (), 4)
    for cp in (2, 4):
        for errors in per_rank:
            assert max(errors[cp]) < TOL, (cp, per_rank)
