"""Sampling from a trained model: the KV cache and the one decode loop (`Decoder`) that `paratrain generate`
(`sample`) and lm-eval's `generate_until` (paratrain/harness/model.py) share, on one process or a run's layout.

With the cache, the prompt runs once (prefill) and every new token is one forward of that token alone over the cached
keys and values; without it (`use_cache=False`, or a model whose answer depends on the tokens in a forward:
`cache_exact`), every token is a forward over the whole context, as before. Both give the same greedy tokens.
A generated token of a small model is per-operator overhead, not arithmetic: its cached forward runs on
`Decoder.fast`'s path (one thread, inference mode, plain attributes), which changes no number.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.distributed.tensors import full_tensor
from paratrain.errors import UserError
from paratrain.models.llama import Transformer, whole_width_tables
from paratrain.models.moe import moe_modules

PAD_ID = 0  # the token under a left pad (masked out: any id would do)
# A cached forward on the CPU whose products are at most this many multiply-adds (its B x T rows times the largest
# weight matrix) runs on one thread: waking the others costs more than they save on products that small (a
# generated token of the default model: 1 x 128 by 128 x 352), and a descheduled thread stalls every product.
ONE_THREAD_WORK = 1 << 20


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


def cache_exact(moe_layers) -> bool:
    """Whether decoding one token at a time over a cache gives what a forward over the whole context gives, for a
    model with these MoE layers (models/moe.py `moe_modules`): not with a capacity limit (how many tokens each expert
    takes depends on the tokens in the forward)."""
    return all(m.capacity_factor <= 0 for m in moe_layers)


class KVCache:
    """The keys and values of a batch's tokens so far, per attention module (its local heads: under tensor
    parallelism each rank's own; under a pipeline each stage's own modules), given to the model's forward as
    `cache=` (models/llama.py: `Transformer.forward` asks it for the new tokens' rotary angles, each attention hands
    it its new keys and values and it attends).

    Rows are left-padded to one length (`pads`: each row's padding slots, masked out; a row's positions start after
    them). A forward writes its T tokens' keys after the committed `length`; `commit(n)` keeps the first n of them (a
    forward right-padded for sequence parallelism writes padding that must not stay). The keys live in buffers of
    `capacity` slots written in place (a concatenation per token would copy the whole cache every token), doubled
    when a forward would pass them. `last_only`: the model computes the logits of the last position only (set by a
    `Decoder` whose model reads its tokens' last position as the next token's)."""

    def __init__(self, pads: list[int] | None = None, device=None, capacity: int = 0, last_only: bool = False):
        self.length, self.capacity, self.last_only = 0, capacity, last_only
        self.pads = torch.tensor(pads, device=device) if pads and any(pads) else None  # (B,) or None: no padding
        self.kv: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}  # (B, Hkv, capacity, D) each
        self._real = None  # (B, 1, 1, capacity) bool: the slots that are not padding (decoding's mask)
        self._mask = None  # (key, mask): a forward's attention mask, shared by its layers
        self._angles = None  # (1, rows, 1, D) each: the whole-width rotary tables of positions 0..rows-1

    def angles(self, cos: torch.Tensor, sin: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary angles of the next T tokens from the (max_seq_len, D/2) tables, as apply_rope's whole-width
        tables (models/llama.py `whole_width_tables`, made once per cache: a token's rotation is then 4 ops): (1, T,
        1, D), or (B, T, 1, D) with padding (a left pad at position 0, a right pad past the table's end at its last
        row)."""
        if self._angles is None or self._angles[0].shape[1] < min(cos.shape[0], self.length + T):
            rows = min(cos.shape[0], max(self.capacity, 2 * (self.length + T)))  # grown by doubling, as the keys
            self._angles = tuple(t[None, :, None] for t in whole_width_tables(cos[:rows], sin[:rows]))  # (1, rows, 1, D)
        whole_cos, whole_sin = self._angles
        if self.pads is None and self.length + T <= whole_cos.shape[1]:
            return whole_cos[:, self.length:self.length + T], whole_sin[:, self.length:self.length + T]
        pos = torch.arange(self.length, self.length + T, device=cos.device)[None, :]  # (1, T)
        if self.pads is not None:
            pos = pos - self.pads[:, None].to(cos.device)  # (B, T)
        pos = pos.clamp(0, whole_cos.shape[1] - 1)
        return whole_cos[0][pos], whole_sin[0][pos]  # (B or 1, T, 1, D)

    def attend(self, owner: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, T, D) of the new tokens over the cached keys and the new k, v (B, Hkv, T, D) -> (B, Hq, T, D)."""
        T, S = q.shape[2], self.length + q.shape[2]
        k_all, v_all = self._stored(owner, k, v, S)
        k_all[:, :, self.length:S] = k  # in place: the slots after the committed ones
        v_all[:, :, self.length:S] = v
        k, v = k_all[:, :, :S], v_all[:, :, :S]  # (B, Hkv, S, D) views
        # enable_gqa: each KV head serves its query heads without a copy (repeat_kv's), the same numbers
        gqa = k.shape[1] != q.shape[1]
        if self.pads is None and S == T:  # the prompt: exactly the no-cache path's attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if self.pads is None and T == 1:  # one new token sees every key
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(T, S, q.device), enable_gqa=gqa)

    def _stored(self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor, S: int):
        """This attention's key and value buffers, with room for S slots (allocated, or doubled and copied)."""
        old = self.kv.get(owner)
        if old is not None and old[0].shape[2] >= S:
            return old
        size = max(S, self.capacity, 2 * old[0].shape[2] if old is not None else 0)
        new = tuple(t.new_zeros(t.shape[0], t.shape[1], size, t.shape[3]) for t in (k, v))  # (B, Hkv, size, D)
        if old is not None:
            for buffer, kept in zip(new, old):
                buffer[:, :, :self.length] = kept[:, :, :self.length]
        self.kv[owner] = new
        return new

    def mask(self, T: int, S: int, device) -> torch.Tensor:
        """(B or 1, 1, T, S): a new token sees the keys up to its own slot, but padding; a pad sees itself (a row of
        nothing but -inf would make NaNs, which would reach the real tokens through 0 x NaN)."""
        if T == 1 and self.pads is not None:  # decoding: the new slot is a real token's, so the mask is `real`
            if self._real is None or self._real.shape[-1] < S:
                j = torch.arange(max(2 * S, self.capacity), device=device)
                self._real = (j[None, :] >= self.pads.to(device)[:, None])[:, None, None]  # (B, 1, 1, capacity)
            return self._real[..., :S]
        key = (T, S, self.length)
        if self._mask is None or self._mask[0] != key:
            slot = torch.arange(S - T, S, device=device)[:, None]  # (T, 1): the new tokens' slots
            j = torch.arange(S, device=device)[None, :]  # (1, S)
            real = torch.ones(1, 1, S, dtype=torch.bool, device=device) if self.pads is None else \
                j[None] >= self.pads.to(device)[:, None, None]  # (B, 1, S)
            self._mask = (key, (((j <= slot) & real) | (j == slot))[:, None])
        return self._mask[1]

    def commit(self, n: int) -> None:
        self.length += n


