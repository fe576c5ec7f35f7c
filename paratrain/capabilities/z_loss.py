"""z-loss (PaLM, Chowdhery et al. 2022, section 5): `training.z_loss * logsumexp(logits)^2`, averaged over the target
tokens and added to the cross-entropy, keeps the softmax normaliser near 1 (log Z near 0) so the logits do not drift
to magnitudes where bf16 loses them. PaLM used 1e-4. Logged per step as `z_loss` (the penalty's value: the
coefficient times the mean of log Z squared) in metrics.jsonl; the `loss` column includes it, the validation loss
does not.

On every layout: the logits' logsumexp under tensor parallelism's loss parallel is computed on the vocabulary-sharded
logits (DTensor reduces it over the shards) and replicated; a chunked loss computes it per piece of tokens; a
pipeline on its last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.capabilities.base import Capability
from paratrain.errors import ConfigError

KEY = "training.z_loss"


@dataclass
class ZLossKeys:
    # PaLM's z-loss: z_loss x logsumexp(logits)^2, averaged over the target tokens, added to the loss (0: off;
    # PaLM used 1e-4)
    z_loss: float = 0.0


@dataclass(frozen=True)
class ZLoss(Capability):
    coefficient: float = 0.0

    name = "z_loss"
    adds_to = ("training", ZLossKeys)
    verify_rows = {"z_loss-fsdp2": (2, "fsdp", f"{KEY}=1e-4"), "z_loss-tp2": (2, "nodp,tp=2", f"{KEY}=1e-4")}
    reference_keys = (f"{KEY}=",)

    @classmethod
    def from_config(cls, cfg) -> "ZLoss | None":
        return cls(cfg.training.z_loss) if cfg.training.z_loss else None

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.training.z_loss < 0:
            raise ConfigError(f"{KEY} must be >= 0 (0: off), got {cfg.training.z_loss}")

    def loss_term(self, logits, targets, reduction: str):
        """coefficient x logsumexp(logits)^2 over the target tokens: their mean ("mean"), sum ("sum") or each
        ("none"). logits (..., V), targets (...)."""
        # lazy: the config checks and the estimator import capabilities without torch
        import torch

        from paratrain.data.batch import NOT_A_TARGET

        log_z = torch.logsumexp(logits.float(), dim=-1)
        if hasattr(log_z, "full_tensor"):  # loss parallel: a DTensor, replicated after the vocabulary's reduction
            log_z = log_z.full_tensor()
        kept = (targets != NOT_A_TARGET).to(log_z.dtype)
        per_token = self.coefficient * log_z.square() * kept
        if reduction == "none":
            return per_token.flatten()
        total = per_token.sum()
        return total if reduction == "sum" else total / kept.sum().clamp(min=1)
