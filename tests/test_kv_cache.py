"""Generation over a KV cache (paratrain/generate.py) gives the tokens of a forward over the whole context per token:
on one process for every family (Llama, Qwen3, experts, MLA, LoRA), batched with left padding, past the context
window; and lm-eval's `generate_until` on the layouts eval runs (ddp2, fsdp2, tp2 with sequence parallelism, pp2)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from paratrain.config import load_config
from paratrain.distributed.env import init_distributed, shutdown_distributed
from paratrain.distributed.initialize import init_weights
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.generate import Decoder, sample
from paratrain.harness.model import Generation, ParatrainLM
from paratrain.layout import Layout
from paratrain.models import build_model, preset_args
from paratrain.training.step import StepOptions, build_train_step

V = 96
LAYOUTS = {"ddp2": ["parallel.dp_mode=ddp"], "fsdp2": ["parallel.dp_mode=fsdp"], "tp2+sp": ["parallel.tp=2"],
           "pp2": ["parallel.pp=2"]}


def _model(preset: str, lora: bool = False):
    model = build_model(preset_args(preset, vocab_size=V))
    if lora:  # adapters on every projection, their B not zero (else they add nothing)
        from paratrain.capabilities.lora import LoRA
        from paratrain.models.lora import apply_lora

        apply_lora(model, LoRA(4))
    init_weights(model, 3)
    with torch.no_grad():  # larger weights than the init's: logits far from uniform, greedy tokens that differ
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model, prompts, steps, window, use_cache):
    """Each row's greedy tokens and the logits of every step, (steps, B, V)."""
    decoder, tokens, seen = Decoder(model, prompts, window, use_cache=use_cache), [], []
    for _ in range(steps):
        logits = decoder.logits()
        seen.append(logits)
        tokens.append(logits.argmax(-1).tolist())
        decoder.append(tokens[-1])
    return [list(row) for row in zip(*tokens)], torch.stack(seen)


@pytest.mark.parametrize("preset,lora", [("tiny", False), ("tiny-qwen3", False), ("tiny-moe", False),
                                         ("tiny-mla", False), ("tiny", True)])
def test_cache_gives_the_tokens_of_whole_forwards(preset, lora):
    model = _model(preset, lora)
    prompts = [_prompt(13, 1), _prompt(4, 2), _prompt(8, 3)]
    singles = [_greedy(model, [p], 12, 64, use_cache=False) for p in prompts]
    for p, (tokens, logits) in zip(prompts, singles):
        cached, cached_logits = _greedy(model, [p], 12, 64, use_cache=True)
        assert cached == tokens
        torch.testing.assert_close(cached_logits, logits, rtol=0, atol=1e-4)
    batched, batched_logits = _greedy(model, prompts, 12, 64, use_cache=True)  # left-padded to one length
    assert batched == [t[0] for t, _ in singles]
    torch.testing.assert_close(batched_logits, torch.cat([l for _, l in singles], dim=1), rtol=0, atol=1e-4)
    assert len(set(map(tuple, batched))) == 3 and len(set(batched[0])) > 2  # the models say something


def test_cache_is_written_in_place():
    """With the rows' token budget known (`max_new`) the keys go into buffers made once, never copied again; without
    it they grow by doubling. Both give the tokens of the no-cache path (the logits of the last position only)."""
    model = _model("tiny")
    prompts = [_prompt(9, 1), _prompt(3, 2)]
    grown, _ = _greedy(model, prompts, 10, 64, use_cache=True)
    decoder = Decoder(model, prompts, 64, max_new=10)
    first = decoder.logits()
    assert first.shape == (2, V) and decoder.cache.last_only
    buffers = [k.data_ptr() for k, _ in decoder.cache.kv.values()]
    tokens = [first.argmax(-1).tolist()]
    for _ in range(9):
        decoder.append(tokens[-1])
        tokens.append(decoder.logits().argmax(-1).tolist())
    assert [k.data_ptr() for k, _ in decoder.cache.kv.values()] == buffers
    assert [list(row) for row in zip(*tokens)] == grown == [_greedy(model, [p], 10, 64, False)[0][0] for p in prompts]


