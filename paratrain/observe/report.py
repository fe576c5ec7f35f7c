"""`paratrain report RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG plots and a markdown summary of runs.

Reads each run's `metrics.jsonl` (and `config.toml` for the layout) and writes into the output folder:
- `loss.png`: training loss and validation loss against step and against tokens;
- `throughput.png`: tokens/s against step, and each run's mean step time split into compute / data wait / comm wait;
- `memory.png`: memory per rank against step (CUDA allocated where logged, else process RSS), the y-axis from 0;
- `scaling.png`, for two or more runs of one `paratrain scaling` sweep (its folder's scaling.json names them): the
  sweep's tokens/s against the number of devices, with linear scaling from the smallest point. Only a sweep's points
  compare (one model and batch recipe, the same timed steps after a warm-up, one after the other on one machine);
  ordinary runs differ in step counts, batches and the machine's load, so they get no curve, and report.md says why
  in one line;
- `expert_load.png`, for mixture-of-experts runs: each MoE layer's max load violation (busiest expert's tokens over
  the mean, minus 1) and dropped-assignment share against step;
- `numerics.png` (`numerics-<run>.png` for several runs), for a run with the numerics watch on
  (metrics.numerics_every): per-layer heat maps over the watched steps of max |activation|, max |gradient| and the
  bf16 (fp16 for fp16 runs) headroom, non-finite cells marked;
- `report.md`: the numbers (final and best losses, throughput, MFU, step-time split, peak memory per rank, skipped
  steps, restarts, checkpoint save times, expert load, scaling efficiency), and `summary.json` with the same numbers.

A step logged twice (a resumed or rolled-back run appends to the same log) keeps its last record; a checkpoint step
saved twice counts once. The layout is the trainer's logged `Layout.short_name()`; a run without the trainer's last
record (`"end": "finished"`) or with fewer steps than planned is marked unfinished.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.config import ParallelConfig, toml_reader
from paratrain.errors import ConfigError, UserError
from paratrain.layout import Layout
from paratrain.modes import LOW_PRECISIONS, Precision
from paratrain.observe.replay import first_nonfinite_row
from paratrain.observe.metrics import in_effect

MIB = 2**20


@dataclass
class Run:
    name: str
    path: Path
    steps: list[dict]  # one record per training step (has "loss"), sorted by step
    vals: list[tuple[int, float]]  # (step, val loss)
    config: dict = field(default_factory=dict)
    bad_lines: int = 0
    saves: dict[int, float] = field(default_factory=dict)  # checkpoint step -> save duration (s)
    end: dict | None = None  # the run's last record ({"end": "finished" | "preempted" | "interrupted"}), if any
    info: dict = field(default_factory=dict)  # what the last process said it ran: layout, world_size, model, params
    nonfinite: list[dict] = field(default_factory=list)  # every step the numerics watch diagnosed (even rolled back)
    watched: list[dict] = field(default_factory=list)  # every record with the numerics watch's statistics, in log order
    rolled_back: int = 0  # step records undone by a rollback (the run went back to a checkpoint)
    abandoned: int = 0  # step records a later start of the run went back over (a restart, a resume)
    downstream: list[tuple[int, dict]] = field(default_factory=list)  # (step, {task: {metric: value}}) of [eval]

    @property
    def world_size(self) -> int:
        if isinstance(self.info.get("world_size"), int):
            return self.info["world_size"]
        for r in reversed(self.steps):
            if r.get("rank_memory"):
                return len(r["rank_memory"])
        for r in reversed(self.steps):
            if r.get("tokens_per_s") and r.get("tokens_per_s_per_device"):
                return max(1, round(r["tokens_per_s"] / r["tokens_per_s_per_device"]))
        return 1

    @property
    def layout(self) -> str:
        """The layout's canonical short name (`Layout.short_name`: `fsdp 2 x tp2`, `pp2 1f1b m=4`, `1 rank`): as
        the trainer logged it, else resolved from config.toml's [parallel] and the world size (older logs)."""
        if isinstance(self.info.get("layout"), str):
            return self.info["layout"]
        p = self.section("parallel")
        known = {f.name for f in dataclasses.fields(ParallelConfig)}
        try:
            lay = Layout.from_config(ParallelConfig(**{k: v for k, v in p.items() if k in known}), self.world_size)
        except (ConfigError, TypeError, ValueError):
            return "?"
        return lay.short_name().replace(" m=0", "")  # pipeline microbatches: unknown without the model

    @property
    def total_steps(self) -> int | None:
        steps = self.section("training").get("steps")
        return steps if isinstance(steps, int) and not isinstance(steps, bool) else None

    def section(self, name: str) -> dict:
        """A section of config.toml ({} when absent or not a table)."""
        v = self.config.get(name)
        return v if isinstance(v, dict) else {}

    @property
    def model(self) -> str:
        """What was trained: the logged model name and parameter count, else config.toml's [model] section."""
        if isinstance(self.info.get("model"), str):
            params = self.info.get("params")
            return self.info["model"] + (f" ({params:,} parameters)" if isinstance(params, int) else "")
        m = self.section("model")
        return str(m.get("init_from") or m.get("preset", "?")) + "".join(
            f" {k}={v}" for k, v in sorted(m.items()) if k not in ("preset", "init_from"))

    @property
    def tokens_per_step(self) -> int | None:
        """Global batch in tokens (sequences x length), from the first logged step."""
        r = self.steps[0]
        return r["tokens"] // r["step"] if isinstance(r.get("tokens"), int) and r["step"] > 0 else None

    @property
    def status(self) -> str:
        """`finished`, `preempted at step N (resumable)`, or `unfinished (...)` for a run that crashed or is still
        going: no final record, or fewer steps than planned."""
        last, total = self.steps[-1]["step"], self.total_steps
        of = f" of {total}" if total else ""
        end = self.end if self.end is not None and self.end["step"] >= last else None
        if end is not None and end.get("end") == "finished":
            return "finished"
        if end is not None and end.get("end") in ("preempted", "interrupted"):
            return f"{end['end']} at step {end['step']}{of} (resumable)"
        if end is None and not self.info and total and last >= total and any(s >= total for s, _ in self.vals):
            return "finished"  # an older log: no end record, but the final evaluation is there
        return f"unfinished (no final record; stopped at step {last}{of})"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such run folder")
    log = path / "metrics.jsonl"
    if not log.is_file():
        raise UserError(f"{path}: no metrics.jsonl (is this a run folder, e.g. runs/default?)")
    by_step: dict[int, dict] = {}
    vals: dict[int, float] = {}
    saves: dict[int, float] = {}
    downstream: dict[int, dict] = {}
    end, info, nonfinite, watched = None, {}, [], []
    bad, records = 0, []
    for raw in log.read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            r = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            bad += 1  # e.g. the last line of a run killed mid-write, or bytes that are not text
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            records.append(r)
            if isinstance(r.get("nonfinite"), dict):  # kept even when a rollback undoes the step
                nonfinite.append({"step": r["step"], **r["nonfinite"]})
    records, undone = in_effect(records)  # a restarted or rolled-back run: the steps it stands on
    undone_steps = {kind: sum(1 for u, k in undone if k == kind and "loss" in u) for kind in ("rollback", "start")}
    undone_steps["start"] += sum(1 for u, k in undone if k == "resume" and "loss" in u)
    for r in records:
        if "loss" in r:
            by_step[r["step"]] = r
        if _numerics_record(r):
            watched.append(r)
        if _finite(r.get("val_loss")):
            vals[r["step"]] = r["val_loss"]
        if isinstance(r.get("downstream"), dict):
            downstream[r["step"]] = r["downstream"]
        if _finite(r.get("checkpoint_save_s")):  # a save made before this record; a step saved twice counts once
            at = r.get("checkpoint_step")
            saves[at if isinstance(at, int) else r["step"]] = r["checkpoint_save_s"]
        if "end" in r:
            end = r
        if "layout" in r:  # the first record of each process (a resumed run: the last process's)
            info = {k: r[k] for k in ("layout", "world_size", "model", "params") if k in r}
    if not by_step:
        raise UserError(f"{log}: no training steps logged" + (f" ({bad} unreadable lines: not UTF-8 JSON)" if bad else ""))
    config = {}
    if (path / "config.toml").is_file():
        tomllib = toml_reader()
        try:
            config = tomllib.loads((path / "config.toml").read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            config = {}
    name = config.get("run", {}).get("name", path.name)
    return Run(name, path, [by_step[s] for s in sorted(by_step)], sorted(vals.items()), config, bad, saves, end, info,
               nonfinite, watched, rolled_back=undone_steps["rollback"], abandoned=undone_steps["start"],
               downstream=sorted(downstream.items()))


def _numerics_record(r: dict) -> bool:
    """A record whose numerics are usable: rows, and per row each statistic the heat maps draw."""
    n = r.get("numerics")
    if not isinstance(n, dict) or not isinstance(n.get("rows"), list) or not isinstance(n.get("headroom_bits"), dict):
        return False
    size = len(n["rows"])
    lists = [n.get("act_max"), n.get("grad_max"), *(n["headroom_bits"].get(f) for f in LOW_PRECISIONS)]
    return all(isinstance(v, list) and len(v) == size for v in lists)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _median(values) -> float | None:
    values = [v for v in values if _finite(v)]
    return statistics.median(values) if values else None


def _mean(values) -> float | None:
    values = [v for v in values if _finite(v)]
    return sum(values) / len(values) if values else None


def summarize(run: Run) -> dict:
    """The numbers of one run (what report.md shows and summary.json holds)."""
    steps = run.steps
    last = steps[-1]
    timed = steps[1:] or steps  # the first step of a process includes warm-up
    best = min(run.vals, key=lambda sv: sv[1]) if run.vals else None
    split = {k: _mean(r.get(k) for r in timed) for k in ("step_time_s", "compute_time_s", "data_time_s", "comm_time_s")}
    memory: dict[int, dict] = {}
    for r in steps:
        for row in r.get("rank_memory") or []:
            m = memory.setdefault(int(row["rank"]), {"rank": int(row["rank"]), "node": row.get("node", 0)})
            for key in ("rss_bytes", "rss_peak_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                        "cuda_peak_allocated_bytes", "cuda_alloc_retries", "cuda_ooms"):
                if _finite(row.get(key)):
                    m[key] = max(m.get(key, 0), row[key])
    saves = [run.saves[k] for k in sorted(run.saves)]
    moe = next((r for r in reversed(steps) if r.get("moe_tokens_per_expert")), None)
    return {
        "name": run.name, "path": str(run.path), "world_size": run.world_size, "layout": run.layout,
        "model": run.model, "tokens_per_step": run.tokens_per_step, "status": run.status,
        "steps": last["step"], "total_steps": run.total_steps, "tokens": last.get("tokens"),
        "final_loss": last["loss"],
        "best_val_loss": best[1] if best else None, "best_val_step": best[0] if best else None,
        "final_val_loss": run.vals[-1][1] if run.vals else None, "final_val_step": run.vals[-1][0] if run.vals else None,
        "tokens_per_s": _median(r.get("tokens_per_s") for r in timed),
        "samples_per_s": _median(r.get("samples_per_s") for r in timed),
        "tokens_per_s_per_device": _median(r.get("tokens_per_s_per_device") for r in timed),
        "mfu": _median(r.get("mfu") for r in timed),
        "step_time": split,
        "skipped_steps": last.get("skipped_steps", 0), "restarts": max(r.get("restarts", 0) for r in steps),
        "rolled_back_steps": run.rolled_back, "abandoned_steps": run.abandoned,
        "final_loss_scale": last.get("loss_scale"),  # fp16
        "checkpoint_saves": len(saves), "checkpoint_save_s_mean": _mean(saves),
        "checkpoint_save_s_max": max(saves) if saves else None,
        "memory": [memory[k] for k in sorted(memory)],
        "moe": {"step": moe["step"], "max_violation": moe.get("moe_max_violation"),
                "aux_loss": moe.get("moe_aux_loss"), "dropped_tokens": sum(r.get("moe_dropped_tokens", 0) for r in steps),
                "layer_violation": moe.get("moe_violation") or [],
                "layer_dropped_share": moe.get("moe_dropped_share") or []} if moe else None,
        "unreadable_lines": run.bad_lines,
        "numerics": numerics_summary(run),
        "downstream": {"step": run.downstream[-1][0], "tasks": run.downstream[-1][1]} if run.downstream else None,
    }


def numerics_summary(run: Run) -> dict | None:
    """The numerics watch of a run: steps watched, the largest activation and the least headroom (where and when),
    and every step whose first non-finite module was named."""
    watched, found = run.watched, run.nonfinite
    if not watched and not found:
        return None
    out: dict = {"watched_steps": len(watched), "nonfinite": found}
    if watched:
        fmt = _low_format(run)
        def cells_of(values):
            return [(v, r["step"], row) for r in watched for row, v in zip(r["numerics"]["rows"], values(r))
                    if _is_num(v)]

        cells = cells_of(lambda r: r["numerics"]["act_max"])
        room = [c for c in cells_of(lambda r: r["numerics"]["headroom_bits"][fmt]) if math.isfinite(c[0])]  # bits
        if cells:
            v, step, row = max(cells, key=lambda c: math.inf if math.isnan(c[0]) else c[0])
            out["largest_activation"] = {"value": v, "step": step, "row": row}
        if room:
            v, step, row = min(room)
            out["least_headroom"] = {"format": fmt, "bits": v, "step": step, "row": row}
    return out


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _low_format(run: Run) -> str:
    return Precision(run.section("training").get("precision") or "fp32").headroom_format


# -- plots ----------------------------------------------------------------------------------------

def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install matplotlib  "
                        "(or: pip install 'paratrain[report]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(runs: list[Run]):
    plt = pyplot()
    fig, (by_step, by_tokens) = plt.subplots(2, 1, figsize=(9, 8))
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps = [r["step"] for r in run.steps]
        tokens = [r.get("tokens", 0) for r in run.steps]
        loss = [r["loss"] for r in run.steps]
        by_step.plot(steps, loss, color=color, label=f"{run.name} train")
        by_tokens.plot(tokens, loss, color=color, label=f"{run.name} train")
        if run.vals:
            per_token = {r["step"]: r.get("tokens", 0) for r in run.steps}
            vs, vl = zip(*run.vals)
            by_step.plot(vs, vl, "o--", color=color, label=f"{run.name} val")
            by_tokens.plot([per_token.get(s, 0) for s in vs], vl, "o--", color=color, label=f"{run.name} val")
    by_step.set(xlabel="step", ylabel="loss", title="loss")
    by_tokens.set(xlabel="tokens", ylabel="loss")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def downstream_series(run: Run) -> dict[str, list[tuple[int, float]]]:
    """{"task/metric": [(step, value)]} of the run's [eval] evaluations (finite values)."""
    out: dict[str, list] = {}
    for step, tasks in run.downstream:
        for task, metrics in tasks.items():
            for metric, v in (metrics.items() if isinstance(metrics, dict) else ()):
                if _finite(v):
                    out.setdefault(f"{task}/{metric}", []).append((step, v))
    return out


def plot_downstream(runs: list[Run]):
    """Each downstream metric ([eval]) against step (left) and tokens (right), one row per task/metric."""
    plt = pyplot()
    names = sorted({name for run in runs for name in downstream_series(run)})
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 2.6 * len(names)), squeeze=False)
    for i, run in enumerate(runs):
        per_token = {r["step"]: r.get("tokens", 0) for r in run.steps}
        series = downstream_series(run)
        for (by_step, by_tokens), name in zip(axes, names):
            if name in series:
                steps, values = zip(*series[name])
                by_step.plot(steps, values, "o-", color=f"C{i}", label=run.name)
                by_tokens.plot([per_token.get(s, 0) for s in steps], values, "o-", color=f"C{i}", label=run.name)
    for (by_step, by_tokens), name in zip(axes, names):
        by_step.set(xlabel="step", ylabel=name.split("/")[-1], title=name)
        by_tokens.set(xlabel="tokens", title=name)
        for ax in (by_step, by_tokens):
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    return fig


