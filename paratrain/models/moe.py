"""Mixture-of-experts feed-forward: router -> top-k -> dispatch -> grouped expert matmul -> combine.

A plain nn.Module like the rest of the model. Everything that moves tokens between processes goes
through `self.dispatcher`: the default `LocalDispatcher` keeps every expert in this process, and
expert parallelism (`paratrain/distributed/expert_parallel.py`) swaps in an all-to-all dispatcher
when it shards the experts; this file never changes for it.

Numerics that are the same on every layout (so `paratrain verify` can compare at 1e-5):

- Routing is fp32. Ties in the top-k are broken toward the lower expert index (stable sort).
- Group-limited routing (DeepSeek-V3, `n_group` > 1): the experts form n_group equal groups, a group scores the sum
  of its two best experts, and a token's top-k are chosen among the experts of its `topk_group` best groups.
- Gates are the selected scores, renormalised to sum to 1 when top_k > 1 (Mixtral and Qwen3-MoE for softmax,
  DeepSeek-V3 for sigmoid) unless `norm_topk` is off (Qwen-MoE's norm_topk_prob=false); with top_k = 1 the raw
  score (Switch), so the router still gets a gradient. Then times `routed_scaling_factor` (DeepSeek-V3's 2.5).
- The shared experts see every token; with `shared_gate` (Qwen2-MoE) their output is scaled by
  sigmoid(shared_gate(x)), a learned dim -> 1 linear.
- Each token's output is the gate-weighted sum of its experts in rank order (never an atomic scatter).
- The load-balancing loss and the capacity limit are defined per sequence, not per batch: a sequence
  is never split across data-parallel ranks, so both are independent of how the batch is laid out.
  aux = mean over sequences of E * sum_e f_e * P_e (Switch/GShard), where f_e is the fraction of the
  sequence's top-k assignments routed to expert e and P_e the mean router probability of e over the
  sequence (for sigmoid scores, the scores normalised to sum to 1 per token, as DeepSeek-V3 does).
  It is 1 for a perfectly balanced router and E for one that sends everything to one expert.
  This is DeepSeek-V3's "sequence-wise" balance loss; a batch-wise one would need a global reduction
  to be layout-independent.
- The balance loss is no separate root of backward: the forward returns its output through `AuxLossScaler`, which
  hands the loss the gradient aux_loss_coef x `aux_loss_scale` when the output's gradient arrives (Megatron's
  MoEAuxLossAutoScaler), so a pipeline schedule that backpropagates only the last stage's loss trains it too. The
  trainer sets `aux_loss_scale` (1/accum, times fp16's loss scale) before the forward; None (the default) leaves the
  output alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.args import SCORE_FUNCS  # noqa: E402 (re-exported)
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with an explicit backward (two more grouped GEMMs), which also accepts the
    non-contiguous gradients (e.g. the expanded one of `.sum()`) that the built-in backward rejects."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(x.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None  # (E, a, b)
        return grad_x, grad_w, None


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not _HAS_GROUPED_MM or x.dtype != w.dtype:
        return False
    # Rows (and the transposed operands of the backward) must be 16-byte aligned.
    align = 16 // x.element_size()
    if w.shape[-1] % align or w.shape[-2] % align:
        return False
    if x.device.type == "cpu":
        # The compiler's shape function only knows the bf16 (CUDA) variant.
        return x.dtype == torch.bfloat16 or (x.dtype in (torch.float32, torch.float16)
                                             and not torch.compiler.is_compiling())
    if x.device.type == "cuda":
        # The CUDA kernel is bf16 only, on Hopper and newer.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (N, a) holds its rows grouped by expert (counts[e] rows for expert e, in expert order);
    w (E, a, b) stacks the experts' matrices. Returns (N, b) with row i = x[i] @ w[expert of i].

    One grouped GEMM (`torch._grouped_mm`) where available, else one matmul per contiguous group.
    """
    if x.shape[0] == 0:
        # No tokens here this step: still a graph to the expert weights (a zero gradient), so every rank
        # reduces the same set of gradients.
        return x @ w[0]
    if use_grouped_mm(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return _GroupedMM.apply(x.contiguous(), w, offs)
    return torch.cat([seg @ w[e] for e, seg in enumerate(x.split(counts.tolist())) if seg.shape[0]])


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked 3-D weights, computed with grouped matmuls.

    w1, w3: (E, dim, hidden); w2: (E, hidden, dim). Expert parallelism shards dim 0.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights of the experts held here (expert parallelism overrides this to give its local shard)."""
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim) grouped by expert, counts (E_local,) -> (N, dim)."""
        w1, w2, w3 = self.weights()
        return grouped_mm(F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts), w2, counts)


