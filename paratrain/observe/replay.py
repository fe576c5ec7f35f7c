"""The replay of step N of a run (`paratrain replay RUN_DIR step-N`; what it runs: paratrain/commands/replay.py): the
step argument, the run's logged records, and the summary that compares the replayed step with the logged one."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from paratrain.errors import UserError
from paratrain.modes import Precision


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


def _f(v, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    return fmt.format(v) if math.isfinite(v) else str(v)


FORWARD_KINDS = ("attn_logit_max", "mlp_max", "act_max")  # a row's activations, in the order its forward makes them


def _nonfinite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v)


def first_nonfinite_row(numerics: dict) -> int | None:
    """The index of the first row, in forward order, whose activations (output, attention logits, MLP hidden) are
    non-finite in a record's `numerics`: where a NaN or an overflow started. Gradients are left out: backward runs
    the rows the other way."""
    columns = [numerics[k] for k in FORWARD_KINDS if isinstance(numerics.get(k), list)]
    return next((i for i in range(len(numerics["rows"])) if any(i < len(c) and _nonfinite(c[i]) for c in columns)),
                None)


def format_numerics(numerics: dict, low_format: str = "bf16") -> str:
    """A watch step's numerics (the record's `numerics`) as a table, one line per row; the first non-finite row
    marked."""
    head = (f"{'row':<6} | {'act max':>9} {'act rms':>9} | {'logit max':>9} | {'mlp max':>9} {'mlp rms':>9} | "
            f"{'grad max':>9} {'grad rms':>9} | {'weight max':>10} | {low_format} headroom")
    lines = [head]
    first = first_nonfinite_row(numerics)
    for i, row in enumerate(numerics["rows"]):
        v = {k: numerics[k][i] for k in numerics if isinstance(numerics[k], list) and k != "rows"}
        room = numerics["headroom_bits"][low_format][i]
        lines.append(f"{row:<6} | {_f(v['act_max']):>9} {_f(v['act_rms']):>9} | {_f(v['attn_logit_max']):>9} | "
                     f"{_f(v['mlp_max']):>9} {_f(v['mlp_rms']):>9} | {_f(v['grad_max']):>9} {_f(v['grad_rms']):>9} | "
                     f"{_f(v['weight_max']):>10} | {'non-finite' if _nonfinite(room) else _f(room, '{:.1f} bits')}"
                     + ("  <- first non-finite" if i == first else ""))
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
        lines.append(format_numerics(replayed["numerics"], Precision(precision).headroom_format))
    found = replayed.get("nonfinite")
    if found:
        lines.append(f"first non-finite output: {found['module']} (rank {found['rank']})" if found.get("module")
                     else "every module's output was finite on replay: the non-finite value arose in the loss or "
                          "backward (see grad max above)")
    lines.append(f"every replayed step's numerics: {run_dir / 'replay' / f'step-{step}' / 'metrics.jsonl'} "
                 f"(paratrain report {run_dir / 'replay' / f'step-{step}'} draws them)")
    return "\n".join(lines)