def plot_throughput(runs: list[Run]):
    plt = pyplot()
    fig, (tps, split) = plt.subplots(2, 1, figsize=(9, 8))
    for i, run in enumerate(runs):
        pts = [(r["step"], r["tokens_per_s"]) for r in run.steps if _finite(r.get("tokens_per_s"))]
        if pts:
            tps.plot(*zip(*pts), color=f"C{i}", label=f"{run.name} ({run.world_size} dev)")
    tps.set(xlabel="step", ylabel="tokens/s", title="throughput (all devices)")
    tps.grid(alpha=0.3)
    tps.legend()
    names = [run.name for run in runs]
    left = [0.0] * len(runs)
    for phase, label, color in (("compute_time_s", "compute", "C0"), ("data_time_s", "data wait", "C1"),
                                ("comm_time_s", "comm wait (explicit collectives)", "C3")):
        ms = [1e3 * (_mean(r.get(phase) for r in (run.steps[1:] or run.steps)) or 0.0) for run in runs]
        split.barh(names, ms, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, ms)]
    split.set(xlabel="mean step time (ms)", title="step time split")
    split.legend()
    fig.tight_layout()
    return fig


def _memory_series(run: Run) -> tuple[str, dict[int, list[tuple[int, float]]]]:
    cuda = any("cuda_allocated_bytes" in row for r in run.steps for row in r.get("rank_memory") or [])
    key = "cuda_allocated_bytes" if cuda else "rss_bytes"
    series: dict[int, list[tuple[int, float]]] = {}
    for r in run.steps:
        for row in r.get("rank_memory") or []:
            if _finite(row.get(key)):
                series.setdefault(int(row["rank"]), []).append((r["step"], row[key] / MIB))
    return key, series


