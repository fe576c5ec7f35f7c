"""DiLoCo across data-parallel replicas (`parallel.dp_sync = "diloco"`, paratrain/capabilities/diloco.py): equal to
data parallelism where it must be (H = 1, outer lr 1, no momentum, SGD), exact resume in the middle of a round, its
metrics, and its bad input as one line."""

from __future__ import annotations

import json
import math

import pytest

from paratrain.capabilities.diloco import fragment_of
from paratrain.config import load_config
from paratrain.errors import ConfigError

from conftest import assert_plan_rejected, fast_config

DILOCO = ["parallel.dp_sync=diloco"]


def test_verify_diloco_rows(char_data):
    """ddp2, hsdp 2x2 (FSDP inside each replica) and ep inside each replica (the 4-rank rows share one launch) with
    H = 1, outer lr 1, no momentum and SGD equal one process's SGD at 1e-5 on every step (for SGD the mean of the
    replicas' steps is the step on the mean gradient). The rows with tp, pp (8 ranks) and cp inside a replica run by
    `paratrain verify --layouts ROW,...` (bench/RESULTS.md), kept out of the suite's time."""
    from test_distributed import check_matrix
    from paratrain.verify import CAPABILITY_MATRICES

    cli_only = ["diloco-hsdp2x2+tp2", "diloco-hsdp2x2+pp2", "diloco-hsdp2+cp2"]
    assert CAPABILITY_MATRICES["diloco"] == ["diloco-ddp2", "diloco-hsdp2x2", *cli_only, "diloco-hsdp2x2+ep2"]
    check_matrix([row for row in CAPABILITY_MATRICES["diloco"] if row not in cli_only], char_data, steps=4)


def _runs(*cfgs):
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"loss"' in line]


def test_resume_in_the_middle_of_a_round_is_exact(char_data, tmp_path):
    """ddp2, H = 4 in 2 fragments (AdamW inside, Nesterov outside): fragment 0 is sent after step 2 and applied
    after step 3 (overlapped), fragment 1 sent and applied after step 4 (the last step: nothing to overlap with).
    Resumed from step 2 (the all-reduce in flight at the save) and from step 3 (mid-round: the replicas' weights and
    moments differ), the later losses and the val loss are those of the straight run bit for bit. No gradient crosses
    the replicas."""
    from paratrain.distributed.launch import launch

    common = [*DILOCO, "parallel.dp_mode=ddp", "diloco.inner_steps=4", "diloco.fragments=2", "training.steps=4",
              "training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2",
              "resilience.collective_timeout_s=60"]
    resume = [f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / f'step-{n}'}" for n in (2, 3)]
    cfgs = (fast_config(char_data, tmp_path, "straight", *common, "checkpoint.every=1", "checkpoint.keep=4"),
            fast_config(char_data, tmp_path, "in-flight", *common, resume[0]),
            fast_config(char_data, tmp_path, "mid-round", *common, resume[1]))
    straight, in_flight, mid_round = launch(_runs, cfgs, 2)
    assert in_flight.losses == straight.losses[2:] and in_flight.val_loss == straight.val_loss  # ==: bitwise
    assert mid_round.losses == straight.losses[3:] and mid_round.val_loss == straight.val_loss
    records = _records(straight.run_dir)
    assert [r["step"] for r in records if r["diloco_bytes"] > 0] == [2, 4]  # sent
    assert [r["step"] for r in records if "diloco_outer_norm" in r] == [3, 4]  # applied
    assert all(r["comm_bytes"] == r["diloco_bytes"] for r in records)  # nothing else crosses the replicas
    assert all(r["diloco_drift"] > 0 for r in records if r["diloco_bytes"] > 0)
    assert all(r["diloco_outer_norm"] > 0 for r in records if "diloco_outer_norm" in r)


