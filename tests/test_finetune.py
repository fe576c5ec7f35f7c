"""Supervised fine-tuning: the masked loss against transformers, packed windows against each conversation alone, LoRA
(initialisation, its table, every layout, checkpoints, exports loaded by peft and transformers), and the one-line
refusals. Models are tiny and random, the chat data is written here: no network."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.config import load_config  # noqa: E402
from paratrain.data.batch import NOT_A_TARGET, Batch  # noqa: E402

from conftest import fast_overrides  # noqa: E402
from test_chat import save_chat_tokenizer, write_chats  # noqa: E402
from test_distributed import check_matrix  # noqa: E402

SEQ = 48  # the windows: whole conversations (the long ones cut to a window)


def prepare_chat(folder, data_dir, n: int = 48) -> None:
    write_chats(folder / "chat.jsonl", n, long_every=9)
    assert main(["prepare", "--input", str(folder / "chat.jsonl"), "--out", str(data_dir), "--tokenizer",
                 str(folder / "tokenizer.json"), "--chat", "--quiet"]) == 0


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    save_chat_tokenizer(folder)
    prepare_chat(folder, folder / "data")
    return folder / "data"


@pytest.fixture(scope="module")
def hf_chat(tmp_path_factory):
    """A tiny random Hugging Face Llama whose tokenizer has a chat template, and chat data prepared with it."""
    from test_hf import make_llama

    folder = make_llama(tmp_path_factory.mktemp("hf") / "llama")
    save_chat_tokenizer(folder)
    prepare_chat(folder, folder.parent / "data")
    return folder, folder.parent / "data"


def conversations(batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (tokens, targets) of every conversation of a packed batch, each on its own (padding left out)."""
    x, y = batch
    out = []
    for row in range(x.shape[0]):
        starts = (batch.positions[row] == 0).nonzero().flatten().tolist() + [x.shape[1]]
        for a, b in zip(starts, starts[1:]):
            if (y[row, a:b] != NOT_A_TARGET).any():
                out.append((x[row, a:b], y[row, a:b]))
    return out


def alone(batch: Batch) -> Batch:
    """The batch's conversations one per row, padded after their end: causal attention over each alone."""
    rows = conversations(batch)
    x = torch.zeros(len(rows), batch[0].shape[1], dtype=torch.long)
    y = torch.full_like(x, NOT_A_TARGET)
    for k, (tokens, targets) in enumerate(rows):
        x[k, :len(tokens)], y[k, :len(targets)] = tokens, targets
    return Batch(x, y, None, batch.target_count)


def overrides(data_dir, out, name, *extra):
    return fast_overrides(data_dir, out, name, f"training.seq_len={SEQ}", "training.global_batch=4",
                          "checkpoint.save_final=false", "optimizer.warmup_steps=2", *extra)


def test_packed_training_equals_each_conversation_alone(chat_data, tmp_path):
    """20 steps on windows packed with whole conversations (document mask, positions restarting) give the losses of
    training on each conversation alone, one per row, on one process, with accumulation and on fsdp2 (within
    1e-5): the loss is the mean over the global batch's targets however the batch is split."""
    from paratrain.api import run_rank, train_rank
    from paratrain.data.loader import TokenData
    from paratrain.distributed.launch import launch
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.spec import resolve_run
    from paratrain.training.optim import WarmupCosine
    from paratrain.training.step import StepOptions, build_train_step

    steps = 20
    cfg = load_config(None, overrides(chat_data, tmp_path, "one", f"training.steps={steps}", "training.micro_batch=4"))
    packed = train_rank(cfg).losses
    accumulated = train_rank(load_config(None, overrides(chat_data, tmp_path, "accum", f"training.steps={steps}",
                                                         "training.micro_batch=1"))).losses
    fsdp = launch(run_rank, (load_config(None, overrides(chat_data, tmp_path, "fsdp2", f"training.steps={steps}",
                                                         "training.micro_batch=2", "parallel.dp_mode=fsdp")),), 2)
    spec = resolve_run(cfg, 1)
    step = build_train_step(spec.model_args, ParallelDims.build(spec.layout, "cpu"), spec.recipe("cpu"),
                            torch.device("cpu"), StepOptions(seed=cfg.training.seed, optimizer=cfg.optimizer,
                                                             grad_clip=cfg.training.grad_clip))
    scheduler = WarmupCosine(step.optimizer, cfg.optimizer, steps)
    data = TokenData(chat_data, "train", SEQ)
    reference = []
    for s in range(steps):
        batch = data.micro_batches(s, 4, cfg.training.seed, 0, 1, 1)[0]
        loss = step.forward_backward([alone(batch)])
        step.clip()
        step.update()
        scheduler.step()
        step.zero_grad()
        reference.append(float(loss))
    for got in (packed, accumulated, fsdp.losses):
        assert len(got) == steps and max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (got, reference)
    assert reference[-1] < reference[0]


