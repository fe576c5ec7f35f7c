"""Out-of-memory evidence: at an out-of-memory error, what the allocator held beside what the estimator expected.

Written by every rank that runs out of memory, into RUN_DIR/oom/step-N/ (N: the step that failed, as metrics.jsonl
counts steps), before the trainer halves the micro-batch or gives up:
- rank<r>-snapshot.pickle: the CUDA caching allocator's snapshot (`torch.cuda.memory._snapshot()`: every segment and
  block, with the allocation stacks when memory history is recorded); open it at https://pytorch.org/memory_viz;
- rank<r>.txt: side by side, the memory estimator's breakdown of this layout at the micro-batch that failed (the
  table `paratrain estimate` prints) and the allocator's statistics at the error (`torch.cuda.memory_summary`);
- rank<r>.json: the same numbers for tools (the estimate by category, the allocator's counters, the snapshot's
  segment totals).
On a CPU there is no allocator snapshot: the files hold the estimate and the process's memory.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

from paratrain.errors import UserError
from paratrain.estimate import estimate_for_run


def cuda_snapshot(device) -> dict | None:
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.memory._snapshot(device)


def _allocator(device) -> tuple[dict, str]:
    """The allocator's counters and its printed summary (CUDA), or the process's memory (elsewhere)."""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    import torch

    if device.type == "cuda":
        return dict(torch.cuda.memory_stats(device)), torch.cuda.memory_summary(device)
    import psutil

    rss = psutil.Process().memory_info().rss
    return {"rss_bytes": rss}, (f"not a CUDA device ({device.type}): no allocator snapshot; process RSS "
                                f"{rss / 2**20:.1f} MiB")


def _snapshot_totals(snapshot: dict) -> dict:
    segments = snapshot.get("segments") or []
    return {"segments": len(segments),
            "reserved_bytes": sum(s.get("total_size", 0) for s in segments),
            "allocated_bytes": sum(s.get("allocated_size", 0) for s in segments)}


def write_evidence(run_dir: Path, rank: int, step: int, spec, device, micro_batch: int, accum_steps: int,
                   error: BaseException, snapshot=cuda_snapshot) -> Path:
    """Write this rank's evidence of an out-of-memory error in step index `step`; returns the folder.
    `snapshot(device)`: the allocator's snapshot, or None where there is none."""

    folder = Path(run_dir) / "oom" / f"step-{step + 1}"
    folder.mkdir(parents=True, exist_ok=True)
    taken = snapshot(device)
    stats, summary = _allocator(device)
    at = dataclasses.replace(spec, accum_steps=accum_steps, cfg=dataclasses.replace(
        spec.cfg, training=dataclasses.replace(spec.cfg.training, micro_batch=micro_batch)))
    try:
        estimate = estimate_for_run(at, device=device.type)
        table, breakdown = estimate.format_table(), estimate.to_dict()
    except UserError as e:
        table, breakdown = f"memory estimate unavailable: {e}", None
    record = {"step": step + 1, "rank": rank, "micro_batch": micro_batch, "accum_steps": accum_steps,
              "error": str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__,
              "estimate": breakdown, "allocator": stats}
    if taken is not None:
        with open(folder / f"rank{rank}-snapshot.pickle", "wb") as f:
            pickle.dump(taken, f)  # the format torch's memory_viz reads
        record["snapshot"] = _snapshot_totals(taken)
    (folder / f"rank{rank}.json").write_text(json.dumps(record, indent=1, default=str))
    (folder / f"rank{rank}.txt").write_text(
        f"out of memory on rank {rank} in step {step + 1} at micro-batch {micro_batch} x accumulation {accum_steps}: "
        f"{record['error']}\n\n== the memory estimator for this layout at micro-batch {micro_batch} "
        f"(paratrain estimate) ==\n{table}\n\n== the allocator at the error ==\n{summary}\n"
        + (f"\nsnapshot: {folder / f'rank{rank}-snapshot.pickle'} (https://pytorch.org/memory_viz)\n"
           if taken is not None else ""))
    return folder
