"""Profiling training steps: `paratrain profile`, and `metrics.profile_steps` in any run.

A window of steps (`metrics.profile_start`, counted from the run's first step, and `metrics.profile_steps`) runs under
`torch.profiler`; each step is one `paratrain.step#N` range. At the end of the window every rank writes its
Chrome/Perfetto trace to RUN_DIR/profile/rank<r>.json (open it in https://ui.perfetto.dev or chrome://tracing), the
trace is read back and split per step, rank 0 prints one line per rank and writes RUN_DIR/profile/summary.json.

What is measured, from the trace's intervals, within each step's range:
  compute        the union of the intervals of operators doing work: on a CPU the `aten::` (and FSDP's copy)
                 operators of every thread but the communication threads; on a GPU the kernels and copies that are
                 not NCCL kernels
  communication  the union of the collectives' own intervals: NCCL kernels on a GPU; on a CPU gloo's `gloo:*` ranges
                 (it runs collectives on its own threads) and the calling thread's time in `c10d::` operators
                 (issuing collectives, and FSDP's `_c10d_functional::wait_tensor`)
  exposed        communication minus compute: time in collectives while nothing computes, i.e. the step waits for
                 the network (the part overlap did not hide)
so compute + exposed <= the step, and the rest is Python, the data loader and idleness. While a step is profiled its
metrics record takes `comm_time_s` (= exposed) and `comm_total_s` from this measurement, and `compute_time_s` is the
rest of the step as always; the records of the window are logged when the window's trace has been read.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

STEP_PREFIX = "paratrain.step#"
# Kineto, the profiler's C++ side, writes a probe marker to stderr at each start and stop of a trace
# ("USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start"), on every rank: for tracing tools, nothing for the
# person profiling. KINETO_LOG_LEVEL cannot drop them without its errors (the markers are its highest level).
USDT_MARKER = "USDT:"


@contextlib.contextmanager
def without_usdt_markers():
    """Stderr (the file descriptor, where C++ writes) held aside while the profiler starts or stops, and written
    back without Kineto's USDT markers: its other lines, warnings and errors, still show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(USDT_MARKER))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


