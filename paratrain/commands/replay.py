"""`paratrain replay RUN_DIR step-N [--nproc N]`: run step N of a run again, with the numerics watch on every step.

The run's own config (its config.toml, every degree written out, so the same layout and world size), resumed from
its newest intact checkpoint before step N (or from the start when there is none), trained to step N into
RUN_DIR/replay/step-N with `metrics.numerics_every = 1`: every replayed step's per-block statistics, and at a
non-finite step the first module whose output became non-finite (the run's own diagnosis, see
observe/numerics.py). Batches are a function of (seed, data position), so the replay reads the batch the run read,
unless the run rolled back between that checkpoint and step N (it then skipped batches the checkpoint does not
know of); the summary compares the batch id of the replayed step with the one the run logged. Nothing in RUN_DIR
outside RUN_DIR/replay is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paratrain.config import load_config
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.layout import Layout
from paratrain.observe.replay import logged_records, parse_step, summary


def start_checkpoint(run_dir: Path, step: int) -> Path | None:
    """The newest intact checkpoint of the run from before step `step` (its folder step-S holds the state after S
    steps, S < step), or None: the replay then starts from the beginning."""
    # lazy: torch (through training.checkpoint) is not needed for --help and the argument errors
    from paratrain.training.checkpoint import checkpoint_problem, step_folders, step_of

    for path in reversed(step_folders(run_dir / "checkpoints")):
        if step_of(path) < step and checkpoint_problem(path) is None:
            return path
    return None


def replay_config(run_dir: str | Path, step: int, nproc: int | None = None):
    """(config, ranks, checkpoint) of the replay of `step` of the run in `run_dir`."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir}: no config.toml (is this a run folder, e.g. runs/default?)")
    cfg = load_config(run_dir / "config.toml")
    total = cfg.training.steps
    if step > total:
        raise UserError(f"{run_dir} trains {total} steps: there is no step {step}")
    checkpoint = start_checkpoint(run_dir, step)
    p = cfg.parallel
    world = p.pp * p.dp_replicate * max(1, p.dp_shard) * p.cp * p.tp
    if nproc is not None and nproc != world:
        p = dataclasses.replace(p, dp_shard=-1)  # the data-parallel ranks take what the other degrees leave
        world = nproc
    Layout.from_config(p, world)  # a world size the run's layout cannot take is one line now
    cfg = dataclasses.replace(
        cfg, parallel=p,
        run=dataclasses.replace(cfg.run, out_dir=str(run_dir / "replay"), name=f"step-{step}", overwrite=True),
        # every step settles (its numerics read as it ends); the final evaluation, which always runs, kept short
        training=dataclasses.replace(cfg.training, steps=step, eval_every=0, log_every=1, eval_sequences=1),
        checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(checkpoint) if checkpoint else "none", every=0,
                                       save_final=False, export_hf=False, export_safetensors=False,
                                       async_save=False),
        resilience=dataclasses.replace(cfg.resilience, max_restarts=0, max_bad_steps=step + 1),  # never roll back
        metrics=dataclasses.replace(cfg.metrics, numerics_every=1, prometheus_port=0, tensorboard=False,
                                    profile_steps=0),
        sample=dataclasses.replace(cfg.sample, max_new_tokens=0))
    return cfg, world, checkpoint


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain replay",
                                   description="Run step N of a run again with the numerics watch on every step.")
    parser.add_argument("run", metavar="RUN_DIR", help="the run folder (runs/<name>)")
    parser.add_argument("step", metavar="step-N", help="the step to replay, as metrics.jsonl numbers it")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the run's own world size)")
    parser.add_argument("--oversubscribe", action="store_true", help="allow more CPU ranks than paratrain train does")
    args = parser.parse_args(argv)
    run_dir, step = Path(args.run), parse_step(args.step)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc must be >= 1")
    cfg, world, checkpoint = replay_config(run_dir, step, args.nproc)
    logged = logged_records(run_dir, step)
    from paratrain.api import train  # lazy: torch is not needed for --help and the argument errors above

    train(cfg, nproc=world, oversubscribe=args.oversubscribe)
    replayed = logged_records(cfg.run_dir, step)
    if not replayed:
        raise UserError(f"the replay wrote no record of step {step} ({cfg.run_dir / 'metrics.jsonl'})")
    print(summary(run_dir, step, checkpoint, replayed[-1], logged, cfg.training.precision))
    return 0
