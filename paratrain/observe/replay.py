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
import json
import math
import re
from pathlib import Path

from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.modes import headroom_format


def parse_step(text: str) -> int:
    m = re.fullmatch(r"(?:step-)?(\d+)", text)
    if not m or int(m.group(1)) < 1:
        raise UserError(f"'{text}' is not a step: give step-N or N (N >= 1, as metrics.jsonl counts steps)")
    return int(m.group(1))


def logged_records(run_dir: Path, step: int) -> list[dict]:
    """Every record metrics.jsonl holds for `step` (a rolled-back run logs a step again), oldest first."""
    log = run_dir / "metrics.jsonl"
    if not log.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run folder, e.g. runs/default?)")
    found = []
    for raw in log.read_bytes().splitlines():
        try:
            r = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and r.get("step") == step and "loss" in r:
            found.append(r)
    return found


def start_checkpoint(run_dir: Path, step: int) -> Path | None:
    """The newest intact checkpoint of the run from before step `step` (its folder step-S holds the state after S
    steps, S < step), or None: the replay then starts from the beginning."""
    from paratrain.training.checkpoint import checkpoint_problem, step_folders, step_of

    for path in reversed(step_folders(run_dir / "checkpoints")):
        if step_of(path) < step and checkpoint_problem(path) is None:
            return path
    return None


def replay_config(run_dir: str | Path, step: int, nproc: int | None = None):
    """(config, ranks, checkpoint) of the replay of `step` of the run in `run_dir`."""
    from paratrain.config import load_config
    from paratrain.layout import Layout

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


def _f(v, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    return fmt.format(v) if math.isfinite(v) else str(v)


def format_numerics(numerics: dict, low_format: str = "bf16") -> str:
    """A watch step's numerics (the record's `numerics`) as a table, one line per row."""
    head = (f"{'row':<6} | {'act max':>9} {'act rms':>9} | {'logit max':>9} | {'mlp max':>9} {'mlp rms':>9} | "
            f"{'grad max':>9} {'grad rms':>9} | {'weight max':>10} | {low_format} headroom")
    lines = [head]
    for i, row in enumerate(numerics["rows"]):
        v = {k: numerics[k][i] for k in numerics if isinstance(numerics[k], list) and k != "rows"}
        room = numerics["headroom_bits"][low_format][i]
        lines.append(f"{row:<6} | {_f(v['act_max']):>9} {_f(v['act_rms']):>9} | {_f(v['attn_logit_max']):>9} | "
                     f"{_f(v['mlp_max']):>9} {_f(v['mlp_rms']):>9} | {_f(v['grad_max']):>9} {_f(v['grad_rms']):>9} | "
                     f"{_f(v['weight_max']):>10} | {_f(room, '{:.1f} bits')}")
    return "\n".join(lines)


def summary(run_dir: Path, step: int, checkpoint: Path | None, replayed: dict, logged: list[dict],
            precision: str) -> str:
    """What the replay of `step` found, beside what the run logged for it."""
    start = f"checkpoint {checkpoint.name}" if checkpoint else "the beginning (no earlier checkpoint)"
    lines = [f"replayed step {step} of {run_dir} from {start}: batch {replayed.get('batch')}, loss "
             f"{_f(replayed.get('loss'), '{:.4f}')}, grad norm {_f(replayed.get('grad_norm'), '{:.4g}')}"]
    if logged:
        lines.append(f"the run logged step {step}: " + "; then ".join(
            f"loss {_f(r.get('loss'), '{:.4f}')} (batch {r.get('batch', '?')})" for r in logged))
        batches = {r.get("batch") for r in logged}
        if None not in batches and replayed.get("batch") not in batches:
            lines.append(f"note: the replay read another batch: the run rolled back after {start} and skipped "
                         "batches that checkpoint does not know of")
    if replayed.get("numerics"):
        lines.append(format_numerics(replayed["numerics"], headroom_format(precision)))
    found = replayed.get("nonfinite")
    if found:
        lines.append(f"first non-finite output: {found['module']} (rank {found['rank']})" if found.get("module")
                     else "every module's output was finite on replay: the non-finite value arose in the loss or "
                          "backward (see grad max above)")
    lines.append(f"every replayed step's numerics: {run_dir / 'replay' / f'step-{step}' / 'metrics.jsonl'} "
                 f"(paratrain report {run_dir / 'replay' / f'step-{step}'} draws them)")
    return "\n".join(lines)


def main_replay(argv: list[str]) -> int:
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
    from paratrain.api import train

    train(cfg, nproc=world, oversubscribe=args.oversubscribe)
    replayed = logged_records(cfg.run_dir, step)
    if not replayed:
        raise UserError(f"the replay wrote no record of step {step} ({cfg.run_dir / 'metrics.jsonl'})")
    print(summary(run_dir, step, checkpoint, replayed[-1], logged, cfg.training.precision))
    return 0
