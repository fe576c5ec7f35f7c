"""Context parallelism: ring attention against full attention, the chunk layout, the verify rows, memory per rank,
the planner's long-context answer and the refusals."""

from __future__ import annotations

import dataclasses
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


# A small dense model (no GQA, so attention and MLP activations are plain per-token tensors) for the memory test.
MEMORY_MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=352, max_seq_len=512)
MEMORY_BATCH = dict(micro_batch=2, seq_len=256, precision="fp32", checkpointing="none")


def _four_ranks():
    """One launch of 4 gloo ranks for the ring-attention and memory tests: ring attention over the whole group
    (cp=4) and over pairs (cp=2: ranks 0-1 and 2-3) against full attention; then the memory harness's measurement of
    a training step with cp=4 and with cp=2 x dp_shard=2. Returns, per rank, the attention errors and the
    measurements."""
    import torch.distributed as dist

    from paratrain.distributed.context_parallel import ContextParallel
    from paratrain.config import ParallelConfig
    from paratrain.distributed.env import init_distributed
    from memory_measure import MeasureSpec, measure_step  # bench/ (tests/conftest.py)

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
        result[f"ring{cp}"] = errors
    for cp in (4, 2):
        m = measure_step(MeasureSpec.of(MEMORY_MODEL, ParallelConfig(cp=cp), steps=1, **MEMORY_BATCH))
        result[f"memory{cp}"] = m.forward_end["activations"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


@pytest.fixture(scope="module")
def four_ranks():
    from paratrain.distributed.launch import launch

    return launch(_four_ranks, (), 4)


def test_ring_attention_matches_full_attention(four_ranks):
    """Forward and dq, dk, dv of ring attention (GQA, load-balanced causal chunks) on 2 and 4 gloo ranks."""
    for cp in (2, 4):
        for per_rank in four_ranks:
            assert max(per_rank[f"ring{cp}"]) < TOL, (cp, four_ranks)


def test_activation_memory_per_rank_falls_by_cp(four_ranks):
    """The attention and MLP activations a rank stores for backward (measured: every tensor alive at the end of the
    forward) fall by about cp x with context parallelism, and the estimator predicts them."""
    from paratrain.estimate import estimate
    from paratrain.estimate.activations import act_dims, attention_saved, dense_ffn_saved
    from paratrain.estimate.core import forward_end_bytes
    from paratrain.config import ParallelConfig
    from memory_measure import MeasureSpec, inputs_for_spec, measure_step  # bench/ (tests/conftest.py)
    from paratrain.layout import Layout
    from paratrain.models.args import ModelArgs

    one = measure_step(MeasureSpec.of(MEMORY_MODEL, steps=1, **MEMORY_BATCH)).forward_end["activations"]
    args = ModelArgs(**MEMORY_MODEL)
    for cp, world in ((2, 4), (4, 4)):
        measured = max(r[f"memory{cp}"] for r in four_ranks)
        assert 0.85 * cp <= one / measured <= 1.15 * cp, (cp, one, measured)
        spec = MeasureSpec.of(MEMORY_MODEL, ParallelConfig(cp=cp), **MEMORY_BATCH)
        predicted = forward_end_bytes(estimate(inputs_for_spec(spec, world), suggest=False).inputs)["activations"]
        assert abs(predicted - measured) <= 0.01 * measured, (cp, predicted, measured)
        # per block, attention and MLP separately
        d1 = act_dims(args, Layout.resolve(1), "fp32", "paratrain", 2, 256, "cpu")
        dc = act_dims(args, Layout.resolve(world, cp=cp), "fp32", "paratrain", 2, 256, "cpu")
        for part in (attention_saved, dense_ffn_saved):
            whole, split = sum(b for _, b in part(d1)), sum(b for _, b in part(dc))
            assert 0.9 * cp <= whole / split <= 1.1 * cp, (part.__name__, cp, whole, split)


CP_SUITE = ["cp2", "cp2xfsdp2", "cp2xtp2", "cp2xpp2", "cp4-seq256"]


def test_verify_cp_rows(char_data):
    """The context-parallel verify rows against one process, 10 steps: cp alone, with FSDP, tensor parallel (+sp) and
    a pipeline, and a 256-token sequence over 4 ranks (the CLI's long row, cp4-seq1024, takes longer: bench/RESULTS.md)."""
    from paratrain.verify import CP_MATRIX, run_verify

    assert set(CP_SUITE) - {"cp4-seq256"} <= set(CP_MATRIX) and "cp4-seq1024" in CP_MATRIX
    rows, _ = run_verify(CP_SUITE, steps=10, tolerance=TOL, extra_args=[f"data.dir={char_data}"], echo=lambda line: None,
                         share_launches=True)
    report = "\n".join(f"{r.layout}: dloss {r.max_loss_diff:.2e} dweight {r.max_weight_diff:.2e} dval {r.val_diff:.2e} "
                       f"{r.note}" for r in rows)
    for r in rows:
        assert len(r.losses) == 10 and r.passed, report


def test_cp_evaluates_and_samples_like_one_process(char_data, tmp_path):
    """Evaluation cuts the held-out batches the same way (val loss as one process's) and sampling runs whole prompts
    on every rank (the same greedy text)."""
    from conftest import fast_config

    from paratrain.api import run_rank, train_rank
    from paratrain.distributed.launch import launch

    extra = ["training.steps=3", "training.global_batch=4", "training.micro_batch=4", "training.eval_every=2",
             "training.eval_sequences=8", "sample.max_new_tokens=6", "sample.temperature=0", "optimizer.eps=1e-6",
             "checkpoint.save_final=false"]
    one = train_rank(fast_config(char_data, tmp_path, "one", *extra))
    cp = launch(run_rank, (fast_config(char_data, tmp_path, "cp", *extra, "parallel.cp=2"),), 2)
    assert max(abs(a - b) for a, b in zip(one.losses, cp.losses)) <= TOL and len(cp.losses) == 3
    assert abs(one.val_loss - cp.val_loss) <= TOL
    assert cp.sample_text == one.sample_text and len(cp.sample_text) > 0


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["parallel.cp=2", "training.seq_len=30"], "training.seq_len=30 is not divisible by 2 x parallel.cp = 4"),
    (4, ["parallel.cp=4", "training.seq_len=36"], "is not divisible by 2 x parallel.cp = 8"),
    (8, ["parallel.cp=2", "parallel.tp=4", "model.n_kv_heads=4", "training.seq_len=36"],
     "is not divisible by parallel.tp=4 x parallel.cp=2 (sequence parallel"),
    (2, ["parallel.cp=2", "model.preset=tiny-moe"], "parallel.cp=2 does not support mixture-of-experts models"),
    (2, ["parallel.cp=2", "parallel.dp_mode=ddp"], "parallel.cp=2 needs dp_mode fsdp, zero2 or hsdp"),
    (2, ["parallel.cp=2", "parallel.dp_mode=zero1"], "parallel.cp=2 needs dp_mode fsdp, zero2 or hsdp"),
    (3, ["parallel.cp=2"], "x parallel.cp (2) does not divide the world size 3"),
    (2, ["parallel.cp=0"], "parallel.cp must be >= 1"),
])
def test_bad_cp_layouts_fail_before_launch(char_data, tmp_path, world, overrides, message):
    from conftest import assert_plan_rejected

    assert_plan_rejected(char_data, tmp_path, world, overrides, message)