def plot_memory(runs: list[Run]):
    """Memory per rank against step, the axis from 0 (an axis from the lowest value draws a few MiB of jitter on
    hundreds as a cliff)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    kinds, top = set(), 0.0
    for i, run in enumerate(runs):
        key, series = _memory_series(run)
        kinds.add("CUDA allocated" if key.startswith("cuda") else "process RSS")
        styles = ["-", "--", ":", "-."]
        for rank, pts in sorted(series.items()):
            ax.plot(*zip(*pts), styles[rank % 4], color=f"C{i}", marker=".",
                    label=f"{run.name} rank {rank}" if len(runs) > 1 else f"rank {rank}")
            top = max(top, *(mib for _, mib in pts))
    ax.set(xlabel="step", ylabel="MiB", title="memory per rank (" + ", ".join(sorted(kinds)) + ")")
    ax.set_ylim(0, 1.08 * top or 1)  # headroom above the highest point, also for a single log step
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return fig


def plot_expert_load(runs: list[Run]):
    """Each MoE layer's max load violation and dropped-assignment share against step (a line per run and layer)."""
    plt = pyplot()
    fig, (violation, dropped) = plt.subplots(2, 1, figsize=(9, 8))
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        for ax, key in ((violation, "moe_violation"), (dropped, "moe_dropped_share")):
            layers: dict[int, list[tuple[int, float]]] = {}
            for r in run.steps:
                for layer, v in enumerate(r.get(key) or []):
                    if _finite(v):
                        layers.setdefault(layer, []).append((r["step"], v))
            for layer, pts in sorted(layers.items()):
                ax.plot(*zip(*pts), styles[i % 4], color=f"C{layer % 10}",
                        label=f"{run.name} MoE layer {layer}" if len(runs) > 1 else f"MoE layer {layer}")
    violation.set(xlabel="step", ylabel="max load / mean - 1", title="max load violation per MoE layer (0 = balanced)")
    dropped.set(xlabel="step", ylabel="share", title="dropped assignments per MoE layer (capacity limit)")
    for ax in (violation, dropped):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return fig