# -- reading a trace ---------------------------------------------------------------------------------------------

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a_list, b_list) -> list[tuple[float, float]]:
    """Parts of the (merged) intervals a_list not covered by the (merged) intervals b_list."""
    out, j = [], 0
    for a, b in a_list:
        start = a
        while j < len(b_list) and b_list[j][1] <= start:
            j += 1
        k = j
        while k < len(b_list) and b_list[k][0] < b:
            if b_list[k][0] > start:
                out.append((start, b_list[k][0]))
            start = max(start, b_list[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _is_comm(e: dict, on_gpu: bool = False) -> bool:
    """A collective's own interval: an NCCL kernel; on a CPU, gloo's range on its worker thread or the calling
    thread's time inside a c10d operator (issuing, and on a busy CPU waiting for the worker)."""
    name, cat = e.get("name", ""), e.get("cat")
    if cat == "kernel":
        return name.lower().startswith("nccl")
    if on_gpu:
        return False
    return (cat == "user_annotation" and name.startswith(("gloo:", "nccl:"))) or (cat == "cpu_op" and name.startswith(
        ("c10d::", "_c10d_functional::")))


def classify(events: list[dict]) -> tuple[list, list, list]:
    """(step ranges [(name, start, end)], compute intervals, communication intervals) of a trace's complete events
    (times in microseconds)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_gpu = any(e.get("cat") == "kernel" for e in complete)
    comm_threads = {(e.get("pid"), e.get("tid")) for e in complete
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("gloo:")}
    steps, compute, comm = [], [], []
    for e in complete:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        name, cat = e.get("name", ""), e.get("cat")
        if name.startswith(STEP_PREFIX):
            steps.append((name, start, end))
        elif _is_comm(e, on_gpu):
            comm.append((start, end))
        elif on_gpu:
            if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
                compute.append((start, end))
        elif cat == "cpu_op" and name.startswith(("aten::", "fsdp::")) and (e.get("pid"), e.get("tid")) not in comm_threads:
            compute.append((start, end))
    steps.sort(key=lambda s: s[1])
    return steps, _union(compute), _union(comm)


def split_steps(events: list[dict]) -> list[dict]:
    """Per profiled step: seconds of step, compute, communication, exposed communication, and fractions of the step."""
    steps, compute, comm = classify(events)
    out = []
    for name, lo, hi in steps:
        c, m = _clip(compute, lo, hi), _clip(comm, lo, hi)
        step = (hi - lo) / 1e6
        comp, total, exposed = _length(c) / 1e6, _length(m) / 1e6, _length(_minus(m, c)) / 1e6
        frac = (lambda x: min(1.0, x / step) if step > 0 else 0.0)
        out.append({"step": int(name[len(STEP_PREFIX):]), "step_s": step, "compute_s": comp, "comm_s": total,
                    "exposed_comm_s": exposed, "compute_fraction": frac(comp), "comm_fraction": frac(total),
                    "exposed_comm_fraction": frac(exposed),
                    "overlapped_fraction": (total - exposed) / total if total > 0 else 0.0})
    return out


def top_operators(events: list[dict], n: int = 8) -> list[tuple[str, float]]:
    """Operators by self time (seconds, summed over the trace): their own duration less that of the operators nested in
    them on the same thread (on a GPU: kernels by their time)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    totals: dict[str, float] = {}
    if any(e.get("cat") == "kernel" for e in complete):
        for e in complete:
            if e.get("cat") == "kernel":
                totals[e["name"]] = totals.get(e["name"], 0.0) + float(e["dur"])
    else:
        by_thread: dict = {}
        for e in complete:
            if e.get("cat") == "cpu_op":
                by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)

        def close(entry):
            _, name, dur, child = entry
            totals[name] = totals.get(name, 0.0) + max(0.0, dur - child)

        for ops in by_thread.values():
            ops.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
            stack: list[list] = []  # [end, name, duration, time of the operators inside]
            for e in ops:
                start, dur = float(e["ts"]), float(e["dur"])
                while stack and stack[-1][0] <= start:
                    close(stack.pop())
                if stack:
                    stack[-1][3] += dur
                stack.append([start + dur, e["name"], dur, 0.0])
            while stack:
                close(stack.pop())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [(name, us / 1e6) for name, us in ranked]


def summarize(trace_path: Path) -> dict:
    """A rank's trace -> its per-step split, the means over the window, and its top operators."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    steps = split_steps(events)
    mean = {}
    for key in ("step_s", "compute_s", "comm_s", "exposed_comm_s"):
        mean[key] = sum(s[key] for s in steps) / len(steps) if steps else 0.0
    total = sum(s["step_s"] for s in steps)
    for key in ("compute", "comm", "exposed_comm"):
        mean[f"{key}_fraction"] = sum(s[f"{key}_s"] for s in steps) / total if total else 0.0
    comm = sum(s["comm_s"] for s in steps)
    mean["overlapped_fraction"] = (comm - sum(s["exposed_comm_s"] for s in steps)) / comm if comm else 0.0
    return {"trace": str(trace_path), "steps": steps, "mean": mean, "top_operators": top_operators(events)}


def format_summary(rows: list[dict], window: str) -> str:
    """The table `paratrain profile` prints: one line per rank, then each rank's top operators."""
    lines = [f"profile of {window}, per rank (mean per step; traces: {Path(rows[0]['trace']).parent}/rank<r>.json, "
             "open in https://ui.perfetto.dev)",
             f"  {'rank':>4} {'step ms':>9} {'compute ms':>11} {'comm ms':>9} {'exposed comm ms':>16} "
             f"{'compute %':>10} {'exposed %':>10} {'overlapped %':>13}"]
    for r in rows:
        m = r["mean"]
        lines.append(f"  {r['rank']:>4} {m['step_s'] * 1e3:>9.2f} {m['compute_s'] * 1e3:>11.2f} {m['comm_s'] * 1e3:>9.2f} "
                     f"{m['exposed_comm_s'] * 1e3:>16.2f} {m['compute_fraction']:>10.1%} "
                     f"{m['exposed_comm_fraction']:>10.1%} {m['overlapped_fraction']:>13.1%}")
    for r in rows:
        ops = ", ".join(f"{name} {sec * 1e3:.1f} ms" for name, sec in r["top_operators"][:6])
        lines.append(f"  top operators, rank {r['rank']} (self time over the window): {ops}")
    return "\n".join(lines)


# -- profiling a run's steps --------------------------------------------------------------------------------------

class StepProfiler:
    """Runs `steps` steps from the `start`-th step of this run under torch.profiler (see the module docstring).

    `begin()` at the top of each step, `end()` when the step's record is built; `hold(record, show, index)` returns
    the records that can be logged now (those of the window wait until its trace has been read). `index` is the
    step's `count` (steps begun in this run) when it ran: the trainer hands records over at settle points, several
    at a time and after later steps have begun, so a record is matched to its traced step by it."""

    def __init__(self, run_dir: Path, rank: int, world: int, start: int, steps: int, device, message, gather):
        self.dir, self.rank, self.world = Path(run_dir) / "profile", rank, world
        self.first, self.last = start, start + steps - 1
        self.device, self.message, self.gather = device, message, gather
        self.count = -1  # steps begun in this run
        self.prof = self.range = None
        self.held: list[tuple[dict, bool, int]] = []
        self.summary: dict | None = None

    @property
    def active(self) -> bool:
        return self.prof is not None

    def begin(self) -> None:
        # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
        import torch

        self.end()  # a step abandoned half-way (a rollback) closes its range
        self.count += 1
        if self.count == self.first and self.summary is None:
            # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities)
            with without_usdt_markers():
                self.prof.start()
        if self.active:
            self.range = torch.autograd.profiler.record_function(f"{STEP_PREFIX}{self.count}")
            self.range.__enter__()

    def end(self) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None

    @property
    def closing(self) -> bool:
        """The window's last step has run (a settle point follows, so its trace is read right after it)."""
        return self.active and self.count >= self.last

    def hold(self, record: dict, show: bool, index: int | None = None) -> list[tuple[dict, bool]]:
        index = self.count if index is None else index
        if not self.active or index < self.first:  # outside the window (before it, or after it was written)
            return [(record, show)]
        self.held.append((record, show, index))
        return self.finish() if index >= self.last else []

    def finish(self) -> list[tuple[dict, bool]]:
        """Stop, write and read this rank's trace, print every rank's summary; returns the held records."""
        if not self.active:
            return []
        self.end()
        with without_usdt_markers():
            self.prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.json"
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        mine = {"rank": self.rank, **summarize(path)}
        by_step = {s["step"]: s for s in mine["steps"]}
        first = self.held[0][2] if self.held else self.first
        last = self.held[-1][2] if self.held else self.count
        for record, _, index in self.held:
            split = by_step.get(index)
            if split is not None:  # the profiler's measurement replaces the timer's for this step
                record.update(comm_time_s=split["exposed_comm_s"], comm_total_s=split["comm_s"],
                              compute_time_s=max(0.0, record["step_time_s"] - record.get("data_time_s", 0.0)
                                                 - split["exposed_comm_s"]),
                              comm_exposed_fraction=split["exposed_comm_fraction"], comm_measured_by="profiler")
        rows = self.gather(mine)
        self.summary = {"window": {"first_step": first, "steps": len(self.held)}, "ranks": rows}
        if self.rank == 0:
            window = f"steps {first}-{last} of this run" if last > first else f"step {first} of this run"
            (self.dir / "summary.json").write_text(json.dumps(self.summary, indent=1))
            self.message(format_summary(rows, window))
        held, self.held = [(record, show) for record, show, _ in self.held], []
        return held


def gather_rows(mine: dict) -> list[dict]:
    """Every rank's summary on every rank (one all_gather_object), in rank order."""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return rows

