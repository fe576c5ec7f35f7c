"""DiLoCo across data-parallel replicas (`parallel.dp_sync = "diloco"`, paratrain/capabilities/diloco.py): equal to
data parallelism where it must be (H = 1, outer lr 1, no momentum, SGD), exact resume in the middle of a round, its
metrics, and its bad input as one line."""

from __future__ import annotations

import json

import pytest

from paratrain.capabilities.diloco import fragment_of
from paratrain.config import load_config
from paratrain.errors import ConfigError

from conftest import assert_plan_rejected, fast_config

DILOCO = ["parallel.dp_sync=diloco"]


def test_verify_diloco_rows(char_data):
    """ddp2 and hsdp 2x2 (FSDP inside each replica) with H = 1, outer lr 1, no momentum and SGD equal one process's
    SGD at 1e-5 on every step (for SGD the mean of the replicas' steps is the step on the mean gradient)."""
    from test_distributed import check_matrix
    from paratrain.verify import CAPABILITY_MATRICES

    assert CAPABILITY_MATRICES["diloco"] == ["diloco-ddp2", "diloco-hsdp2x2"]
    check_matrix(CAPABILITY_MATRICES["diloco"], char_data, steps=4)


def _runs(*cfgs):
    from paratrain.api import run_rank

    return [run_rank(cfg, keep_group=i < len(cfgs) - 1) for i, cfg in enumerate(cfgs)]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"loss"' in line]


def test_resume_in_the_middle_of_a_round_is_exact(char_data, tmp_path):
    """ddp2, H = 4 in 2 fragments (AdamW inside, Nesterov outside): stopped after step 3 (mid-round: the replicas'
    weights and moments differ) and resumed, the last step's loss and the val loss are those of the straight run bit
    for bit. Fragments sync after steps 2 and 4 (one of the two each time); no gradient crosses the replicas."""
    from paratrain.distributed.launch import launch

    common = [*DILOCO, "parallel.dp_mode=ddp", "diloco.inner_steps=4", "diloco.fragments=2", "training.steps=4",
              "training.global_batch=8", "training.eval_every=0", "optimizer.warmup_steps=2",
              "resilience.collective_timeout_s=60"]
    step3 = f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step-3'}"
    cfgs = (fast_config(char_data, tmp_path, "straight", *common, "checkpoint.every=3"),
            fast_config(char_data, tmp_path, "resumed", *common, step3))
    straight, resumed = launch(_runs, cfgs, 2)
    assert resumed.losses == straight.losses[3:] and resumed.val_loss == straight.val_loss  # ==: bitwise
    records = _records(straight.run_dir)
    synced = [r["step"] for r in records if r["diloco_bytes"] > 0]
    assert synced == [2, 4]
    assert all(r["comm_bytes"] == r["diloco_bytes"] for r in records)  # nothing else crosses the replicas
    assert all(r["diloco_drift"] > 0 and r["diloco_outer_norm"] > 0 for r in records if r["step"] in synced)


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
    (["diloco.outer_compression=sign_ef"], "diloco.outer_compression=sign_ef is not supported yet"),
    (["parallel.grad_compression=bf16"], "use diloco.outer_compression"),
])
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DILOCO, *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["parallel.dp_mode=fsdp"], "has none: use dp_mode=ddp over several ranks, or hsdp"),
    (2, ["parallel.dp_mode=zero1"], "shares it across replicas"),
])
def test_layouts_without_replicas_are_refused(char_data, tmp_path, world, overrides, message):
    assert_plan_rejected(char_data, tmp_path, world, [*DILOCO, *overrides], message)


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
