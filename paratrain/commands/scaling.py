"""`paratrain scaling`: a timed sweep of one training over world sizes (or layouts), weak or strong, with the
planner's prediction beside each point (paratrain/observe/scaling.py measures and draws)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from paratrain.commands.train import split_overrides
from paratrain.config import load_config
from paratrain.errors import UserError

USAGE = """usage: paratrain scaling (--weak | --strong) (--nproc N1,N2,... [--layout TEXT] | --layouts NAME,...)
                         [--steps N] [--warmup W] [--global-batch G] [--out DIR] [--overwrite]
                         [--gpu PROFILE] [--profile-dir DIR] [--oversubscribe] [--config F.toml] [--section.key=value ...]

  --weak               each data-parallel rank keeps training.micro_batch sequences (the global batch grows)
  --strong             the global batch stays (--global-batch G, default micro_batch x the largest point's dp ranks)
  --nproc N1,N2,...    world sizes, each with --layout (a plan-table layout such as ddp or fsdp,tp=2; default: the
                       config's [parallel])
  --layouts NAME,...   verify's named layouts instead (ddp2, fsdp4, fsdp2xtp2, ...: paratrain verify --list)
  --steps N            timed steps per point (default 10), after --warmup W steps (default 3)
  --out DIR            the points' runs, scaling.md, scaling.json and scaling.png (default runs/scaling-KIND)
  --gpu PROFILE        the planner's hardware for the predictions (a GPU name or a calibrated profile); on a CPU
                       without it, this machine is calibrated first (a few seconds, saved in DIR/profile)
"""

FLAGS = {"--config", "--nproc", "--layout", "--layouts", "--steps", "--warmup", "--global-batch", "--out", "--gpu",
         "--profile-dir"}
SWITCHES = ("--weak", "--strong", "--overwrite", "--oversubscribe")


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    switches = {s for s in SWITCHES if s in argv}
    own, overrides = split_overrides([a for a in argv if a not in SWITCHES], FLAGS, SWITCHES)
    if len(switches & {"--weak", "--strong"}) != 1:
        raise UserError("paratrain scaling needs one of --weak (the batch per rank stays) or --strong (the global "
                        "batch stays)")
    kind = "weak" if "--weak" in switches else "strong"
    steps, warmup = _int(own, "--steps", 10, 1), _int(own, "--warmup", 3, 0)
    base = load_config(own.get("--config"), overrides)
    points = _points(own, base)
    out = Path(own.get("--out") or f"{base.run.out_dir}/scaling-{kind}")
    if out.exists() and any(out.iterdir()) and "--overwrite" not in switches:
        raise UserError(f"{out} already holds output: give --overwrite to replace it, or another --out")

    # lazy: torch (through the trainer and the calibration) is not needed for --help and the argument errors above
    from paratrain.api import train
    from paratrain.observe import scaling
    from paratrain.spec import resolve_run

    batch = base.training.micro_batch
    if kind == "weak" and base.training.global_batch is not None:
        raise UserError("--weak keeps training.micro_batch sequences per data-parallel rank: leave "
                        "training.global_batch unset (it grows with the ranks)")
    if kind == "strong":  # each point's data-parallel degree, once
        dps = {label: _dp(load_config(own.get("--config"), [*overrides, *extra]), ranks)
               for label, ranks, extra in points}
        global_batch = _int(own, "--global-batch", batch * max(dps.values()), 1)
    configs = []
    for (label, ranks, extra) in points:
        sizing = ["training.accum_steps=1"]
        if kind == "strong":
            dp = dps[label]
            if global_batch % dp:
                raise UserError(f"--strong: the global batch {global_batch} does not split over the {dp} data-parallel "
                                f"ranks of {label} (give --global-batch a multiple of every point's dp ranks)")
            sizing = [f"training.global_batch={global_batch}", f"training.micro_batch={global_batch // dp}"]
        configs.append((label, ranks, _config(own, [*overrides, *extra, *sizing], steps + warmup, out, label)))
    # every point checked (and the data prepared once) before the first runs
    configs = [(label, ranks, cfg, resolve_run(cfg, ranks)) for label, ranks, cfg in configs]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    predict = _predictor(own, base, max(r for _, r, _, _ in configs), out)
    measured = []
    for label, ranks, cfg, spec in configs:
        print(f"{kind} scaling: {label} on {ranks} rank(s), global batch {spec.global_batch}", flush=True)
        train(cfg, nproc=ranks, oversubscribe="--oversubscribe" in switches)
        m = scaling.measure(cfg.run_dir, warmup)
        measured.append(scaling.Point(label, ranks, spec.global_batch, cfg.training.seq_len, m["step_s"],
                                      m["compute_s"], m["comm_s"], m["data_s"], predict(spec) if predict else None,
                                      run=cfg.run_dir.name))
    points = scaling.with_efficiency(measured)
    title = (f"{base.model.preset} x {base.training.seq_len} tokens, {base.training.precision} on "
             f"{base.training.device}; {steps} timed steps after {warmup} warm-up; " +
             (f"{batch} sequences per data-parallel rank" if kind == "weak" else f"global batch {global_batch}"))
    files = scaling.write(points, kind, title, out)
    print(scaling.table(points, kind))
    for path in files.values():
        print(f"wrote {path}")
    return 0


def _int(own: dict, flag: str, default: int, least: int) -> int:
    try:
        value = int(own.get(flag, default))
    except ValueError:
        raise UserError(f"{flag} must be an integer, got {own[flag]!r}") from None
    if value < least:
        raise UserError(f"{flag} must be >= {least}, got {value}")
    return value


def _points(own: dict, base) -> list[tuple[str, int, list[str]]]:
    """(label, ranks, config overrides) of each point."""
    if ("--nproc" in own) == ("--layouts" in own):
        raise UserError("paratrain scaling needs --nproc N1,N2,... (with --layout) or --layouts NAME,...")
    if "--layouts" in own:
        # lazy: verify's table of named layouts (and its imports) only for --layouts
        from paratrain.verify import layout_overrides

        points = []
        for name in own["--layouts"].split(","):
            ranks, extra = layout_overrides(name.strip())
            points.append((name.strip(), ranks, [o for o in extra if not o.startswith("training.micro_batch=")]))
        return points
    try:
        sizes = sorted({int(n) for n in own["--nproc"].split(",")})
    except ValueError:
        raise UserError(f"--nproc must be a comma-separated list of world sizes, got {own['--nproc']!r}") from None
    if sizes[0] < 1:
        raise UserError("--nproc: every world size must be >= 1")
    extra = []
    if "--layout" in own:
        # lazy: the layout grammar's parser only for --layout
        from paratrain.config import ParallelConfig
        from paratrain.layout_grammar import parse_layout_name

        named = parse_layout_name(own["--layout"], "--layout")
        # the grammar's degrees as [parallel] settings; the data-parallel degree follows each world size
        lay = named.layout(max(sizes))
        extra = [f"parallel.{k}={v}" for k, v in dataclasses.asdict(lay.to_config(ParallelConfig())).items()
                 if k not in ("dp_shard", "dp_replicate") and v != getattr(ParallelConfig(), k)]
    return [(f"{own.get('--layout', base.parallel.dp_mode)} {n}", n, extra) for n in sizes]


def _config(own: dict, overrides: list[str], steps: int, out: Path, label: str):
    """A point's run: the configured training, timed (no evaluation, checkpoint, sample), into out/<label>."""
    name = label.replace(" ", "-").replace(",", "_").replace("=", "")
    return load_config(own.get("--config"), [
        *overrides, f"training.steps={steps}", "training.eval_every=0", "checkpoint.save_final=false",
        "checkpoint.every=0", "checkpoint.every_minutes=0", "checkpoint.resume=none", "sample.max_new_tokens=0",
        "metrics.progress=none", f"run.out_dir={out}", f"run.name={name}"])


def _dp(cfg, ranks: int) -> int:
    """The data-parallel degree of a point's layout."""
    # lazy: the layout rules only once the points are known
    from paratrain.layout import Layout

    return Layout.from_config(cfg.parallel, ranks).dp


def _predictor(own: dict, base, ranks: int, out: Path):
    """spec -> the planner's step time on the sweep's hardware (None: no prediction on this device)."""
    # lazy: the cost model and the calibration only for the predictions
    from paratrain.calibration import calibrate
    from paratrain.estimate.hardware import resolve_hardware
    from paratrain.estimate.step_time import Candidate, Context, predict
    from paratrain.layout import Batch
    from paratrain.recipe import Recipe

    import torch

    on_cpu = base.training.device == "cpu" or not torch.cuda.is_available()
    if "--gpu" in own:
        hw = resolve_hardware(own["--gpu"], profile_dir=own.get("--profile-dir"))
    elif on_cpu:
        print(f"calibrating this machine for the planner's predictions ({ranks} rank(s); --gpu PROFILE skips it)",
              flush=True)
        hw, _ = calibrate("scaling", ranks, out / "profile", seconds=0.05)
    else:
        print("no predictions: give --gpu NAME (this GPU's datasheet name or a calibrated profile)", flush=True)
        return None
    device = "cpu" if on_cpu else "cuda"

    def step_s(spec) -> float:
        cfg, lay = spec.cfg, spec.layout
        micro = lay.forward_batch(Batch(spec.global_batch, cfg.training.micro_batch, cfg.training.seq_len))
        recipe = Recipe.from_config(cfg, lay, micro, spec.accum_steps, device)
        ctx = Context(spec.model_args, recipe, spec.global_batch, hw, lay.world_size, spec.model_name)
        return predict(Candidate.of(recipe), ctx).step_s

    return step_s
