"""The memory tiers (paratrain/memory.py, docs/memory-tiers.md): each is an exact transformation of the step, so its
`paratrain verify` rows match one process at 1e-5; their rules and one-line refusals."""

from __future__ import annotations

import dataclasses
import math
import weakref

import pytest
import torch

from paratrain.capabilities.cpu_offload import CpuOffload
from paratrain.errors import ConfigError, UserError
from paratrain.layout import Layout
from paratrain.capabilities.activation_offload import ActivationOffload
from paratrain.capabilities.chunked_loss import AUTO_LOSS_CHUNKS, AUTO_LOSS_MIN_BYTES, ChunkedLoss
from paratrain.modes import CheckpointMode
from paratrain.verify import MEMORY_MATRIX

from test_distributed import check_matrix


def test_verify_memory_matrix(char_data):
    check_matrix(MEMORY_MATRIX, char_data)


def test_chunked_loss_is_the_whole_loss_and_its_gradients():
    """Pieces that do not divide the tokens; the loss, every gradient and the per-token losses agree."""
    from paratrain.models import build_model
    from paratrain.models.presets import preset_args

    torch.manual_seed(0)
    model = build_model(preset_args("tiny", vocab_size=64))
    x, y = torch.randint(0, 64, (3, 10)), torch.randint(0, 64, (3, 10))
    results = []
    for chunks in (1, 7):
        model.zero_grad()
        loss = model(x, targets=y, loss_chunks=chunks)
        loss.backward()
        with torch.no_grad():
            per_token = model(x, targets=y, loss_chunks=chunks, reduction="none")
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, per_token))
    (l1, g1, t1), (l7, g7, t7) = results
    assert torch.allclose(l1, l7, atol=1e-6) and torch.allclose(t1, t7, atol=1e-6)
    assert all(torch.allclose(g1[n], g7[n], atol=1e-7) for n in g1)


def loss_chunks(setting: int, layout, precision: str, *, vocab_size: int, tokens: int) -> int:
    """The pieces a run of `memory.loss_chunks = setting` computes its loss in (ChunkedLoss.loss_pieces)."""
    on = ChunkedLoss.from_setting(setting)
    return on.loss_pieces(layout, precision, vocab_size, tokens) if on is not None else 1


