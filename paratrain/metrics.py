"""One metrics path: each step's numbers go to the JSONL log and the progress display (rank 0 only)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path | None, total_steps: int, start_step: int, mode: str = "auto", enabled: bool = True):
        self.enabled = enabled
        self.file = open(path, "a") if (path is not None and enabled) else None
        self.total = total_steps
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.progress = None
        if self.mode == "bar":
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict, show: bool = True) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if not show:
            return
        text = format_record(record)
        if self.progress is not None:
            self.progress.update(self.task, completed=record.get("step", 0), info=text)
        elif self.mode == "lines":
            print(text, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file:
            self.file.close()


def format_record(r: dict) -> str:
    parts = [f"step {r['step']:>5}"] if "step" in r else []
    for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"), ("lr", "lr {:.2e}"),
                     ("grad_norm", "gnorm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"), ("mfu", "mfu {:.1%}")):
        if r.get(key) is not None:
            parts.append(fmt.format(r[key]))
    return " | ".join(parts)
