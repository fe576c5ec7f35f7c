"""Multi-token prediction (DeepSeek-V3; models/mtp.py): the modules' parameters in the family's table, the loss against
a hand computation from the modules, the trainer's weighted term and its `mtp_loss` metric, generation and export
without the modules, the layouts it refuses, and its layouts against one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from paratrain.data.batch import NOT_A_TARGET
from paratrain.models import build_model, preset_args
from paratrain.models.registry import parameters

V = 64


def tiny(preset: str = "tiny-moe", depth: int = 2):
    torch.manual_seed(0)
    args = preset_args(preset, vocab_size=V, mtp_depth=depth)
    model = build_model(args)
    for p in model.parameters():  # norm gains off 1, so a missing norm would show
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.05 if p.dim() == 1 else 0.02)
    return args, model


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3"])
def test_table_lists_the_modules_in_named_parameters_order(preset):
    args, model = tiny(preset)
    table = parameters(args)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in table]
    mtp = [p for p in table if p.name.startswith("mtp.")]
    assert mtp and all(p.where == "head" for p in mtp)  # a pipeline's last stage, with the output head


def test_loss_is_the_hand_computation():
    """Depth d at position i: eh_proj([enorm(Emb(t_{i+d})); hnorm(h^{d-1}_i)]), the block, its own norm, the shared
    head; cross-entropy against t_{i+1+d}, the last d positions without a target."""
    args, model = tiny()
    x = torch.randint(0, V, (2, 12))
    y = torch.randint(0, V, (2, 12))
    model(x, side_targets=y)
    got = [float(v.detach()) for v, _ in model.side_losses["mtp"]]

    T = x.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h, cos, sin)  # the last block's output, before the final norm
    for d, m in enumerate(model.mtp, start=1):
        ahead = torch.cat([x[:, d:], x[:, :d]], 1)  # t_{i+d}: the tokens d ahead (the wrapped ones feed no target)
        h = m.block(m.eh_proj(torch.cat([m.enorm(model.tok_embeddings(ahead)), m.hnorm(h)], -1)), cos, sin)
        logits = model.output(m.norm(h))[:, :T - d]
        want = F.cross_entropy(logits.flatten(0, 1), y[:, d:].flatten(), reduction="sum")
        assert got[d - 1] == pytest.approx(float(want.detach()), rel=1e-6)


def test_packed_documents_give_no_target_across_a_boundary():
    """In windows packed with whole documents, depth d has no target where the token d ahead starts or is in the next
    document: its input embedding and its target belong to another document."""
    args, model = tiny()
    x, y = torch.randint(0, V, (1, 12)), torch.randint(0, V, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # documents of 5 and 7 tokens
    model(x, positions=positions, side_targets=y)
    for d, (_, count) in enumerate(model.side_losses["mtp"], start=1):
        # positions i whose token i + d is in the same document, and not beyond the window
        assert int(count) == sum(1 for i in range(12 - d) if (i < 5) == (i + d < 5)), d


def test_train_step_adds_the_weighted_mean_and_records_mtp_loss():
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.layout import Layout
    from paratrain.models.llama import cross_entropy
    from paratrain.training.step import build_train_step

    args = preset_args("tiny-moe", vocab_size=V, mtp_depth=2, mtp_loss_weight=0.5, moe_aux_loss_coef=0.0)
    step = build_train_step(args, ParallelDims(Layout.resolve(1)))
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    y[0, 3] = NOT_A_TARGET
    loss = step.forward_backward([(x, y)])
    model = step.model
    with torch.no_grad():
        main = cross_entropy(model(x, side_targets=y), y)
        depths = [s / (y[:, d:] != NOT_A_TARGET).sum() for d, (s, _) in enumerate(model.side_losses["mtp"], start=1)]
    mtp = torch.stack(depths).mean()
    assert float(loss) == pytest.approx(float(main + 0.5 * mtp), rel=1e-5)
    assert step.token_loss.step_stats()()["mtp_loss"] == pytest.approx(float(mtp), rel=1e-5)
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("mtp."))


def test_generation_ignores_the_modules():
    """The same main weights give the same logits with and without the modules; they run only with targets."""
    args, model = tiny(depth=1)
    plain = build_model(preset_args("tiny-moe", vocab_size=V))
    missing = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing.missing_keys and all(k.startswith("mtp.") for k in missing.unexpected_keys)
    x = torch.randint(0, V, (2, 10))
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert model.side_losses == {}


def test_export_drops_the_modules():
    from paratrain.hf.names import pieces

    args = preset_args("tiny", vocab_size=V, mtp_depth=2)
    exported = pieces(args)
    assert exported and [p for p in exported if p.param.startswith("mtp.")] == []
    assert [p.hf for p in exported] == [p.hf for p in pieces(preset_args("tiny", vocab_size=V))]


def test_context_parallel_is_refused_before_launch(char_data, tmp_path):
    """Depth d reads the tokens d places ahead, in another rank's slice under cp: a one-line error, no run folder."""
    from conftest import assert_plan_rejected

    assert_plan_rejected(char_data, tmp_path, 2, ["parallel.cp=2", "model.mtp_depth=1"],
                         "parallel.cp=2 does not support multi-token prediction", micro_batch=2)