def test_cli_refuses_bad_cp_with_one_line(char_data, tmp_path, capsys, monkeypatch):
    from paratrain import cli

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    from conftest import fast_overrides

    argv = ["train", "--nproc", "2", *[f"--{o}" for o in fast_overrides(char_data, tmp_path, "bad")],
            "--parallel.cp=2", "--training.seq_len=30"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and "2 x parallel.cp" in err, err
    assert not (tmp_path / "bad").exists()


PLAN_405B = ["--model", "llama3-405b", "--gpus", "1024", "--gpu", "H100", "--seq", "131072",
             "--global-batch-tokens", "16777216"]
NARROW = ["--dp-modes", "fsdp", "--checkpointing", "full", "--micro-batches", "1"]
REQUEST_405B = dict(model="llama3-405b", gpus=1024, gpu="H100", seq=131072, global_batch_tokens=16777216)


def test_planner_fits_llama3_405b_at_128k_with_cp_only(tmp_path, capsys):
    """`paratrain plan --model llama3-405b --gpus 1024 --gpu H100 --seq 131072 ...`: no layout fits without context
    parallelism (nor memory tiers); with it the best fits, and its config (parallel.cp, model.max_seq_len) loads. (The full command is
    in bench/RESULTS.md; the test narrows the dp modes, checkpointing and micro-batches to stay fast.)"""
    from paratrain.cli import main
    from paratrain.config import load_config
    from paratrain.errors import UserError
    from paratrain.estimate.planner import PlanRequest, plan

    # (without the memory tiers: CPU offload makes it fit on 1024 H100s without cp, at a host memory price)
    request = PlanRequest(**REQUEST_405B, dp_modes=["fsdp"], checkpointing=["full"], micro_batches=[1],
                          schedules=["1f1b"], max_cp=1, memory_tiers=False)
    with pytest.raises(UserError, match="no layout fits llama3-405b on 1024"):
        plan(request)
    out = tmp_path / "plan"
    assert main(["plan", *PLAN_405B, *NARROW, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "planned as long-context training" in text
    cfg = load_config(out / "config.toml")
    assert cfg.parallel.cp > 1 and cfg.model.max_seq_len == 131072 and cfg.training.seq_len == 131072
    best = text.split("best: ")[1].splitlines()[0]
    assert f"cp{cfg.parallel.cp}" in best


def test_planner_explains_the_ring(capsys):
    from paratrain.cli import main
    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import RING, predict
    from paratrain.estimate.search import parse_layout

    assert main(["plan", *PLAN_405B, *NARROW, "--explain", "fsdp,cp=8,tp=2,ac=full,mb=1"]) == 0
    text = capsys.readouterr().out
    assert "context-parallel ring over 8 ranks" in text and "point-to-point steps" in text and "exposed" in text
    ctx, world, _ = plan_context(PlanRequest(**REQUEST_405B))
    c = parse_layout("fsdp,cp=8,tp=2,ac=full,mb=1", ctx, world)
    hidden, bare = predict(c, ctx), predict(c, dataclasses.replace(ctx, hw=_no_overlap(ctx.hw)))
    assert 0 < hidden.comm[RING] < bare.comm[RING]  # the attention compute hides part of the ring
    assert bare.comm_total_s == pytest.approx(hidden.comm_total_s, rel=0.05)


def _no_overlap(hw):
    import dataclasses

    return dataclasses.replace(hw, overlap=0.0)