def test_first_masked_loss_equals_transformers(hf_chat, tmp_path):
    """An imported Llama on chat data: the first step's loss is the mean of transformers' cross-entropy over the
    assistant tokens of the global batch, each conversation run alone (within 1e-4)."""
    from transformers import AutoModelForCausalLM

    from paratrain.api import train_rank
    from paratrain.data.loader import TokenData

    folder, data_dir = hf_chat
    cfg = load_config(None, overrides(data_dir, tmp_path, "ft", f"model.init_from=hf:{folder}", "training.steps=1"))
    result = train_rank(cfg)
    batch = TokenData(data_dir, "train", SEQ).global_batch(0, 4, cfg.training.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, targets in conversations(batch):
            logits = model(tokens[None]).logits[0]
            total += F.cross_entropy(logits, targets, ignore_index=NOT_A_TARGET, reduction="sum").item()
            count += int((targets != NOT_A_TARGET).sum())
    assert count == int((batch[1] != NOT_A_TARGET).sum()) > 0
    assert abs(result.losses[0] - total / count) <= 1e-4, (result.losses[0], total / count)


# ---------------------------------------------------------------------------- LoRA

def test_lora_starts_as_the_base_and_its_table_is_the_module():
    """At initialisation the adapted model's logits are the base model's exactly (B = 0); the torch-free table lists
    every parameter of the adapted module in order, shape and trainable flag (a Llama, a mixture of experts with a
    shared expert, q/k/v biases)."""
    from qkv_bias_family import FAMILY  # noqa: F401  (registers the family)

    from paratrain.distributed.initialize import init_weights
    from paratrain.models import build_model, preset_args
    from paratrain.models.lora import apply_lora
    from paratrain.capabilities.lora import LoRA
    from paratrain.models.lora_params import adapted_params
    from paratrain.models.registry import parameters

    for args in (preset_args("tiny", vocab_size=128), preset_args("tiny-moe", vocab_size=128),
                 preset_args("tiny", vocab_size=128, family=FAMILY.name)):
        lora = LoRA(4, targets=("wq", "wv", "w2"))
        base, adapted = build_model(args), build_model(args)
        init_weights(base, 3)
        apply_lora(adapted, lora)
        init_weights(adapted, 3)
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(base(x), adapted(x))
        table = [(p.name, p.shape, p.trainable) for p in adapted_params(parameters(args), lora)]
        assert table == [(n, tuple(p.shape), p.requires_grad) for n, p in adapted.named_parameters()]
        assert any(t for _, _, t in table) and not all(t for _, _, t in table)


def test_verify_lora_matrix(char_data):
    """LoRA on fsdp2, tp2 and pp2 against one process training the same adapters: losses, final weights and the val
    loss of the reference's (adapters-only) checkpoint."""
    from paratrain.verify import CAPABILITY_MATRICES

    check_matrix(CAPABILITY_MATRICES["lora"], char_data)


def test_lora_checkpoints_and_exports(hf_chat, tmp_path, capsys):
    """LoRA on an imported model: checkpoints hold the adapters and their optimizer state (and name the base), resume
    exactly; the PEFT export loads onto the base with peft and the merged export with AutoModelForCausalLM, both
    with paratrain's logits (1e-4); generation reads the checkpoint with its base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from paratrain.api import train_rank
    from paratrain.training import safe_dcp
    from paratrain.training.adapters import AdaptedCheckpoint
    from paratrain.training.checkpoint import load_trainer_state

    folder, data_dir = hf_chat
    lora = [f"model.init_from=hf:{folder}", "lora.rank=4", "lora.alpha=8", "optimizer.lr=2e-2"]
    first = train_rank(load_config(None, overrides(data_dir, tmp_path, "lora", *lora, "training.steps=4",
                                                   "checkpoint.every=2", "checkpoint.save_final=true")))
    ckpt = tmp_path / "lora" / "checkpoints" / "step-4"
    saved = safe_dcp.read_metadata(ckpt).state_dict_metadata
    tensors = [k for k in saved if k.startswith(("model.", "optim.state."))]
    assert tensors and all(".lora_" in k for k in tensors), tensors  # adapters and their Adam moments only
    state = load_trainer_state(ckpt)
    assert state["lora"]["rank"] == 4 and state["lora_base"] == f"hf:{folder}"
    resumed = train_rank(load_config(None, overrides(data_dir, tmp_path, "again", *lora, "training.steps=4",
                                                     f"checkpoint.resume={tmp_path / 'lora/checkpoints/step-2'}")))
    assert resumed.losses == first.losses[2:]

    model = AdaptedCheckpoint.of(ckpt, state).build()
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if n.endswith("lora_b"))
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    assert main(["export", str(tmp_path / "lora"), "--format", "peft", "--out", str(tmp_path / "adapter"),
                 "--dtype", "fp32"]) == 0
    assert main(["export", str(tmp_path / "lora"), "--format", "hf", "--out", str(tmp_path / "merged"),
                 "--dtype", "fp32"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and "q_proj" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model.eval()(x)
        torch.testing.assert_close(peft_model(x).logits, ours, rtol=0, atol=1e-4)
        torch.testing.assert_close(merged(x).logits, ours, rtol=0, atol=1e-4)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "lora"), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("The")


def test_lora_refusals(chat_data, char_data, tmp_path, capsys):
    """One line each: unknown LoRA targets; resuming a LoRA checkpoint without LoRA; a PEFT export of a preset's
    adapters; windows of whole documents under context parallelism."""
    from paratrain.api import train_rank
    from paratrain.errors import ConfigError, UserError
    from paratrain.spec import resolve_run

    with pytest.raises(ConfigError, match="lora.targets names 'q_proj', not a projection of a block"):
        load_config(None, ["lora.rank=4", "lora.targets=q_proj"])
    train_rank(load_config(None, overrides(chat_data, tmp_path, "run", "lora.rank=2", "training.steps=1",
                                           "checkpoint.save_final=true")))
    with pytest.raises(UserError, match="it holds rank 2 adapters on .* \\(this run: no adapters; see \\[lora\\]\\)"):
        train_rank(load_config(None, overrides(chat_data, tmp_path, "other", "training.steps=2",
                                               f"checkpoint.resume={tmp_path / 'run/checkpoints/step-1'}")))
    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert "a PEFT adapter loads onto a Hugging Face base" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="not supported with parallel.cp > 1 yet"):
        resolve_run(load_config(None, overrides(chat_data, tmp_path, "cp", "parallel.cp=2", "training.micro_batch=2")),
                    2)
    resolve_run(load_config(None, fast_overrides(char_data, tmp_path, "cp", "parallel.cp=2")), 2)  # plain text: fine


def test_estimate_and_plan_count_frozen_and_trainable():
    """An 8B model with rank-16 adapters on one 24 GB card: the frozen base in bf16 without gradients or optimizer
    state, the adapters' parameters, gradients and Adam moments in fp32; with full checkpointing it fits. The
    planner reduces and updates only the adapters."""
    from paratrain.commands.estimate import inputs_from_argv
    from paratrain.estimate.core import estimate
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import predict
    from paratrain.estimate.search import rank_all
    from paratrain.capabilities.lora import LoRA

    inputs, _ = inputs_from_argv(["--model", "llama3-8b", "--gpu", "RTX4090", "--lora-rank", "16",
                                  "--checkpointing", "full"])
    est = estimate(inputs)
    trainable, base = 41_943_040, 8_030_261_248
    assert est.fits and est.sizes["frozen"] == base * 2
    assert est.sizes["parameters"] == trainable * 4 + 2 * 8192 * 64 * 4  # + the rotary tables
    assert est.sizes["optimizer"] == trainable * 8 + 7 * 32 * 2 * 4  # Adam's moments and step counts
    table = est.format_table()
    assert "frozen parameters (LoRA base)" in table and "41.9M trainable" in table and "FITS" in table
    full = estimate(inputs_from_argv(["--model", "llama3-8b", "--gpu", "RTX4090", "--checkpointing", "full"])[0],
                    suggest=False)
    assert not full.fits and full.sizes["gradients"] > 100 * est.sizes["gradients"]
    request = PlanRequest("llama3-8b", gpus=8, gpu="H100", seq=4096, global_batch_tokens=524288)
    lora_ctx, world, opts = plan_context(dataclasses.replace(request, capabilities=(LoRA(rank=16),)))
    ctx = plan_context(request).ctx
    best = rank_all(lora_ctx, world, opts)[0]
    with_lora, without = predict(best.cand, lora_ctx), predict(best.cand, ctx)
    assert with_lora.optimizer_s < without.optimizer_s / 50 and with_lora.compute_s < without.compute_s
