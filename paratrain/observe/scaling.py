"""A scaling sweep: the same training on several world sizes (or layouts), timed, beside the planner's prediction.

Weak scaling keeps each data-parallel rank's batch (the global batch grows with the ranks); strong scaling keeps the
global batch (each rank's share shrinks). Both are read the same way from the measured throughput T(n) on n ranks,
against the smallest point n0: efficiency = (T(n) / n) / (T(n0) / n0), i.e. for weak scaling the step time of n0
over that of n (the work per rank is the same), for strong scaling the speed-up over n / n0. Every point's step
time is the median after its warm-up steps, from its metrics.jsonl (`paratrain scaling` runs the points,
paratrain/commands/scaling.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from paratrain.errors import UserError
from paratrain.observe.metrics import in_effect

SPLIT = ("compute_time_s", "comm_time_s", "data_time_s")  # the step time's parts, as each record splits it


@dataclass
class Point:
    """One measured point of the sweep."""

    label: str  # the point's name: its layout on its ranks (`fsdp 4`, `ddp2`)
    ranks: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    step_s: float  # median after the warm-up
    compute_s: float
    comm_s: float  # exposed: what the step waited for communication
    data_s: float
    predicted_step_s: float | None = None  # the planner's, on the sweep's hardware profile
    efficiency: float = 1.0  # against the smallest point (see the module's docstring)
    run: str = ""  # the point's run folder, inside the sweep's (`paratrain report` draws a sweep's runs only)

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq_len / self.step_s

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def predicted_tokens_per_s(self) -> float | None:
        return None if self.predicted_step_s is None else self.global_batch * self.seq_len / self.predicted_step_s


def measure(run_dir: Path, warmup: int) -> dict:
    """The median step time and its split over the steps after `warmup`, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in in_effect(records)[0] if "step_time_s" in r and r["step"] > warmup]
    if not steps:
        raise UserError(f"{run_dir}: no timed step after the {warmup} warm-up steps (give more --steps)")
    return {"step_s": statistics.median(r["step_time_s"] for r in steps),
            **{key.removesuffix("_time_s") + "_s": statistics.median(r.get(key, 0.0) for r in steps) for key in SPLIT}}


def with_efficiency(points: list[Point]) -> list[Point]:
    """The points sorted by ranks, each with its efficiency against the smallest."""
    points = sorted(points, key=lambda p: p.ranks)
    base = points[0].tokens_per_s / points[0].ranks
    for p in points:
        p.efficiency = p.tokens_per_s / p.ranks / base
    return points


def table(points: list[Point], kind: str) -> str:
    """The sweep as a markdown table."""
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    lines = [f"| ranks | layout | global batch | step | compute | exposed comm | data | tokens/s | samples/s | "
             f"{kind} efficiency | predicted step | predicted tokens/s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        predicted = "-" if p.predicted_tokens_per_s is None else f"{p.predicted_tokens_per_s:,.0f}"
        lines.append(f"| {p.ranks} | {p.label} | {p.global_batch} | {ms(p.step_s)} | {ms(p.compute_s)} | "
                     f"{ms(p.comm_s)} | {ms(p.data_s)} | {p.tokens_per_s:,.0f} | {p.samples_per_s:,.1f} | "
                     f"{p.efficiency:.0%} | {ms(p.predicted_step_s)} | {predicted} |")
    return "\n".join(lines)


def plot(points: list[Point], kind: str, title: str):
    """tokens/s against ranks (measured, predicted, linear from the smallest point) and the efficiency."""
    # lazy: matplotlib (~0.5 s) only when a plot is drawn
    from paratrain.observe.report import pyplot

    plt = pyplot()
    fig, (ax, eff) = plt.subplots(1, 2, figsize=(11, 4.5))
    n = [p.ranks for p in points]
    ax.plot(n, [p.tokens_per_s for p in points], "o-", label="measured")
    if all(p.predicted_tokens_per_s is not None for p in points):
        ax.plot(n, [p.predicted_tokens_per_s for p in points], "s--", label="predicted (planner)")
    ax.plot(n, [points[0].tokens_per_s / n[0] * x for x in n], "k:", alpha=0.6, label=f"linear from {n[0]} rank(s)")
    for p in points:
        ax.annotate(p.label, (p.ranks, p.tokens_per_s), textcoords="offset points", xytext=(4, 4), fontsize="small")
    ax.set(xlabel="ranks", ylabel="tokens/s", title=f"{kind} scaling: throughput")
    eff.plot(n, [p.efficiency for p in points], "o-")
    eff.axhline(1.0, color="k", linestyle=":", alpha=0.6)
    eff.set(xlabel="ranks", ylabel="efficiency", title=f"{kind} scaling efficiency (1 = linear)", ylim=(0, None))
    for a in (ax, eff):
        a.set_xticks(n)
        a.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    return fig


def write(points: list[Point], kind: str, title: str, out: Path) -> dict[str, Path]:
    """scaling.md, scaling.json and scaling.png in `out`."""
    files = {"scaling.md": out / "scaling.md", "scaling.json": out / "scaling.json", "scaling.png": out / "scaling.png"}
    files["scaling.md"].write_text(f"# {kind.capitalize()} scaling\n\n{title}\n\n{table(points, kind)}\n\n"
                                   "Efficiency: tokens/s per rank against the smallest point; the step time is the "
                                   "median after the warm-up steps.\n\n![scaling](scaling.png)\n")
    files["scaling.json"].write_text(json.dumps({"kind": kind, "title": title, "points": [
        {**asdict(p), "tokens_per_s": p.tokens_per_s, "samples_per_s": p.samples_per_s,
         "predicted_tokens_per_s": p.predicted_tokens_per_s} for p in points]}, indent=2))
    fig = plot(points, kind, title)
    fig.savefig(files["scaling.png"], dpi=110)
    return files