def test_mtp_loss_is_logged_the_same_under_a_pipeline(tmp_path, char_data):
    """One process and pp2 (the module on the last stage, the embeddings ahead sent from the first) log the same
    mtp_loss per step."""
    logged = {}
    for name, more in (("one", []), ("pp", ["--nproc", "2", "--parallel.pp=2"])):
        run = subprocess.run([sys.executable, "-m", "paratrain", "train", *more, "--training.steps=2",
                              "--training.log_every=1", "--model.preset=tiny", "--model.mtp_depth=1",
                              "--training.seq_len=32", "--training.micro_batch=2", f"--data.dir={char_data}",
                              f"--run.out_dir={tmp_path}", f"--run.name={name}", "--sample.max_new_tokens=0",
                              "--training.eval_every=0", "--checkpoint.save_final=false", "--metrics.progress=none"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logged[name] = [r["mtp_loss"] for r in records if "loss" in r]
    assert len(logged["one"]) == 2 and all(2 < v < 6 for v in logged["one"]), logged
    assert logged["pp"] == pytest.approx(logged["one"], abs=1e-5)


def test_layouts_match_one_process(char_data):
    """tp2 with sequence parallelism and pp2 interleaved against one process at 1e-5 (MTP on fsdp2, tp2, pp2-1f1b, ep2
    and ep2 x tp2 is the DeepSeek journey's verify: tests/test_journeys.py, tiny-deepseek has one depth)."""
    from paratrain.models.mtp_params import VERIFY_ROWS
    from test_distributed import check_matrix

    rows_here = ["mtp-tp2+sp", "mtp-pp2-interleaved"]
    assert set(rows_here) < set(VERIFY_ROWS)
    check_matrix(rows_here, char_data, steps=4)


def test_flops_count_each_depth_as_a_block_and_a_head_pass():
    """Each depth adds 6 x (its module's active parameters + one more pass through the head) + a block's attention;
    an MoE module counts top_k of its routed experts, like the model's MoE blocks."""
    from paratrain.models import count_active_params, flops_per_token
    from paratrain.models.presets import block_param_count

    base, args = preset_args("tiny-moe", vocab_size=V), preset_args("tiny-moe", vocab_size=V, mtp_depth=2)
    C, L = args.dim, args.n_layers
    module = block_param_count(base, L - 1, active=True) + 2 * C * C + 3 * C  # its block, projection and norms
    assert any(p.expert for p in parameters(args) if p.name.startswith("mtp."))
    assert count_active_params(args) - count_active_params(base) == 2 * module
    want = 6 * 2 * (module + V * C) + 12 * 2 * C * 128
    assert flops_per_token(args, 128) - flops_per_token(base, 128) == pytest.approx(want)


def test_pipeline_split_counts_the_modules_on_the_last_stage():
    from paratrain.stage_split import balanced_split

    assert balanced_split(preset_args("tiny", vocab_size=V, n_layers=8), 4) == (2, 2, 2, 2)
    assert balanced_split(preset_args("tiny", vocab_size=V, n_layers=8, mtp_depth=1), 4)[-1] == 1


def test_the_planner_prices_each_depth_on_the_last_stage():
    """The step-time model adds each depth's block and head pass to the rank holding the last stage."""
    import dataclasses

    from paratrain.estimate.planner import PlanRequest, plan_context
    from paratrain.estimate.step_time import Context, rank_compute
    from paratrain.layout import Layout

    ctx = plan_context(PlanRequest("llama3-8b", gpus=8, gpu="H100", seq=8192, global_batch_tokens=8192 * 64)).ctx
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(Context)}
    with_mtp = Context(**{**fields, "args": dataclasses.replace(ctx.args, mtp_depth=1), "cache": {}})
    lay = Layout.resolve(8, dp_shard=4, pp=2, pp_schedule="1f1b", pp_microbatches=16)
    plain, more = (rank_compute(c.candidate(lay), c) for c in (ctx, with_mtp))
    blocks = plain[0][0] / 16  # a rank's compute per block (llama3-8b: 16 blocks per stage)
    assert 1.5 * blocks < sum(c for c, _ in more) - sum(c for c, _ in plain) < 4 * blocks