def sweep_point(run: Run) -> tuple[Path, str, dict] | None:
    """The `paratrain scaling` sweep point a run is: (the sweep's folder, "weak" or "strong", the point as its
    scaling.json holds it), or None for a run of no sweep (the sweep writes its runs into its folder, beside
    scaling.json, which names each point's run folder)."""
    folder = run.path.resolve().parent
    try:
        sweep = json.loads((folder / "scaling.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    kind = sweep.get("kind") if isinstance(sweep, dict) else None
    if kind not in ("weak", "strong") or not isinstance(sweep.get("points"), list):
        return None
    points = {p["run"]: p for p in sweep["points"] if isinstance(p, dict) and isinstance(p.get("run"), str)
              and isinstance(p.get("ranks"), int) and _finite(p.get("tokens_per_s"))}
    point = points.get(run.path.resolve().name)
    return (folder, kind, point) if point else None


def scaling_curves(runs: list[Run], summaries: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(strong points, weak points, the runs left out [{"run", "reason"}]): a curve of each kind from the runs of one
    `paratrain scaling` sweep of that kind (of those with two device counts given, the one with the most runs), with
    the sweep's own numbers (the median step after its warm-up); every other run is left out, with the reason."""
    sweeps: dict[Path, tuple[str, list[tuple[dict, dict]]]] = {}  # folder -> (kind, [(summary, point)])
    left_out = []
    for run, s in zip(runs, summaries):
        found = sweep_point(run)
        if found is None:
            left_out.append({"run": s["name"], "reason": "not a point of a `paratrain scaling` sweep"})
        else:
            sweeps.setdefault(found[0], (found[1], []))[1].append((s, found[2]))
    curves: dict[str, list[dict]] = {"strong": [], "weak": []}
    for kind in curves:
        mine = [folder for folder, (k, _) in sweeps.items() if k == kind]
        counts = {f: len({p["ranks"] for _, p in sweeps[f][1]}) for f in mine}  # device counts given of each
        chosen = max((f for f in mine if counts[f] > 1), key=lambda f: len(sweeps[f][1]), default=None)
        for folder in mine:
            members = sweeps[folder][1]
            if folder == chosen:
                curves[kind] = scaling_points([{"name": s["name"], "world_size": p["ranks"],
                                                "tokens_per_s": p["tokens_per_s"]} for s, p in members])
                continue
            why = "no other device count of its sweep given" if counts[folder] == 1 else f"another {kind} sweep"
            left_out += [{"run": s["name"], "reason": f"{why} ({folder.name})"} for s, _ in members]
    return curves["strong"], curves["weak"], left_out


def scaling_note(runs: int, curves: bool, left_out: list[dict]) -> str | None:
    """One line on why runs are not on a scaling curve (None for one run: nothing to compare)."""
    if runs < 2 or not left_out:
        return None
    named = "; ".join(f"{x['run']} ({x['reason']})" for x in left_out)
    if curves:
        return f"Left out of the scaling curves (only the points of one `paratrain scaling` sweep compare): {named}."
    return (f"No scaling curve: {named}. Only the points of one `paratrain scaling` sweep compare (one batch recipe, "
            "the same timed steps after a warm-up, one machine); ordinary runs differ in steps, batch and the "
            "machine's load: run `paratrain scaling --weak|--strong` for a curve.")


def scaling_points(summaries: list[dict]) -> list[dict]:
    """Best tokens/s at each device count, and the efficiency against linear scaling from the smallest count."""
    best: dict[int, dict] = {}
    for s in summaries:
        if _finite(s["tokens_per_s"]) and (s["world_size"] not in best
                                           or s["tokens_per_s"] > best[s["world_size"]]["tokens_per_s"]):
            best[s["world_size"]] = s
    if not best:
        return []
    base_n = min(best)
    base = best[base_n]["tokens_per_s"] / base_n
    return [{"devices": n, "run": best[n]["name"], "tokens_per_s": best[n]["tokens_per_s"],
             "tokens_per_s_per_device": best[n]["tokens_per_s"] / n, "efficiency": best[n]["tokens_per_s"] / (base * n)}
            for n in sorted(best)]


def plot_numerics(run: Run):
    """Heat maps, layer by watched step (every watched record in log order: a step rolled back and run again
    appears twice): log10 max |activation|, log10 max |gradient|, headroom in bits; non-finite cells marked x, each
    step's first non-finite row (observe/replay.py) boxed."""
    import numpy as np

    plt = pyplot()
    rows = run.watched[-1]["numerics"]["rows"]
    watched = [r for r in run.watched if r["numerics"]["rows"] == rows]
    steps = [r["step"] for r in watched]
    firsts = [first_nonfinite_row(r["numerics"]) for r in watched]
    fmt = _low_format(run)
    panels = [("act_max", "log10 max |activation|", True), ("grad_max", "log10 max |gradient|", True),
              (("headroom_bits", fmt), f"{fmt} headroom (bits; 0 = overflow)", False)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 0.25 * len(steps) + 3), 2.2 + 0.9 * len(panels) *
                                                                                           max(2.0, len(rows) / 4)))
    for ax, (key, title, log) in zip(axes, panels):
        cells = [[_cell((r["numerics"][key[0]][key[1]] if isinstance(key, tuple) else r["numerics"][key])[i], log)
                  for r in watched] for i in range(len(rows))]
        grid = np.array([[v for v, _ in row] for row in cells], dtype=float)
        cmap = plt.get_cmap("viridis_r" if not log else "magma").with_extremes(bad="lightgrey")
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap)
        for i, row in enumerate(cells):
            for j, (_, overflowed) in enumerate(row):
                if overflowed:
                    ax.text(j, i, "x", ha="center", va="center", color="red", fontsize="small", fontweight="bold")
        for j, i in enumerate(firsts):
            if i is not None:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        ax.set_yticks(range(len(rows)), rows, fontsize="small")
        ax.set_xticks(range(len(steps)), steps, fontsize="x-small", rotation=90 if len(steps) > 20 else 0)
        ax.set(xlabel="step", ylabel="layer", title=title)
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"{run.name}: numerics watch (x: inf or NaN; boxed: where it started)")
    fig.tight_layout()
    return fig