def test_cache_past_the_window_slides_like_whole_forwards():
    model = _model("tiny")
    prompt = _prompt(14)
    assert sample(model, prompt, 10, 16, temperature=0, use_cache=True) == sample(model, prompt, 10, 16, temperature=0)
    assert sample(model, prompt, 10, 16, temperature=1.0, top_k=5, seed=3, use_cache=True) == \
        sample(model, prompt, 10, 16, temperature=1.0, top_k=5, seed=3)


class _Tokens:
    """Ids as text ("12 7 40"): what `Generation.step` decodes and looks for stop sequences in."""
    vocab_size, eos_id, bos_id = V, 1, None

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(x) for x in text.split()]


def _jobs() -> list[Generation]:
    lengths = (3, 9, 17, 4, 30, 2, 11)
    return [Generation(_prompt(n, n), ["7 7"], 8, 0.0 if n % 2 else 0.7) for n in lengths] + \
        [Generation(_prompt(60, 60), [], 8, 0.0)]  # past max_length (64) before its end: one at a time, sliding


def _generations(layouts: dict) -> dict:
    """Every layout's generate_until answers with the cache (and one process's without), built on the same launched
    ranks."""
    env = init_distributed("cpu")
    args = preset_args("tiny", vocab_size=V)
    out = {}
    for name, overrides in layouts.items():
        cfg = load_config(None, overrides)
        layout = Layout.from_config(cfg.parallel, env.world_size).validate(args, env.world_size).forward_only()
        dims = ParallelDims.build(layout, "cpu")
        step = build_train_step(args, dims, None, env.device, StepOptions(seed=3))
        for use_cache in (False, True) if name == "one" else (True,):  # (without: the one-process reference)
            lm = ParatrainLM(step, _Tokens(), 64, 3, layout.dp, dims.dp_rank, V, seed=5, use_cache=use_cache)
            out[name, use_cache] = lm._generate(_jobs())
    if dist.is_initialized():
        dist.barrier()
    shutdown_distributed()
    return out


def test_generate_until_with_cache_on_every_eval_layout():
    from paratrain.distributed.launch import launch

    reference = _generations({"one": []})
    assert reference["one", True] == reference["one", False]
    assert len(set(reference["one", False])) > 4
    answers = launch(_generations, (LAYOUTS,), 2)
    for name in LAYOUTS:
        assert answers[name, True] == reference["one", False], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_width_rotary_tables_rotate_bitwise_as_the_half_tables(dtype):
    from paratrain.models.llama import apply_rope, rope_tables, whole_width_tables

    cos, sin = rope_tables(16, 40, 10000.0)  # (40, 8)
    x = torch.randn(2, 40, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)  # (B, T, H, D)
    whole = tuple(t[None, :, None] for t in whole_width_tables(cos, sin))  # (1, T, 1, D)
    assert torch.equal(apply_rope(x, *whole), apply_rope(x, cos, sin))


def test_fast_decoding_changes_no_number_and_leaves_the_model_as_it_was(monkeypatch):
    """A generated token's forward on one thread, in inference mode, with the modules' parameters as plain
    attributes (Decoder.fast) gives the logits of the plain cached forward bitwise; the thread count and the modules
    are as before after each step."""
    model = _model("tiny-qwen3")
    prompts = [_prompt(9, 1), _prompt(3, 2)]
    _, fast = _greedy(model, prompts, 6, 64, use_cache=True)
    monkeypatch.setattr(Decoder, "fast", lambda self, tokens: contextlib.nullcontext())
    _, plain = _greedy(model, prompts, 6, 64, use_cache=True)
    assert torch.equal(fast, plain)
    monkeypatch.undo()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a tiny model's token runs on one, and the setting comes back
    try:
        decoder = Decoder(model, prompts, 64, max_new=2)
        assert decoder.local and decoder.direct.entries
        decoder.logits()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert not any(name in m.__dict__ for m in model.modules() for name in [*m._parameters, *m._modules])