@pytest.mark.parametrize("method", ["sign_ef", "powersgd"])
def test_compressed_outer_syncs_train_resume_bitwise_and_send_what_the_compressor_sends(char_data, tmp_path, method):
    """diloco.outer_compression: the per-step compressor on the pseudo-gradient (ddp2, H = 4, 2 fragments, 8 steps).
    The loss goes down; resumed from step 6 (fragment 0's all-reduce in flight; the error feedback, and PowerSGD's Q,
    in the checkpoint) the run continues bit for bit; each synchronisation sends the compressor's bytes (sign_ef: one
    bit per element and a scale per tensor piece, in an all-to-all and an all-gather; powersgd: the factors of the
    matrices, the vectors whole), far fewer than the fp32 all-reduce."""
    from paratrain.capabilities.grad_compression import powersgd_split
    from paratrain.distributed.compression import all_reduce_wire
    from paratrain.distributed.launch import launch

    common = [*DILOCO, "parallel.dp_mode=ddp", "diloco.inner_steps=4", "diloco.fragments=2", "training.steps=8",
              "training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2",
              "resilience.collective_timeout_s=60", f"diloco.outer_compression={method}", "parallel.powersgd_rank=2"]
    step6 = f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-6'}"
    cfgs = (fast_config(char_data, tmp_path, "straight", *common, "checkpoint.every=6"),
            fast_config(char_data, tmp_path, "resumed", *common, step6))
    straight, resumed = launch(_runs, cfgs, 2)
    assert resumed.losses == straight.losses[6:] and resumed.val_loss == straight.val_loss  # ==: bitwise
    assert straight.losses[-1] < straight.losses[0] - 0.3  # it trains (8 AdamW steps: about 4.85 -> 4.45)
    records = _records(straight.run_dir)
    sent = {r["step"]: r["diloco_bytes"] for r in records if r["diloco_bytes"] > 0}
    assert list(sent) == [2, 4, 6, 8]
    # this rank's fragments (the rank's names and shapes, as the outer loop cuts them)
    shapes = _fragment_shapes(cfgs[0], char_data)
    for step, f in ((2, 0), (4, 1)):
        numel = sum(math.prod(s) for s in shapes[f])
        if method == "sign_ef":  # p = 2: each piece c_k = n_k / 2 rounded up to 8; (C/8 + 4 per piece) x 2
            pieces = sum(-(-math.prod(s) // 16) * 8 for s in shapes[f])
            expected = 2 * (pieces // 8 + 4 * len(shapes[f]))
        else:
            compressed, plain = powersgd_split(shapes[f], 2)
            expected = all_reduce_wire(4 * (plain + sum(r * (n + m) for n, m, r in compressed)), 2)
        assert sent[step] == expected < 0.5 * all_reduce_wire(4 * numel, 2)


def _fragment_shapes(cfg, char_data) -> list[list[tuple]]:
    """Fragment 0's and 1's parameter shapes of the run's model (2 fragments)."""
    from paratrain.data import read_meta
    from paratrain.models import build_model
    from paratrain.spec import model_args_from

    model = build_model(model_args_from(cfg, read_meta(char_data)["vocab_size"]))
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    groups = fragment_of([n for n, _ in named], 2)
    return [[s for (_, s), g in zip(named, groups) if g == f] for f in (0, 1)]


def test_fragments_are_contiguous_blocks():
    names = ["tok.weight", "layers.0.a", "layers.0.b", "layers.1.a", "layers.2.a", "layers.3.a", "norm.weight",
             "out.weight"]
    assert fragment_of(names, 1) == [0] * 8
    assert fragment_of(names, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert fragment_of(names, 4) == [0, 0, 0, 1, 2, 3, 3, 3]


@pytest.mark.parametrize("overrides, message", [
    (["diloco.inner_steps=6", "diloco.fragments=4"], "diloco.fragments (4) must be >= 1 and divide"),
    (["model.n_layers=2", "diloco.inner_steps=4", "diloco.fragments=4"], "is more than the model's 2 blocks"),
    (["diloco.outer_dtype=fp16"], "diloco.outer_dtype must be fp32 or bf16, got fp16"),
    (["diloco.outer_dtype=fp64"], "diloco.outer_dtype: 'fp64' is not one of"),
    (["parallel.dp_sync=sometimes"], "parallel.dp_sync"),
    (["diloco.outer_compression=sign_ef", "diloco.outer_dtype=bf16"], "diloco.outer_dtype must be fp32 with it"),
    (["parallel.grad_compression=bf16"], "use diloco.outer_compression"),
])
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DILOCO, *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["parallel.dp_mode=fsdp"], "has none: use dp_mode=ddp over several ranks, or hsdp"),
    (2, ["parallel.dp_mode=zero1"], "shards it over the replicas (zero1)"),
])
def test_layouts_without_replicas_are_refused(char_data, tmp_path, world, overrides, message):
    assert_plan_rejected(char_data, tmp_path, world, [*DILOCO, *overrides], message)


def test_experts_inside_a_replica_are_accepted(char_data, tmp_path):
    """ep borrows its ranks from dp_shard, inside each replica: hsdp rep=2 with ep=2 resolves (verify row
    diloco-hsdp2x2+ep2 trains it)."""
    from paratrain.spec import resolve_run

    cfg = fast_config(char_data, tmp_path, "ep", *DILOCO, "model.preset=tiny-moe", "parallel.dp_mode=hsdp",
                      "parallel.dp_replicate=2", "parallel.ep=2", "training.micro_batch=1")
    assert resolve_run(cfg, 4).layout.ep == 2


@pytest.mark.parametrize("world, layout", [(4, ["parallel.dp_mode=hsdp", "parallel.dp_replicate=2"]),
                                           (2, ["parallel.dp_mode=ddp"])])
def test_the_estimate_counts_the_round_start_weights_and_momentum_as_built(world, layout):
    """The dry run builds the outer loop (its fp32 start and momentum, per rank's share) and compares it with the
    estimator's `replica_states`, counted in the optimizer column on both sides."""
    from paratrain.training.dryrun import dry_run

    tiny = ["model.preset=tiny", "model.vocab_size=256", "training.seq_len=32", "training.micro_batch=2", *layout]
    plain, diloco = (dry_run(load_config(None, [*tiny, *sync]), world).ranks[0] for sync in ([], DILOCO))
    assert diloco.difference == 0
    assert diloco.built["optimizer"] - plain.built["optimizer"] == 2 * plain.built["params"]  # start + momentum
    assert diloco.estimated == {**plain.estimated, "optimizer": diloco.built["optimizer"]}


@pytest.mark.parametrize("extra", [["diloco.outer_compression=sign_ef"], ["diloco.outer_compression=powersgd"],
                                   ["diloco.inner_steps=4", "diloco.fragments=2"]])
def test_the_estimate_counts_the_compressor_state_and_the_fragment_in_flight_as_built(extra):
    """Beside the start and momentum: sign_ef's residuals, powersgd's error feedback and Q, and with overlap the
    largest fragment's weights and mean in flight; the dry run (`OuterLoop.held_bytes`) and the estimate agree."""
    from paratrain.training.dryrun import TOLERANCE, dry_run

    tiny = ["model.preset=tiny", "model.vocab_size=256", "training.seq_len=32", "training.micro_batch=2",
            "parallel.dp_mode=ddp", *DILOCO]
    plain, diloco = (dry_run(load_config(None, [*tiny, *more]), 2).ranks[0] for more in ([], extra))
    assert diloco.difference <= TOLERANCE, (diloco.built, diloco.estimated)
    assert diloco.built["optimizer"] - plain.built["optimizer"] >= plain.built["params"] // 2  # more than a copy's half
    assert abs(diloco.estimated["optimizer"] - diloco.built["optimizer"]) <= 0.01 * diloco.built["optimizer"]


def test_inter_node_bandwidth_is_read_in_one_place():
    from paratrain.estimate.hardware import parse_bandwidth
    from paratrain.errors import UserError

    assert parse_bandwidth("1Gbit") == 1e9 / 8 and parse_bandwidth("10Gbit") == 1e10 / 8
    assert parse_bandwidth("25GB/s") == 25e9
    for bad in ("fast", "1Gbyte", "0Gbit", ""):
        with pytest.raises(UserError) as e:
            parse_bandwidth(bad)
        assert "e.g. 1Gbit, 10Gbit, 25GB/s" in str(e.value)


PLAN_RTX4090 = ["plan", "--model", "llama3-8b", "--gpus-per-node", "8", "--gpu", "RTX4090"]


def _plan_json(capsys, argv: list[str]) -> dict:
    from paratrain.cli import main

    assert main([*argv, "--json"]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_plan_ranks_diloco_first_across_1gbit_and_writes_its_config(capsys, tmp_path):
    """Across 1 Gbit/s the every-step all-reduce dominates: the DiLoCo row (hsdp, a replica per node) ranks first,
    and the written config trains it (dp_sync=diloco, its H) and passes the trainer's checks for 16 ranks."""
    from paratrain.capabilities.diloco import DiLoCo
    from paratrain.spec import check

    doc = _plan_json(capsys, [*PLAN_RTX4090, "--gpus", "16", "--inter-node-bandwidth", "1Gbit", "--out",
                              str(tmp_path / "plan")])
    first, rest = doc["ranked"][0], doc["ranked"][1:]
    assert first["dp_sync"] == "diloco" and first["dp_mode"] == "hsdp" and first["dp_replicate"] == 2, first
    assert all("dp_sync" not in r for r in rest) and first["predicted"]["step_s"] < rest[0]["predicted"]["step_s"]
    h = first["diloco"]["inner_steps"]
    assert h in (10, 50, 100) and doc["diloco"]["first"] and doc["diloco"]["inner_steps"] == h
    assert 0 < first["diloco"]["bytes_per_step_across_nodes"] < first["diloco"]["sync_bytes"]
    cfg = load_config(doc["written"]["config"])
    assert cfg.parallel.dp_sync == "diloco" and cfg.diloco.inner_steps == h and cfg.parallel.dp_replicate == 2
    assert DiLoCo.from_config(cfg).inner_steps == h and check(cfg, 16).world_size == 16


@pytest.mark.parametrize("where", [["--gpus", "16", "--inter-node-bandwidth", "400Gbit"],  # a fast link
                                   ["--gpus", "8", "--inter-node-bandwidth", "1Gbit"]])  # one node: no replicas
def test_plan_keeps_the_plain_first_choice_where_diloco_saves_little(capsys, tmp_path, where):
    doc = _plan_json(capsys, [*PLAN_RTX4090, *where, "--out", str(tmp_path / "plan")])
    assert all("dp_sync" not in r for r in doc["ranked"]), doc["ranked"][0]
    assert doc.get("diloco", {}).get("ranked", False) is False
    assert load_config(doc["written"]["config"]).parallel.dp_sync == "every_step"


def test_the_best_line_names_diloco_when_it_ranks_first(capsys, tmp_path):
    """The printed plan's `best:` line says the first choice trains with DiLoCo, and its H."""
    from paratrain.cli import main

    main([*PLAN_RTX4090, "--gpus", "16", "--inter-node-bandwidth", "1Gbit", "--out", str(tmp_path / "plan")])
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best: "))
    assert " with dp_sync=diloco H=" in best and "MB/step per rank across nodes -- " in best, best


def test_experts_are_sharded_inside_their_replica(tmp_path):
    """hsdp rep=2 with ep=2: FSDP shards the experts over the replica's own ranks (plain hsdp adds dp_replicate, whose
    gradient all-reduce every step would tie the replicas' experts); built as the dry run builds (a fake process group,
    the meta device)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paratrain.distributed.expert_parallel import moe_modules
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.training.dryrun import offline_spec
    from paratrain.training.step import build_run_step

    moe = ["model.preset=tiny-moe", "model.vocab_size=256", "training.seq_len=32", "training.micro_batch=1",
           "parallel.dp_mode=hsdp", "parallel.dp_replicate=2", "parallel.ep=2"]
    for sync, expected in (([], ("dp_replicate", "dp_shard_mod_ep")), (DILOCO, ("dp_shard_mod_ep",))):
        spec, _ = offline_spec(load_config(None, [*moe, *sync]), 4)
        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
        try:
            model = build_run_step(spec, ParallelDims.build(spec.layout, "cpu"), torch.device("meta")).model
            weight = next(iter(moe_modules(model)[0].experts.parameters()))
            assert weight.device_mesh.mesh_dim_names[:len(expected)] == expected, weight.device_mesh
        finally:
            dist.destroy_process_group()