def _cell(v, log: bool) -> tuple[float, bool]:
    """A heat map cell: (value, whether it is inf or NaN); NaN (drawn grey) where nothing was measured."""
    if not _is_num(v):
        return math.nan, False
    if not math.isfinite(v):
        return math.nan, True
    if log:
        return (math.log10(v), False) if v > 0 else (math.nan, False)
    return v, False


def plot_scaling(points: list[dict], weak: list[dict] = ()):
    """tokens/s against devices: the strong-scaling curve (one global batch) and the weak one (one batch per device),
    each against linear scaling from its smallest point, the legend naming the runs each curve holds."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    ticks = set()
    for kind, curve, style in (("strong", points, "o-"), ("weak", weak, "s-")):
        if len(curve) < 2:
            continue
        n = [p["devices"] for p in curve]
        t = [p["tokens_per_s"] for p in curve]
        ticks.update(n)
        line, = ax.plot(n, t, style, label=f"{kind}: {', '.join(p['run'] for p in curve)}")
        ax.plot(n, [t[0] / n[0] * x for x in n], ":", color=line.get_color(), alpha=0.6,
                label=f"{kind}: linear from {n[0]} device(s)")
        for p in curve:
            ax.annotate(f"{p['efficiency']:.0%}", (p["devices"], p["tokens_per_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize="small")
    ax.set(xlabel="devices", ylabel="tokens/s", title="scaling (labels: efficiency against linear)")
    ax.set_xticks(sorted(ticks))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


# -- markdown ---------------------------------------------------------------------------------------

def _scale(summary: dict) -> str:
    """fp16: the loss scale at the end, beside the skipped steps (the scaler skips a step it halves its scale for)."""
    scale = summary.get("final_loss_scale")
    return f" (loss scale {scale:g})" if scale else ""


def _f(v, fmt: str = "{:.4f}", none: str = "-") -> str:
    return fmt.format(v) if _finite(v) else none


def render_markdown(summaries: list[dict], points: list[dict], plots: list[str],
                    note: str | None = None, weak: list[dict] = ()) -> str:
    """report.md: the runs, their step time, memory, checkpoint saves, expert load, scaling and numerics, and the
    plots (a section only where some run has its numbers)."""
    lines = ["# Training report", ""]
    lines += _runs_table(summaries)
    lines += _step_time_table(summaries)
    lines += _memory_table(summaries)
    lines += _checkpoint_table(summaries)
    lines += _expert_load_table(summaries)
    lines += _scaling_table(points, weak, note)
    lines += _numerics_table(summaries)
    bad = [s for s in summaries if s["unreadable_lines"]]
    for s in bad:
        lines.append(f"Note: {s['name']}: {s['unreadable_lines']} unreadable line(s) in metrics.jsonl were skipped.")
    lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def _runs_table(summaries: list[dict]) -> list[str]:
    """One row per run (status, steps, losses, throughput, MFU, skipped steps, restarts), and notes on what its
    numbers stand on."""
    lines = ["| run | model | devices | layout | status | steps | tokens | final loss | best val loss (step) | "
             "final val loss | tokens/s | tokens/s per device | MFU | skipped steps | restarts |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        best = f"{_f(s['best_val_loss'])} ({s['best_val_step']})" if s["best_val_loss"] is not None else "-"
        lines.append(f"| {s['name']} | {s['model']} | {s['world_size']} | {s['layout']} | {s['status']} | "
                     f"{s['steps']} | {_f(s['tokens'], '{:,}')} | "
                     f"{_f(s['final_loss'])} | {best} | {_f(s['final_val_loss'])} | {_f(s['tokens_per_s'], '{:,.0f}')} | "
                     f"{_f(s['tokens_per_s_per_device'], '{:,.0f}')} | {_f(s['mfu'], '{:.2%}')} | "
                     f"{s['skipped_steps']}{_scale(s)} | {s['restarts']} |")
    for s in summaries:
        if s["rolled_back_steps"] or s["abandoned_steps"]:
            lines += ["", f"Note: {s['name']}: the numbers are those of the steps the run stands on; left out: "
                      f"{s['rolled_back_steps']} step(s) undone by a rollback, {s['abandoned_steps']} step(s) a later "
                      "start of the run went back over (restarts, resumes from an older checkpoint)."]
    unfinished = [s for s in summaries if s["status"] != "finished"]
    lines += [""] + [f"Note: {s['name']} is {s['status']}: its numbers are those of the steps it logged."
                     for s in unfinished] + [""] * bool(unfinished)
    lines += ["Throughput and MFU are medians over steps (the first step of the log is left out as warm-up). MFU is "
              "against a datasheet peak or metrics.peak_tflops; `-` where there is none (e.g. on a CPU).", ""]
    return lines


def _step_time_table(summaries: list[dict]) -> list[str]:
    """Each run's step time and its split: compute, data wait, comm wait."""
    lines = ["## Step time", "", "| run | step | compute | data wait | comm wait |", "|---|---:|---:|---:|---:|"]
    for s in summaries:
        t = s["step_time"]
        total = t["step_time_s"]

        def part(key):
            v = t[key]
            return f"{v * 1e3:.2f} ms ({v / total:.0%})" if _finite(v) and total else "-"

        lines.append(f"| {s['name']} | {_f(total and total * 1e3, '{:.2f} ms')} | {part('compute_time_s')} | "
                     f"{part('data_time_s')} | {part('comm_time_s')} |")
    lines += ["", "Comm wait is the explicit loss all-reduce (including waiting for the slowest rank); collectives "
              "inside forward and backward (FSDP, DDP, tensor parallel) overlap compute and are counted as compute.", ""]
    return lines