def test_loss_chunks_rules():
    plain, pipeline = Layout.resolve(1), Layout.resolve(2, pp=2)
    big = dict(vocab_size=128256, tokens=8192)  # Llama 3's vocabulary, one 8k sequence: 4 GiB of fp32 logits
    small = dict(vocab_size=128, tokens=12 * 64)  # the default recipe's: 384 KiB
    assert loss_chunks(0, plain, "fp32", **big) == AUTO_LOSS_CHUNKS  # exact, and the logits are big: on
    assert loss_chunks(0, plain, "fp32", **small) == 1  # tiny logits: the pieces would cost more than they save
    assert loss_chunks(0, plain, "bf16", **big) == 1  # the output weight's gradient would be summed in bf16
    assert loss_chunks(4, plain, "bf16", **small) == 4  # asked for: always
    assert loss_chunks(0, pipeline, "fp32", **big) == 1
    with pytest.raises(ConfigError, match="memory.loss_chunks=4 does not work with parallel.pp > 1"):
        loss_chunks(4, pipeline, "fp32", **big)
    # the threshold is on one rank's logits: context parallelism cuts the tokens, a vocabulary-parallel loss the vocab
    edge = dict(vocab_size=1024, tokens=AUTO_LOSS_MIN_BYTES // (1024 * 4))
    assert loss_chunks(0, plain, "fp32", **edge) == AUTO_LOSS_CHUNKS
    assert loss_chunks(0, plain, "fp32", vocab_size=1024, tokens=edge["tokens"] - 1) == 1
    assert loss_chunks(0, Layout.resolve(2, cp=2), "fp32", **edge) == 1
    assert loss_chunks(0, Layout.resolve(2, tp=2), "fp32", **edge) == 1
    assert loss_chunks(0, Layout.resolve(2, tp=2), "fp32", vocab_size=1024, tokens=2 * edge["tokens"]) == AUTO_LOSS_CHUNKS


def test_trainer_and_estimator_resolve_automatic_chunks_alike():
    """The trainer resolves memory.loss_chunks=0 per micro-batch, the estimator from its recipe: the same rule."""
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.estimate import Target, inputs_for
    from paratrain.estimate.inputs import validate
    from paratrain.models.presets import preset_args
    from paratrain.recipe import Recipe
    from paratrain.training.step import build_train_step

    for vocab, (mb, seq) in ((128, (12, 64)), (4096, (32, 256))):
        args = preset_args("tiny", vocab_size=vocab)
        step = build_train_step(args, ParallelDims(Layout.resolve(1)))
        trainer = step.chunks_for(torch.zeros(mb, seq, dtype=torch.long))
        recipe = Recipe(Layout.resolve(1), precision="fp32", micro_batch=mb,
                        seq_len=seq).replace(loss_chunks=0)  # memory.loss_chunks=0, the default: automatic
        estimated = validate(inputs_for(args, recipe, Target(device="cpu"))).recipe.loss_chunks
        assert trainer == estimated == (1 if vocab == 128 else AUTO_LOSS_CHUNKS), (vocab, trainer, estimated)


def test_offload_rules():
    assert ActivationOffload("all").host_activations(3) == ([0, 1, 2], 1)
    assert ActivationOffload("every_k", 2).host_activations(5) == ([0, 2, 4], 2)
    ActivationOffload("all").check_layout(Layout.resolve(2, pp=2))  # 1f1b: fine
    with pytest.raises(ConfigError, match="activation_offload=all does not work with parallel.pp_schedule=zbv"):
        ActivationOffload("all").check_layout(Layout.resolve(2, pp=2, pp_schedule="zbv"))


def test_segments_keep_only_their_inputs_and_recompute_exactly():
    """Segment checkpointing on one process (5 blocks in segments of 2, 2 and 1): the same loss and gradients bit for
    bit as without checkpointing, the same parameter names and state dict (nothing wrapped), only the segments' inputs
    saved through the forward (what the estimator's stored_by_block says), and blocks grouped within a stage."""
    import copy

    from paratrain.capabilities.segment_checkpointing import SegmentCheckpointing, segment_size, segments
    from paratrain.config import ActivationCheckpointConfig
    from paratrain.distributed.parallelize import apply_activation_checkpointing
    from paratrain.estimate import activations as A
    from paratrain.models import build_model
    from paratrain.models.presets import preset_args

    torch.manual_seed(0)
    args = dataclasses.replace(preset_args("tiny", vocab_size=64), n_layers=5)
    plain = build_model(args)
    seg = copy.deepcopy(plain)
    apply_activation_checkpointing(seg, ActivationCheckpointConfig("segments"), (SegmentCheckpointing(2),))
    assert [n for n, _ in seg.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(seg.state_dict()) == list(plain.state_dict())
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    saved = {}
    for name, model in (("none", plain), ("segments", seg)):
        sizes, h = [], model.tok_embeddings(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t) or t, lambda t: t):
            for block in model.layers.values():  # the model's own loop over its blocks
                h = block(h, model.rope_cos[:16], model.rope_sin[:16])
        tables = {b.untyped_storage().data_ptr() for b in model.buffers()}  # the rotary tables: kept anyway
        saved[name] = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sizes
                       if t.untyped_storage().data_ptr() not in tables}
        model(x, targets=y).backward()
    d = A.act_dims(args, Layout.resolve(1), "fp32", "paratrain", 2, 16, "cpu")
    stored = A.stored_by_block(d, [CheckpointMode.SEGMENTS] * 5, [list(range(5))], {}, (SegmentCheckpointing(2),))
    assert sum(saved["segments"].values()) == sum(stored.values()) == 3 * A.block_input(d)  # blocks 0, 2, 4's inputs
    assert sum(saved["none"].values()) > 5 * sum(saved["segments"].values())
    for a, b in zip(plain.parameters(), seg.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert segment_size(0, 32) == 6 and segment_size(0, 1) == 1 and segment_size(3, 32) == 3
    assert segments([4, 5, 6, 7], 3) == [[4, 5, 6], [7]]  # a pipeline stage's blocks: no segment crosses it


def test_activation_offload_moves_saved_tensors_to_host_and_back():
    """One process: every mode with every checkpointing gives the same loss and gradients bit for bit; what the hooks
    hold between forward and backward is what the estimator says moves (activations.offloaded), and they hold
    nothing after backward."""
    from paratrain.config import ActivationCheckpointConfig
    from paratrain.distributed import offload
    from paratrain.distributed.initialize import canonical_name
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.distributed.parallelize import parallelize
    from paratrain.estimate import activations as A
    from paratrain.models import build_model
    from paratrain.models.presets import preset_args

    args = preset_args("tiny", vocab_size=64)
    held = []  # (bytes, a weak reference) of each host copy
    real_to_host = offload.ActivationOffloader._to_host

    def to_host(self, whole):
        host = real_to_host(self, whole)
        held.append((host.numel() * host.element_size(), weakref.ref(host)))
        return host

    results = {}
    for mode, ac in (("none", "none"), ("all", "none"), ("every_k", "none"), ("all", "full"), ("all", "selective")):
        with torch.device("meta"):
            model = build_model(args)
        model = parallelize(model, ParallelDims(Layout.resolve(1)), ActivationCheckpointConfig(ac), "fp32", False,
                            torch.device("cpu"), 0,
                            capabilities=(ActivationOffload(mode),) if mode != "none" else ())
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 64, (4, 64), generator=gen) for _ in range(2))
        offload.ActivationOffloader._to_host = to_host
        try:
            loss = model(x, targets=y)
        finally:
            offload.ActivationOffloader._to_host = real_to_host
        hosted = sum(n for n, _ in held)
        loss.backward()
        assert all(ref() is None for _, ref in held), "host copies outlive the backward"
        held.clear()
        results[mode, ac] = loss.detach(), {canonical_name(n): p.grad for n, p in model.named_parameters()}, hosted
        blocks = ActivationOffload(mode).host_activations(args.n_layers)[0] if mode != "none" else []
        from paratrain.estimate.activations import act_dims

        d = act_dims(args, Layout.resolve(1), "fp32", "paratrain", 4, 64, "cpu")
        assert hosted == len(blocks) * A.offloaded(d, CheckpointMode(ac)), (mode, ac)
    loss0, grads0, _ = results["none", "none"]
    for (mode, ac), (loss, grads, _) in results.items():
        assert torch.equal(loss, loss0) and all(torch.equal(grads[n], grads0[n]) for n in grads0), (mode, ac)