class Decoder:
    """A batch of prompts decoded together: `logits()` gives the next token's logits of every row, `append(tokens)`
    extends the rows. With `use_cache` the prompts are left-padded to one length and run once, then one token per
    forward over a `KVCache`; once a row would pass the `window` (the most tokens one forward sees) the cache is
    dropped and every forward runs over the last `window` tokens, as without it (one row only). `max_new`: the most
    tokens the rows will grow by (the cache's buffers are made that long at once; 0: they grow as needed)."""

    def __init__(self, model: nn.Module, prompts: list[list[int]], window: int, device=None,
                 vocab_limit: int | None = None, use_cache: bool = True, max_new: int = 0):
        if not use_cache and len(prompts) > 1:
            raise ValueError("without a cache, a Decoder decodes one prompt at a time")
        self.model, self.window, self.vocab_limit = model, window, vocab_limit
        self.device = device or torch.device("cpu")
        longest = max(len(p) for p in prompts)
        pads = [longest - len(p) for p in prompts]
        self.ids = torch.tensor([[PAD_ID] * n + list(p) for n, p in zip(pads, prompts)], device=self.device)  # (B, L)
        # A model itself (not a sampler that pads the tokens or runs a pipeline's stages) gives its tokens' last
        # position's logits alone: the prompt's output projection over one position, not every one
        capacity = min(window, longest + max_new) if max_new else 0
        self.cache = KVCache(pads, self.device, capacity, last_only=isinstance(model, Transformer)) \
            if use_cache else None
        # the largest weight matrix a forward multiplies by (a sampler that hides its model's: assume a large one)
        self.largest = max((p.numel() for p in model.parameters() if p.dim() == 2), default=ONE_THREAD_WORK + 1)
        # A model this process holds whole (no DTensor: nothing sharded by FSDP or tensor parallelism, whose forwards
        # swap and gather parameters) decodes on `Decoder.fast`'s path
        self.local = not any(isinstance(p, DTensor) for p in model.parameters())
        self.direct = DirectAttributes(model.modules()) if self.local else None

    @contextlib.contextmanager
    def fast(self, tokens: int):
        """Around a cached forward of `tokens` tokens (B x T): what makes a generated token cheap where the numbers
        stay the same. One intra-op thread for small products (`ONE_THREAD_WORK`); for a local model, inference mode
        (no autograd bookkeeping per op) and `DirectAttributes`."""
        with contextlib.ExitStack() as stack:
            if self.device.type == "cpu" and tokens * self.largest <= ONE_THREAD_WORK:
                stack.enter_context(intra_op_threads(1))
            if self.local:
                stack.enter_context(torch.inference_mode())
                stack.enter_context(self.direct)
            yield

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """(B, V) float32 on the CPU: every row's logits for its next token (the same on every rank)."""
        if self.cache is not None and self.ids.shape[1] > self.window:
            if self.cache.pads is not None:
                raise ValueError("a left-padded batch must fit in the window")
            self.cache = None  # past the window: the no-cache path's sliding window from here on
        if self.cache is None:
            out = self.model(self.ids[:, -self.window:])
        else:
            new = self.ids[:, self.cache.length:]  # (B, T): the tokens the cache has not seen
            with self.fast(new.numel()):
                out = self.model(new, cache=self.cache)
            self.cache.commit(new.shape[1])
        # Vocab-parallel logits arrive as a DTensor; sampling needs the whole row.
        return full_tensor(out)[:, -1, :self.vocab_limit].float().cpu()

    def append(self, tokens: list[int]) -> None:
        self.ids = torch.cat([self.ids, torch.tensor(tokens, device=self.device)[:, None]], dim=1)


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op threads set to n inside (a process-wide setting: restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DirectAttributes:
    """Inside (`with`): the modules' parameters, buffers and submodules as plain instance attributes, removed after.
    nn.Module keeps them in its own tables, so each `self.weight` or `self.wq` in a forward first fails Python's
    attribute lookup, raising (and formatting) an AttributeError, before `Module.__getattr__` finds it: ~120 times
    per forward of the default model, a sixth of a generated token's instructions. Only around forwards that replace
    no parameter (Module.__setattr__ of a parameter drops such an entry anyway)."""

    def __init__(self, modules):
        self.entries = [(m.__dict__, name, table) for m in modules
                        for table in (m._parameters, m._buffers, m._modules) for name in table if name not in m.__dict__]

    def __enter__(self):
        for attributes, name, table in self.entries:
            if name in table:
                attributes[name] = table[name]

    def __exit__(self, *exc):
        for attributes, name, _ in self.entries:
            attributes.pop(name, None)


def choose(logits: torch.Tensor, temperature: float, top_k: int = 0, generator=None) -> int:
    """The next token from one row's logits (V,): the most likely at temperature 0, else a draw."""
    if temperature == 0:
        return int(logits.argmax(-1))
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def sample(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, temperature: float = 0.8,
           top_k: int = 0, seed: int = 0, device: torch.device | None = None, vocab_limit: int | None = None,
           use_cache: bool = False) -> list[int]:
    """Autoregressive sampling. Deterministic for a seed, and identical on every rank (so sharded
    models, whose forward needs all ranks, stay in step). `vocab_limit` excludes padding ids. `use_cache`: a KV cache
    where it gives the same tokens (`cache_exact`; the model must take `cache=`: a model, or a train step's
    `sampler`)."""
    if not prompt_ids:
        raise UserError("sampling needs at least one prompt token (see generate.prompt_ids)")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    decoder = Decoder(model, [prompt_ids], max_seq_len, device, vocab_limit,
                      use_cache and cache_exact(moe_modules(model)), max_new=max_new_tokens)
    out = []
    for _ in range(max_new_tokens):
        out.append(choose(decoder.logits()[0], temperature, top_k, gen))
        decoder.append(out[-1:])
    model.train(was_training)
    return out
