"""Sampling from a trained model (no KV cache: short samples from small models, any layout)."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.distributed.tensors import full_tensor
from paratrain.errors import UserError


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids a sample starts from. An empty prompt (or one that encodes to nothing) starts a new document: the
    tokenizer's BOS, else its EOS, which precedes every document of a prepared corpus."""
    ids = list(tokenizer.encode(text))
    if ids:
        return ids
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if start is None:
        raise UserError("the prompt is empty and this tokenizer has neither a BOS nor an EOS token to start from: "
                        "give a non-empty prompt")
    return [int(start)]


@torch.no_grad()
def sample(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0, device: torch.device | None = None, vocab_limit: int | None = None) -> list[int]:
    """Autoregressive sampling. Deterministic for a seed, and identical on every rank (so sharded
    models, whose forward needs all ranks, stay in step). `vocab_limit` excludes padding ids."""
    if not prompt_ids:
        raise UserError("sampling needs at least one prompt token (see generate.prompt_ids)")
    device = device or torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        # Vocab-parallel logits arrive as a DTensor; sampling needs the whole row.
        logits = full_tensor(model(ids[:, -max_seq_len:]))[:, -1, :vocab_limit].float().cpu()  # (1, V)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt.to(device)], dim=1)
    model.train(was_training)
    return ids[0, len(prompt_ids):].tolist()
