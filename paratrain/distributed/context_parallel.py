"""Context parallelism: every sequence split over the cp ranks, exact causal attention by ring attention.

The sequence is cut into 2 x cp equal chunks and cp rank i holds chunks i and 2cp-1-i (an early and a late one),
so that causal attention costs every rank the same. Everything that sees positions follows that one cut
(`ContextParallel.shard` for the batches' token ids and targets, `ContextParallel.rope` for the rotary angles);
the loss is the mean over this rank's tokens, and since every rank holds as many, the mean over dp x cp ranks
(which the trainer takes for the loss and FSDP for the gradients) is the mean over the global batch.

Ring attention (`ring_attention`, an operator with its own backward): each rank keeps its queries and passes its K/V block
around the cp group (send to rank+1, receive from rank-1, overlapped with the attention of the block in hand), so
after cp steps every query has met every key. Each step's partial result is merged by its log-sum-exp (online
softmax), so the output is exact. Which (query, key) chunk pairs a step computes follows from the chunk layout:

    step 0: the rank's own K/V, causal within its two chunks (their positions increase along the concatenation);
    K/V from an earlier rank j < i: every query attends to chunk j only (chunk 2cp-1-j is later than both of ours);
    K/V from a later rank j > i: only our late chunk 2cp-1-i attends, to both of j's chunks;

so every step but the first computes half a block, on every rank. Backward passes K/V around again, with each
block's dK/dV accumulator travelling with it (fp32) and arriving home after cp hops. Blocks run the fused kernels
that return the log-sum-exp: on CPU `_scaled_dot_product_flash_attention_for_cpu` (what SDPA runs there), on CUDA
in bf16/fp16 `_scaled_dot_product_flash_attention`; elsewhere (e.g. CUDA fp32) the same math in plain matmuls.

Why our own function: torch's `torch.distributed.tensor.experimental.context_parallel` (torch 2.13) shards only
the CUDA flash/efficient attention ops; on CPU it fails ("aten._scaled_dot_product_flash_attention_for_cpu does
not have a sharding strategy"), and the verify suite runs on CPU ranks over gloo. This function runs on both, so
the code that is verified is the code that trains.

The model stays free of parallel code: `Attention.sequence` is its seam (models/llama.py `WholeSequence`);
`apply_context_parallel` installs a `ContextParallel` there, and `whole_sequences` puts the default back for
sampling, which runs whole prompts on every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.models.llama import WHOLE_SEQUENCE, Attention

# -- the chunk layout ------------------------------------------------------------------------------------------------


def chunk_starts(length: int, cp: int, rank: int) -> tuple[int, int, int]:
    """(chunk size, start of the early chunk, start of the late chunk) of rank `rank` in a sequence of `length`."""
    c = length // (2 * cp)
    return c, rank * c, (2 * cp - 1 - rank) * c


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `t` along `dim` (the whole sequence there), concatenated."""
    c, early, late = chunk_starts(t.shape[dim], cp, rank)
    return torch.cat([t.narrow(dim, early, c), t.narrow(dim, late, c)], dim=dim)


def local_positions(local_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of a rank's `local_length` tokens (its two chunks), as int64."""
    c = local_length // 2
    _, early, late = chunk_starts(local_length * cp, cp, rank)
    return torch.cat([torch.arange(early, early + c, device=device), torch.arange(late, late + c, device=device)])


# -- attention blocks: (out, lse) forward and (dq, dk, dv) backward ------------------------------------------------


def _kernel(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type in ("cuda", "meta") and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda_flash"
    return "math"


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Grouped-query attention: K/V heads repeated to the query heads (each serves Hq/Hkv of them)."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v, 1
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), rep


def _fold(dk: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of repeated K/V heads summed back onto the KV heads."""
    if rep == 1:
        return dk
    B, H, T, D = dk.shape
    return dk.view(B, H // rep, rep, T, D).sum(2)


def block_forward(q, k, v, causal: bool, scale: float, kernel: str | None = None):
    """Attention of q (B, Hq, Tq, D) over one K/V block (B, Hkv, Tk, D): (out in q's dtype, lse fp32 (B, Hq, Tq))."""
    kernel = kernel or _kernel(q)
    k, v, _ = _repeat_kv(q, k, v)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str | None = None):
    """Gradients of one block's attention given the merged `out` and `lse` of all blocks (exact: the block's
    softmax probabilities are exp(scores - lse) with the global lse). Returns fp32 (dq, dk, dv), dk/dv on the KV
    heads."""
    kernel = kernel or _kernel(q)
    kr, vr, rep = _repeat_kv(q, k, v)
    if kernel == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        T, S = q.shape[2], k.shape[2]
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kr, vr, out, lse, None, None, T, S, 0.0, causal, seed, offset, scale=scale)
    else:
        qf, kf, vf, of, gf = q.float(), kr.float(), vr.float(), out.float(), dout.float()
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(_future(s), float("-inf"))
        p = torch.exp(s - lse.unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), gf)
        dp = torch.matmul(gf, vf.transpose(-1, -2))
        ds = p * (dp - (gf * of).sum(-1, keepdim=True)) * scale
        dq, dk = torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf)
    return dq.float(), _fold(dk.float(), rep), _fold(dv.float(), rep)