def _runs(runs):
    """(config, PARATRAIN_FAULTS) pairs trained one after the other by the same launched ranks; rank 0's results
    (with the final weights)."""
    import os

    from paratrain.api import run_rank

    out = []
    for i, (cfg, faults) in enumerate(runs):
        os.environ["PARATRAIN_FAULTS"] = faults
        try:
            out.append(run_rank(cfg, True, keep_group=i < len(runs) - 1))
        finally:
            os.environ.pop("PARATRAIN_FAULTS")
    return out


def test_cpu_offload_checkpoints_resume_across_offload_and_layouts_and_export(char_data, tmp_path):
    """fsdp2 with CPU offload saves at step 3 and exports a Hugging Face folder; resumed without offload it trains
    the straight run's steps 3-5, and resumed as zero2 (offload on) the same within 1e-5; with offload on, a
    non-finite step is skipped, and fp16's loss scaler skips an overflow."""
    from safetensors.torch import load_file

    from paratrain.config import load_config
    from paratrain.distributed.launch import launch

    from conftest import fast_overrides

    base = ["training.global_batch=8", "training.micro_batch=4", "training.eval_every=0", "optimizer.warmup_steps=2",
            "parallel.dp_mode=fsdp", "sample.max_new_tokens=0"]

    def cfg(name, *extra):
        return load_config(None, fast_overrides(char_data, tmp_path, name, *base, *extra))

    saved = tmp_path / "offload" / "checkpoints" / "step-3"
    straight, offload, plain, zero2, nan, fp16 = launch(_runs, ([
        (cfg("straight", "training.steps=6"), ""),
        (cfg("offload", "training.steps=3", "memory.cpu_offload=true", "checkpoint.export_hf=true",
             "checkpoint.export_hf_dtype=fp32"), ""),
        (cfg("plain", "training.steps=6", f"checkpoint.resume={saved}"), ""),
        (cfg("zero2", "training.steps=6", f"checkpoint.resume={saved}", "parallel.dp_mode=zero2",
             "memory.cpu_offload=true"), ""),
        (cfg("nan", "training.steps=3", "memory.cpu_offload=true"), "nan@1"),
        (cfg("fp16", "training.steps=4", "training.precision=fp16", "memory.cpu_offload=true"), "nan@1"),
    ],), 2)
    assert offload.losses == straight.losses[:3]
    assert max(abs(a - b) for a, b in zip(plain.losses, straight.losses[3:])) <= 1e-6
    assert max(abs(a - b) for a, b in zip(zero2.losses, straight.losses[3:])) <= 1e-5
    exported = load_file(str(tmp_path / "offload" / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.norm.weight"], offload.final_weights["norm.weight"])
    assert nan.skipped_steps == 1 and nan.losses[0] == straight.losses[0] and math.isfinite(nan.losses[2])
    # fp16: the (sharded) scaler unscales the host gradients, skips the overflowing step and lowers its scale
    assert math.isnan(fp16.losses[1]) and all(map(math.isfinite, fp16.losses[:1] + fp16.losses[2:]))


def test_estimate_names_a_tier_that_fits_on_the_same_gpus():
    """The issue's case: llama3-8b on 4 x RTX4090 at 4096 tokens does not fit; the suggestion keeps the 4 GPUs and
    names its tier, device and host memory per rank and predicted slowdown; CPU offload puts the model states on
    the host (device and host totals apart), and a node too small for them is refused."""
    from paratrain.estimate import Target, estimate, inputs_for
    from paratrain.recipe import Recipe
    from paratrain.estimate.gpus import GiB
    from paratrain.models.presets import preset_args

    args = preset_args("llama3-8b")
    asked = inputs_for(args, Recipe(Layout.resolve(4, dp_mode="fsdp"), micro_batch=1, seq_len=4096),
                       Target(gpu_name="RTX4090", gpu_bytes=24 * GiB))
    est = estimate(asked)
    assert est.fits is False and est.suggestion["inputs"]["world_size"] == 4
    best = est.suggestion
    assert best["slowdown"] > 1 and best["total_bytes"] <= 0.9 * 24 * GiB
    tier = best["inputs"]
    assert tier["loss_chunks"] > 1 or tier["activation_offload"] != "none" or tier["cpu_offload"]
    plain = estimate(asked.with_recipe(checkpointing="full"), suggest=False)
    offloaded = asked.with_recipe(checkpointing="full", capabilities=(CpuOffload(),))
    off = estimate(offloaded, suggest=False)
    assert off.host["optimizer"] == plain.at_peak["optimizer"] and off.at_peak.get("optimizer", 0) == 0
    rope = off.at_peak["parameters"]  # the device keeps the rotary tables (buffers)
    assert off.host["parameters"] + rope == plain.at_peak["parameters"] and rope < 0.001 * plain.at_peak["parameters"]
    assert off.fits and off.host_node_bytes == 4 * off.host_bytes
    small = estimate(offloaded.with_target(host_bytes=64 * GiB), suggest=False)
    assert small.host_fits is False and small.fits is False


def test_plan_reaches_for_the_tiers_and_writes_them(tmp_path):
    """Nothing fits 4 x RTX4090 for llama3-8b without a tier: the plan names one, predicts its PCIe copies and host
    optimizer step, and its config loads as `paratrain train --config` would read it."""
    from paratrain.config import load_config
    from paratrain.commands.plan import write_outputs
    from paratrain.estimate.planner import PlanRequest, plan, plan_context
    from paratrain.estimate.search import staging_dropped_line
    from paratrain.spec import check

    request = PlanRequest("llama3-8b", gpus=4, gpus_per_node=4, gpu="RTX4090", intra="pcie4", seq=4096,
                          global_batch_tokens=65536, host_memory="256GiB")
    ctx, world, _ = planning = plan_context(request)
    best = planning.plan(top=1).ranked[0]
    assert best.cand.switched and best.estimate.host_fits
    offloads = CpuOffload() in best.cand.switched
    if offloads:
        assert best.pred.optimizer_s > 0.5  # 2B parameters per rank stepped on the host's cores
    path, _, _ = write_outputs(best, ctx, world, tmp_path / "plan", None, "llama3-8b")
    cfg = load_config(path)
    # (background checkpoints' staging copy does not fit beside the offloaded states: dropped, and said)
    assert not cfg.checkpoint.async_save and "checkpoint.async_save = false" in staging_dropped_line(best, ctx)
    actoff = next((c.mode for c in best.cand.switched if isinstance(c, ActivationOffload)), "none")
    assert (cfg.memory.cpu_offload, cfg.memory.activation_offload) == (offloads, actoff)
    assert check(cfg, world).world_size == 4
    with pytest.raises(UserError, match="does not fit in host memory"):
        plan(dataclasses.replace(request, host_memory=16 * 2**30), top=1)


def test_low_memory_optimizer_states():
    """adamw-bf16 keeps both moments in bf16 (half AdamW's state, the estimator's too) and follows AdamW closely;
    adamw8bit is torchao's, a one-line error where torchao is missing; both refuse ZeRO-1 in one line."""
    import importlib.util

    from paratrain.config import OptimizerConfig
    from paratrain.estimate.model_states import state_bytes
    from paratrain.models.presets import preset_args
    from paratrain.capabilities import optimizer_entry
    from paratrain.training.optim import build_optimizer

    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 64)
    losses = {}
    for name in ("adamw", "adamw-bf16", "adamw8bit"):
        model = torch.nn.Linear(64, 64)
        model.load_state_dict(ref.state_dict())
        cfg = OptimizerConfig(name=name, lr=1e-2)
        if name == "adamw8bit" and importlib.util.find_spec("torchao") is None:
            with pytest.raises(ConfigError, match="^optimizer.name=adamw8bit needs torchao, which is not installed"):
                build_optimizer(model, cfg, torch.device("cpu"))
            continue
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for _ in range(30):
            x = torch.randn(32, 64, generator=gen)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name] = loss.item()
        if name == "adamw-bf16":
            assert {v.dtype for v in opt.state[model.weight].values() if v.dim()} == {torch.bfloat16}
    assert all(abs(v - losses["adamw"]) <= 0.01 * losses["adamw"] for v in losses.values()), losses
    args, lay = preset_args("tiny", vocab_size=64), Layout.resolve(1)
    assert 2 * state_bytes(args, lay, "fp32", "adamw-bf16", "paratrain").optimizer == pytest.approx(
        state_bytes(args, lay, "fp32", "adamw", "paratrain").optimizer, rel=0.01)
    for name in ("adamw-bf16", "adamw8bit"):
        with pytest.raises(ConfigError, match=f"optimizer.name={name} keeps low-precision states"):
            optimizer_entry(name).check_layout(Layout.resolve(2, dp_mode="zero1"))
