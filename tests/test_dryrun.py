"""`paratrain train --dry-run --world N`: the real layout built on one process (fake process group, meta device),
one rank per pipeline stage, its model states against the estimator's. The planner's 70B layout on 64 nodes (world
512) and `plan --check` run in tests/test_journeys.py (troubleshooting), through the CLI."""

from __future__ import annotations

import time

import pytest

from paratrain import cli
from paratrain.config import load_config
from paratrain.errors import ConfigError, UserError
from paratrain.training.dryrun import dry_run, format_dry_run

TINY = ["model.preset=tiny", "model.vocab_size=256", "training.seq_len=32", "training.micro_batch=2"]
LAYOUTS = {  # world, overrides: every data-parallel mode, tp with and without FSDP, each pipeline schedule family,
    # context and expert parallelism and their compositions, tied embeddings, compression, fp16, compile, SGD, LoRA
    "ddp4": (4, ["parallel.dp_mode=ddp", "training.precision=fp16"]),
    "zero1x4": (4, ["parallel.dp_mode=zero1"]),
    "zero2x2-sgd": (2, ["parallel.dp_mode=zero2", "optimizer.name=sgd"]),
    "hsdp2x2": (4, ["parallel.dp_mode=hsdp", "parallel.dp_replicate=2", "parallel.grad_compression=sign_ef"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2-zbv": (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4"]),
    "pp2xcp2xtp2": (8, ["parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "training.precision=bf16",
                         "activation_checkpoint.mode=selective"]),
    "ep2xtp2xfsdp2": (8, ["model.preset=tiny-moe", "parallel.ep=2", "parallel.tp=2"]),
    "tied-compiled": (2, ["model.tie_embeddings=true", "training.compile=true"]),
    # LoRA: the frozen base in bf16 beside the adapters, which alone have gradients and optimizer state
    "lora-fsdp2xtp2": (4, ["lora.rank=4", "parallel.tp=2", "training.precision=bf16"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_build_and_agree_with_the_estimate(name):
    world, extra = LAYOUTS[name]
    d = dry_run(load_config(None, [*TINY, *extra]), world)
    pp = d.spec.layout.pp
    assert [r.rank for r in d.ranks] == [s * world // pp for s in range(pp)]  # one rank per pipeline stage
    assert d.agrees, format_dry_run(d)
    for r in d.ranks:
        assert all(r.built[k] > 0 for k in ("params", "grads", "optimizer"))
    if name == "tp2":  # the embedding's whole gradient the estimator counts is named, and left out of the comparison
        assert d.ranks[0].grads_beyond_shards > 0
        assert "torch returns the embedding's gradient whole" in format_dry_run(d)


def test_moe_preset_on_512_ranks():
    """An MoE preset at world 512, expert x tensor x FSDP: the experts' shards as the estimator counts them. The
    issue's pp x tp x cp x ep layout of an MoE preset is one the trainer refuses (no context parallelism for
    mixture-of-experts models): the dry run says so in one line, before building anything."""
    started = time.process_time()
    moe = ["model.preset=deepseek-moe-16b", "training.seq_len=4096", "training.precision=bf16"]
    d = dry_run(load_config(None, [*moe, "parallel.tp=4", "parallel.ep=8"]), 512)
    assert d.agrees, format_dry_run(d)
    assert d.ranks[0].coordinates == {"dp_shard": 0, "tp": 0} and time.process_time() - started < 60
    with pytest.raises(ConfigError, match="parallel.cp=2 does not support mixture-of-experts models"):
        dry_run(load_config(None, [*moe, "parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.ep=8"]), 512)


def test_a_layout_torch_refuses_is_one_line_naming_the_rank(monkeypatch):
    import paratrain.training.dryrun as dryrun

    def refuse(spec, dims, device, memory_budget=None):
        raise RuntimeError("the mesh cannot shard this parameter\nsecond line")

    monkeypatch.setattr(dryrun, "build_run_step", refuse)
    with pytest.raises(UserError) as e:
        dry_run(load_config(None, [*TINY, "parallel.pp=2"]), 4)
    assert str(e.value) == ("dry run: rank 0 (pp=0 dp_shard=0) cannot be built: RuntimeError: the mesh cannot shard "
                            "this parameter")


def test_cli(capsys):
    assert cli.main(["train", "--dry-run", "--world", "4", *(f"--{o}" for o in TINY), "--parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks, layout dp_shard=2 x tp=2" in out and "agree within 1% on every rank built" in out
    assert cli.main(["train", "--world", "4"]) == 2
    assert "--world is the world size of --dry-run" in capsys.readouterr().err
    assert cli.main(["train", "--dry-run", "--world", "0"]) == 2
    assert "--world must be between 1 and 65,536" in capsys.readouterr().err
    # a preset that takes its vocabulary from data that is not prepared: a placeholder, said so
    assert cli.main(["train", "--dry-run", "--nproc", "2", "--model.preset=tiny", "--data.dir=/nonexistent"]) == 0
    assert "a placeholder of 64" in capsys.readouterr().out