def _future(s: torch.Tensor) -> torch.Tensor:
    T, S = s.shape[-2:]
    return torch.ones(T, S, dtype=torch.bool, device=s.device).triu(1)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running fp32 (out, lse), in place: softmax over the union of their keys
    (the numerically stable sigmoid form of ring-flash-attention)."""
    w = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(w * (out - block_out.float()))
    lse.sub_(F.logsigmoid(lse - block_lse))


# -- the ring --------------------------------------------------------------------------------------------------------


class Ring:
    """The cp group as a ring: each step sends a buffer to rank+1 and receives the one of rank-1."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.index = None  # position in _RINGS once used by the operator

    def start(self, t: torch.Tensor):
        """Begin passing `t` on; returns (the buffer that will hold rank-1's, the requests to wait for)."""
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests) -> None:
        for r in requests:
            r.wait()


def ring_forward(q, k, v, ring: Ring, scale: float):
    """Exact causal attention of this rank's queries over the whole sequence: (out (B, Hq, T, D) laid out like q,
    lse fp32 (B, Hq, T))."""
    c = q.shape[2] // 2
    kv = torch.cat([k, v]).contiguous()  # one buffer on the wire: (2B, Hkv, T, D)
    out = torch.empty_like(q, dtype=torch.float32)  # q's strides: the output's transpose for wo stays a view
    lse = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            incoming, requests = ring.start(kv)
        kb, vb = kv.chunk(2)
        src = (ring.rank - step) % ring.size
        if step == 0:
            o, lse = block_forward(q, kb, vb, True, scale)
            out.copy_(o)
            lse = lse.float().clone()  # merged in place below
        elif src < ring.rank:  # all our queries attend to its early chunk
            o, l = block_forward(q, kb[:, :, :c], vb[:, :, :c], False, scale)
            merge(out, lse, o, l)
        else:  # our late chunk attends to both of its chunks
            o, l = block_forward(q[:, :, c:], kb, vb, False, scale)
            merge(out[:, :, c:], lse[:, :, c:], o, l)
        del o
        if step + 1 < ring.size:
            ring.wait(requests)
            kv = incoming
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, ring: Ring, scale: float):
    """(dq, dk, dv) of `ring_forward`, in the inputs' dtypes."""
    c = q.shape[2] // 2
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.cat([k, v]).contiguous()
    late = lambda t: t[:, :, c:].contiguous()  # noqa: E731
    dout_late, q_late, out_late, lse_late = late(dout), late(q), late(out), late(lse)
    dkv = requests_dkv = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            incoming, requests = ring.start(kv)
        kb, vb = kv.chunk(2)
        src = (ring.rank - step) % ring.size
        grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this block's dK, dV
        dk, dv = grad.chunk(2)
        if step == 0:
            bq, bk, bv = block_backward(dout, q, kb, vb, out, lse, True, scale)
            dq += bq
            dk += bk
            dv += bv
        elif src < ring.rank:
            bq, bk, bv = block_backward(dout, q, kb[:, :, :c], vb[:, :, :c], out, lse, False, scale)
            dq += bq
            dk[:, :, :c] += bk
            dv[:, :, :c] += bv
        else:
            bq, bk, bv = block_backward(dout_late, q_late, kb, vb, out_late, lse_late, False, scale)
            dq[:, :, c:] += bq
            dk += bk
            dv += bv
        del bq, bk, bv
        if step > 0:  # the accumulator of this K/V block, from the ranks it visited before
            ring.wait(requests_dkv)
            grad += dkv
        dkv, requests_dkv = ring.start(grad)  # on to the next holder; after the last step, home
        if step + 1 < ring.size:
            ring.wait(requests)
            kv = incoming
    ring.wait(requests_dkv)
    dk, dv = dkv.chunk(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# The ring as one operator (`torch.ops.paratrain.ring_attention`): selective activation checkpointing saves its
# output like SDPA's (parallelize._SAVE_OPS) instead of caching every block inside it, torch.compile treats it as one
# opaque call, and its backward is the ring backward above. Operators take no process groups: a ring is named by
# its index in _RINGS.
_RINGS: list[Ring] = []


@torch.library.custom_op("paratrain::ring_attention", mutates_args=())
def ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the cp group's chunks: (out like q, lse fp32 (B, Hq, T))."""
    return ring_forward(q, k, v, _RINGS[ring], scale)


@ring_attention_op.register_fake
def _ring_attention_shapes(q, k, v, ring, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _save(ctx, inputs, output):
    q, k, v, ring, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.ring, ctx.scale = ring, scale


def _ring_attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, _RINGS[ctx.ring], ctx.scale)
    return dq, dk, dv, None, None


ring_attention_op.register_autograd(_ring_attention_backward, setup_context=_save)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of q (B, Hq, T, D) over k, v (B, Hkv, T, D), T this rank's two chunks."""
    if ring.index is None:  # one entry per process group
        ring.index = next((i for i, r in enumerate(_RINGS) if r.group is ring.group), len(_RINGS))
        if ring.index == len(_RINGS):
            _RINGS.append(ring)
    return ring_attention_op(q, k, v, ring.index, q.shape[-1] ** -0.5)[0]


# -- the model seam --------------------------------------------------------------------------------------------------


class ContextParallel:
    """`Attention.sequence` under context parallelism: this rank's chunks, their positions, ring attention.
    Also what the training step uses to cut batches (`shard`)."""

    def __init__(self, group):
        self.ring = Ring(group)
        self.cp, self.rank = self.ring.size, self.ring.rank
        self._positions: dict = {}

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (B, T) batch of whole sequences."""
        return shard_sequence(t, self.cp, self.rank, dim=1)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, cos.device)
        if key not in self._positions:
            self._positions[key] = local_positions(length, self.cp, self.rank, cos.device)
        pos = self._positions[key]
        return cos[pos], sin[pos]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.ring)


def attention_modules(modules) -> list[Attention]:
    return [m for module in modules for m in module.modules() if isinstance(m, Attention)]


def apply_context_parallel(model: nn.Module, context: ContextParallel) -> None:
    """Every attention of `model` (a model or a pipeline stage) holds this rank's chunks and attends by ring."""
    for attention in attention_modules([model]):
        attention.sequence = context


@contextlib.contextmanager
def whole_sequences(modules):
    """Attention over whole sequences on every rank for a while (sampling whole prompts), then the ring again."""
    attentions = attention_modules(modules)
    saved = [a.sequence for a in attentions]
    for a in attentions:
        a.sequence = WHOLE_SEQUENCE
    try:
        yield
    finally:
        for a, s in zip(attentions, saved):
            a.sequence = s


class WholeSequenceSampler(nn.Module):
    """A callable model for `generate.sample` under context parallelism: the model's forward over whole prompts."""

    def __init__(self, model: nn.Module, modules):
        super().__init__()
        self._model, self._modules_cp = model, list(modules)

    def train(self, mode: bool = True):
        super().train(mode)
        self._model.train(mode)
        return self

    def forward(self, tokens: torch.Tensor, **cache) -> torch.Tensor:
        with whole_sequences(self._modules_cp):
            return self._model(tokens, **cache)


def context_for(dims) -> ContextParallel | None:
    """The context-parallel seam of this rank (`ParallelDims`), or None without context parallelism."""
    return ContextParallel(dims.cp_group) if dims.layout.cp > 1 else None
