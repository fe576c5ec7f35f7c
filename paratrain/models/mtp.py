"""Multi-token prediction (DeepSeek-V3, section 2.2): `mtp_depth` sequential modules after the last block, module d
(1..D) predicting the token d + 1 places after the next one.

At position i, module d combines the previous depth's hidden state h_i^{d-1} (d = 1: the last block's output, before
the final norm) with the shared input embedding of token t_{i+d}:

    h'_i^d = eh_proj([enorm(Emb(t_{i+d})); hnorm(h_i^{d-1})])    (2C -> C)
    h_i^d  = block_d(h'_i^d)                                      (a Transformer block of the model's kind)
    logits = output(norm_d(h_i^d))                               (its own final norm, the shared output head)

and is trained by the cross-entropy against t_{i+1+d}; the last d positions of a sequence have no such target
(NOT_A_TARGET). The names follow DeepSeek-V3's (enorm, hnorm, eh_proj; `norm` is its shared_head.norm). The block
has index n_layers + d - 1 for its kind (a mixture of experts from `moe_first_dense_layers` on, as DeepSeek-V3's MTP
layer is). Generation, evaluation and export use the main head only: the modules run only when the trainer passes
targets (`Transformer.forward(side_targets=...)`), and export leaves their weights out (`Param.exported`).

A plain nn.Module like the rest of the model: a side head (models/family.SideHead; its table, cost, checks and verify
rows: models/mtp_params.py), attached after the head by `registry.build_model`; its parameters follow the family's
(`layer` None, so a pipeline holds them on its last stage, with the head). The embeddings of the tokens ahead are made
where the shared embedding is (`carry`): under a pipeline the first stage sends them beside the hidden states, as more
channels the stages between pass on (`Transformer.side_inputs`), so the embedding's gradient comes back through the
pipeline's own backward and it stays one weight.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.data.batch import NOT_A_TARGET
from paratrain.models.args import ModelArgs
from paratrain.models.llama import RMSNorm, TransformerBlock, chunked_cross_entropy


def shifted(values: torch.Tensor, d: int, fill: int | None = None) -> torch.Tensor:
    """values (B, T) moved d positions left: position i holds values[i + d]; the last d positions hold `fill`, or
    (None) the first d values (wrapped: a token there feeds only positions without a target, under causal attention)."""
    if fill is None:
        return values.roll(-d, dims=1)
    return torch.cat([values[:, d:], values.new_full((values.shape[0], d), fill)], dim=1)


def embedded_ahead(embedding: nn.Module, tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """The shared embedding of the tokens 1..depth places ahead, side by side: tokens (B, T) -> (B, T, depth C),
    channels [(d - 1) C, d C) holding Emb(t_{i+d})."""
    return torch.cat([embedding(shifted(tokens, d)) for d in range(1, depth + 1)], dim=-1)


class MTPModule(nn.Module):
    """One depth: the block of index `index`, the two input norms, the projection and its own final norm."""

    def __init__(self, args: ModelArgs, index: int, attention):
        super().__init__()
        self.index = index  # its block's index, which decides the block's kind (dense or mixture of experts)
        self.block = TransformerBlock(args, index, attention)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps)  # DeepSeek-V3's shared_head.norm

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents=None) -> torch.Tensor:
        """h: the previous depth's hidden states (B, T, C), embedded: Emb(t_{i+d}) (B, T, C) -> h^d (B, T, C)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))  # (B, T, 2C) -> (B, T, C)
        return self.block(x, cos, sin) if documents is None else self.block(x, cos, sin, documents=documents)


class MultiTokenPrediction(nn.ModuleList):
    """The `mtp_depth` modules, in order."""

    def __init__(self, args: ModelArgs, attention):
        super().__init__([MTPModule(args, args.n_layers + d, attention) for d in range(args.mtp_depth)])

    @staticmethod
    def carried(args: ModelArgs) -> int:
        """Widths of `dim` it reads beside the hidden states: the embeddings of the `mtp_depth` tokens ahead."""
        return args.mtp_depth

    @staticmethod
    def carry(args: ModelArgs, embedding: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Those inputs, made where the embedding is: (B, T) -> (B, T, depth C)."""
        return embedded_ahead(embedding, tokens, args.mtp_depth)

    def extra_blocks(self, prefix: str) -> dict[str, tuple[int, nn.Module]]:
        """Its blocks as the tensor-parallel plan lays them out like the model's: {their parameters' prefix (`prefix`:
        its own in the model): (the block index of their kind, the block)}."""
        return {f"{prefix}{d}.block.": (module.index, module.block) for d, module in enumerate(self)}

    def forward(self, h: torch.Tensor, ahead: torch.Tensor, targets: torch.Tensor, head: nn.Module,
                cos: torch.Tensor, sin: torch.Tensor, documents=None, pieces: int = 1) -> list[torch.Tensor]:
        """Each depth's summed cross-entropy over its targets and their count (a list of D pairs of scalars: the
        trainer divides, weights and adds them). h: the last block's output (B, T, C); ahead: `carry`'s
        `embedded_ahead` (B, T, D C); targets (B, T): the main model's; `head`: the model's shared output head;
        `pieces`: pieces of the head's logits (`chunked_cross_entropy`)."""
        losses = []
        for d, (module, embedded) in enumerate(zip(self, ahead.chunk(len(self), dim=-1)), start=1):
            h = module(h, embedded, cos, sin, documents)  # (B, T, C)
            y = depth_targets(targets, d, documents)  # (B, T)
            losses.append((chunked_cross_entropy(module.norm(h), y, head, pieces, "sum"), (y != NOT_A_TARGET).sum()))
        return losses


def depth_targets(targets: torch.Tensor, depth: int, documents=None) -> torch.Tensor:
    """The targets of depth d (1-based) at each position, (B, T): the main targets moved d left, none at the end, and
    in windows packed with whole documents (`documents`: models/llama.py's Documents) none where the token d ahead is in
    another document (its embedding and target belong to the next one)."""
    moved = shifted(targets, depth, NOT_A_TARGET)
    if documents is None:
        return moved
    same = shifted(documents.document, depth, -1) == documents.document  # (B, T)
    return moved.masked_fill(~same, NOT_A_TARGET)