class AuxLossScaler(torch.autograd.Function):
    """Identity on the MoE output `y`; in backward, gives `aux` (a scalar) the gradient `scale`, so the balance loss
    trains with the output's backward. Under activation checkpointing only the first forward's node runs backward (a
    non-reentrant recomputation only refills saved tensors), so the loss counts once."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.aux_like, ctx.scale = aux.detach(), scale  # a scalar's metadata (plain or DTensor), not a saved tensor
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones_like(ctx.aux_like) * ctx.scale, None


class Router(nn.Module):
    """Token-to-expert logits, computed in fp32 whatever the training precision (routing decisions are
    discontinuous; low-precision logits would flip them between layouts and runs)."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())  # (N, E)


def choose_experts(choice: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """choice (N, E) fp32: the scores the experts are chosen by -> the top_k expert ids (N, k), best first.

    With n_group > 1 only the experts of each token's `topk_group` best groups compete (DeepSeek-V3): a group
    scores the sum of its two best experts. Every sort is stable and descending, so ties go to the lower index."""
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)  # (N, G, E/G)
        best = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # (N, G): only values, ties do not matter
        groups = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :topk_group]  # (N, topk_group)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)  # (N, G)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(N, E)
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]


class LocalDispatcher:
    """Every expert lives in this process: dispatch and combine are the identity."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """x (N, dim) grouped by global expert, counts (E,) -> (tokens for the local experts grouped by
        local expert, their counts, context for combine)."""
        return x, counts, None

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        """Expert outputs back in the order `dispatch` received the tokens."""
        return y


class MoE(nn.Module):
    """Drop-in replacement for the dense FeedForward: (B, T, dim) -> (B, T, dim).

    After each forward it leaves, for the trainer and the metrics:
      aux_loss           the unscaled load-balancing loss (a scalar with gradient; scale by aux_loss_coef)
      tokens_per_expert  (E,) top-k assignments per expert in this forward (before capacity dropping)
      dropped            assignments dropped by the capacity limit (0-d int tensor)

    `expert_bias` (DeepSeek-V3's auxiliary-loss-free balancing): a persistent fp32 buffer (E,) of zeros added to the
    scores that choose the top-k, never to the gates; `[moe] balancing = "aux_free"` updates it.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, hidden: int, shared: nn.Module | None = None,
                 score_func: str = "softmax", norm_topk: bool = True, aux_loss_coef: float = 0.01,
                 capacity_factor: float = 0.0, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, shared_gate: bool = False, expert_bias: bool = False):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"moe score function '{score_func}' is not one of {', '.join(SCORE_FUNCS)}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"moe top_k={top_k} must be between 1 and the number of experts ({n_experts})")
        if n_experts % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * n_experts // n_group:
            raise ValueError(f"moe top_k={top_k} of {n_experts} experts in {n_group} groups cannot be chosen from "
                             f"the best {topk_group} group(s)")
        self.n_experts, self.top_k, self.score_func = n_experts, top_k, score_func
        self.renormalise = norm_topk and top_k > 1  # top-1 keeps the raw score (Switch): the router gets a gradient
        self.aux_loss_coef, self.capacity_factor = aux_loss_coef, capacity_factor
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.router = Router(dim, n_experts)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.shared = shared  # applied to every token and added (DeepSeekMoE's shared experts), or None
        # Qwen2-MoE: the shared output times sigmoid(shared_gate(x)); after `shared`, the parameter table's order.
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared is not None and shared_gate else None
        self.dispatcher = LocalDispatcher()
        self.register_buffer("expert_bias", torch.zeros(n_experts) if expert_bias else None)  # (E,) fp32, or None
        self.aux_loss_scale: float | torch.Tensor | None = None  # the balance loss's gradient factor (set by trainers)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        """The routing bias starts at zero (after materialising from meta; a checkpoint then loads its own)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> (probabilities (N, E) fp32 for the balance loss, expert ids (N, k), gates (N, k) fp32)."""
        logits = self.router(x)  # (N, E) fp32
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias  # the bias chooses, never weighs
        idx = choose_experts(choice, self.top_k, self.n_group, self.topk_group)  # (N, k)
        top = scores.gather(1, idx)  # (N, k): the gates keep the unbiased scores
        gates = top / top.sum(-1, keepdim=True) if self.renormalise else top
        if self.routed_scaling_factor != 1.0:
            gates = gates * self.routed_scaling_factor
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, idx, gates

    def capacity(self, seq_len: int) -> int:
        """Assignments each expert accepts per sequence (0: unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        E, k = self.n_experts, self.top_k
        flat = x.reshape(B * T, C)
        probs, idx, gates = self.route(flat)  # (N, E), (N, k), (N, k)

        # Load balance per sequence (see the module docstring).
        assigned = torch.zeros_like(probs).scatter_(1, idx, 1.0)  # (N, E) one-hot of the top-k
        f = assigned.view(B, T, E).sum(1) / (T * k)  # (B, E), sums to 1 per sequence
        P = probs.view(B, T, E).mean(1)  # (B, E)
        aux = E * (f * P).sum(-1).mean()
        # Activation checkpointing re-runs this forward inside backward; keeping that recomputation's aux
        # loss would hold the block's recomputed activations alive until the next step.
        if torch._C._current_graph_task_id() == -1:
            self.aux_loss = aux
            self.tokens_per_expert = assigned.sum(0).detach().long()

        expert = idx.flatten()  # (N * k,) token-major: assignment a belongs to token a // k
        cap = self.capacity(T)
        if cap:
            # Per sequence, each expert takes at most `cap` assignments: first choices before second
            # choices, earlier tokens before later ones (GShard); the rest are dropped (gate 0).
            onehot = F.one_hot(idx.view(B, T, k), E).transpose(1, 2).reshape(B, k * T, E)  # (B, k*T, E) choice-major
            position = (onehot.cumsum(1) * onehot).sum(-1).view(B, k, T).transpose(1, 2)  # (B, T, k), 1-based
            keep = (position <= cap).reshape(-1)
            expert = torch.where(keep, expert, E)  # dropped assignments sort after every real expert
            self.dropped = (~keep).sum()
        else:
            self.dropped = torch.zeros((), dtype=torch.long, device=x.device)

        order = torch.argsort(expert, stable=True)  # group by expert; token order inside each group
        counts = torch.bincount(expert, minlength=E + 1)[:E]
        n_routed = int(counts.sum()) if cap else expert.numel()
        routed = flat[order[:n_routed] // k]  # (n_routed, C)

        local, local_counts, ctx = self.dispatcher.dispatch(routed, counts)
        out = self.dispatcher.combine(self.experts(local, local_counts), ctx)  # (n_routed, C)

        if n_routed < expert.numel():
            out = torch.cat([out, out.new_zeros(expert.numel() - n_routed, C)])
        out = out[torch.argsort(order)].view(B * T, k, C)  # back to (token, choice)
        y = (out * gates.to(out.dtype).unsqueeze(-1)).sum(1)  # gate-weighted sum in choice order
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared  # (N, 1) gate per token
            y = y + shared
        if self.aux_loss_scale is not None and self.aux_loss_coef and torch.is_grad_enabled():
            y = AuxLossScaler.apply(y, aux, self.aux_loss_coef * self.aux_loss_scale)
        return y.view(B, T, C)


def moe_options(args) -> dict:
    """MoE's keyword arguments beyond its shape from a ModelArgs (routing, balancing, capacity, the shared gate)."""
    return dict(score_func=args.moe_score_func, norm_topk=args.moe_norm_topk, aux_loss_coef=args.moe_aux_loss_coef,
                capacity_factor=args.moe_capacity_factor, n_group=args.moe_n_group, topk_group=args.moe_topk_group,
                routed_scaling_factor=args.moe_routed_scaling_factor, shared_gate=args.moe_shared_gate,
                expert_bias=args.moe_expert_bias)


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(modules: list[MoE], scale: float | torch.Tensor | None) -> None:
    """The factor of every MoE layer's balance-loss gradient in the next forwards (None: no balance-loss gradient)."""
    for m in modules:
        m.aux_loss_scale = scale