def _memory_table(summaries: list[dict]) -> list[str]:
    """Each rank's peak memory over the log steps (host RSS, CUDA allocated and reserved, allocator retries, OOMs)."""
    if not any(s["memory"] for s in summaries):
        return []
    lines = ["## Memory per rank (peak over log steps)", "",
             "| run | rank | node | RSS | CUDA allocated | CUDA reserved | allocator retries | OOMs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        for m in s["memory"]:
            mib = lambda k: _f(m.get(k) and m[k] / MIB, "{:,.1f} MiB")  # noqa: E731
            lines.append(f"| {s['name']} | {m['rank']} | {m['node']} | {mib('rss_bytes')} | "
                         f"{mib('cuda_peak_allocated_bytes')} | {mib('cuda_reserved_bytes')} | "
                         f"{m.get('cuda_alloc_retries', '-')} | {m.get('cuda_ooms', '-')} |")
    lines.append("")
    return lines


def _checkpoint_table(summaries: list[dict]) -> list[str]:
    """Each saving run's checkpoint saves: how many, their mean and longest time."""
    if not any(s["checkpoint_saves"] for s in summaries):
        return []
    lines = ["## Checkpoint saves", "", "| run | saves | mean | max |", "|---|---:|---:|---:|"]
    lines += [f"| {s['name']} | {s['checkpoint_saves']} | {_f(s['checkpoint_save_s_mean'], '{:.3f} s')} | "
              f"{_f(s['checkpoint_save_s_max'], '{:.3f} s')} |" for s in summaries if s["checkpoint_saves"]]
    lines.append("")
    return lines


def _expert_load_table(summaries: list[dict]) -> list[str]:
    """Mixture-of-experts runs: the experts' load at the last step, the aux loss and the dropped assignments."""
    if not any(s["moe"] for s in summaries):
        return []
    lines = ["## Expert load (last step; max violation = busiest expert's tokens / mean - 1, 0.00 = balanced)", "",
             "| run | step | max violation (worst layer) | per MoE layer | dropped share per MoE layer | aux loss | "
             "dropped assignments (all steps) |", "|---|---:|---:|---|---|---:|---:|"]
    lines += [f"| {s['name']} | {m['step']} | {_f(m['max_violation'], '{:.2f}')} | "
              f"{', '.join(_f(v, '{:.2f}') for v in m['layer_violation'])} | "
              f"{', '.join(_f(v, '{:.1%}') for v in m['layer_dropped_share'])} | {_f(m['aux_loss'], '{:.3f}')} | "
              f"{m['dropped_tokens']} |" for s in summaries if (m := s["moe"])]
    lines.append("")
    return lines


def _scaling_table(points: list[dict], weak: list[dict], note: str | None) -> list[str]:
    """The strong and weak scaling curves' points with their efficiency, and the line on the runs left out."""
    lines = []
    if len(points) > 1 or len(weak) > 1:
        lines += ["## Scaling", "", "| kind | devices | run | tokens/s | tokens/s per device | efficiency |",
                  "|---|---:|---|---:|---:|---:|"]
        lines += [f"| {kind} | {p['devices']} | {p['run']} | {p['tokens_per_s']:,.0f} | "
                  f"{p['tokens_per_s_per_device']:,.0f} | {p['efficiency']:.0%} |"
                  for kind, curve in (("strong", points), ("weak", weak)) if len(curve) > 1 for p in curve]
        lines += ["", "Efficiency: tokens/s per device against the smallest run of the curve (strong: one global "
                  "batch; weak: one batch per device, the global batch growing with the devices); tokens/s is the "
                  "sweep's own, the median step after its warm-up.", ""]
    if note:
        lines += [note, ""]
    return lines


def _numerics_table(summaries: list[dict]) -> list[str]:
    """The numerics watch of each watched run: its largest activation, least headroom, first non-finite output."""
    if not any(s["numerics"] for s in summaries):
        return []
    lines = ["## Numerics watch", "", "| run | watched steps | largest max abs(activation) | least headroom | "
             "first non-finite output |", "|---|---:|---|---|---|"]
    for s in summaries:
        n = s["numerics"]
        if not n:
            continue
        big, room = n.get("largest_activation"), n.get("least_headroom")
        found = "; ".join(f"step {f['step']}: {f.get('module') or 'none (loss or backward)'}"
                          + (f" on rank {f['rank']}" if f.get("rank") is not None else "") for f in n["nonfinite"])
        lines.append(f"| {s['name']} | {n['watched_steps']} | "
                     + (f"{big['value']:.3g} ({big['row']}, step {big['step']})" if big else "-") + " | "
                     + (f"{room['bits']:.1f} bits of {room['format']} ({room['row']}, step {room['step']})"
                        if room else "-") + f" | {found or '-'} |")
    lines.append("")
    return lines


def write_report(run_dirs: list[str | Path], out: str | Path | None = None, say=None) -> dict:
    """Load the runs, write the plots, report.md and summary.json into `out`; returns {name: path} of the files.
    `say` (e.g. print) gets the line on why runs have no scaling curve, if one is due."""
    runs = [load_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:  # e.g. two runs named "default" in different folders
            r.name = f"{r.path.resolve().parent.name}/{r.path.name}"
    plt = pyplot()
    if out is None:
        out = runs[0].path / "report" if len(runs) == 1 else Path("report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in runs]
    points, weak_points, left_out = scaling_curves(runs, summaries)
    note = scaling_note(len(runs), bool(points or weak_points), left_out)
    if note and say is not None:
        say(note)
    figures = {"loss.png": plot_loss(runs), "throughput.png": plot_throughput(runs)}
    if any(s["memory"] for s in summaries):
        figures["memory.png"] = plot_memory(runs)
    if any(s["moe"] for s in summaries):
        figures["expert_load.png"] = plot_expert_load(runs)
    if any(downstream_series(r) for r in runs):
        figures["downstream.png"] = plot_downstream(runs)
    if len(points) > 1 or len(weak_points) > 1:
        figures["scaling.png"] = plot_scaling(points if len(points) > 1 else [], weak_points)
    for run, s in zip(runs, summaries):
        if s["numerics"] and s["numerics"]["watched_steps"]:
            name = "numerics.png" if len(runs) == 1 else f"numerics-{re.sub(r'[^A-Za-z0-9_.-]', '_', run.name)}.png"
            figures[name] = plot_numerics(run)
    files = {}
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100, metadata={"Software": "paratrain report"})
        plt.close(fig)
        files[name] = out / name
    (out / "report.md").write_text(render_markdown(summaries, points, list(figures), note, weak_points))
    (out / "summary.json").write_text(json.dumps({"runs": summaries, "scaling": points, "weak_scaling": weak_points,
                                                  "scaling_left_out": left_out, "scaling_note": note}, indent=2))
    files["report.md"], files["summary.json"] = out / "report.md", out / "summary.json"
    return files

