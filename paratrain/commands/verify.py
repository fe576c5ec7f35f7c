"""`paratrain verify`: prove parallel layouts match one process (the matrices and runs are paratrain/verify.py's)."""

from __future__ import annotations

import json
import signal
import threading

from paratrain import verify
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.modes import PRECISIONS, Precision
from paratrain.verify import (CP_MATRIX, DEFAULT_MATRIX, DEFAULT_STEPS, EXACT_CAPABILITY_ROWS, HEADER, LAYOUTS,
                              MEMORY_MATRIX, MODEL_CAPABILITY_MATRIX, MOE_MATRIX, PP_MATRIX, QWEN_MATRIX, RESUMED,
                              Stopped, check_rows, layout_overrides, row_description, run_verify)

SWEEP = (DEFAULT_MATRIX + MOE_MATRIX + PP_MATRIX + CP_MATRIX + QWEN_MATRIX + MODEL_CAPABILITY_MATRIX + MEMORY_MATRIX
         + EXACT_CAPABILITY_ROWS + list(RESUMED))  # what `paratrain verify` runs without --layouts


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain verify", description=verify.__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(SWEEP),
                        help="comma-separated row names (paratrain verify --list: every row, what it runs)")
    parser.add_argument("--list", action="store_true", help="list every row with what it runs, and exit")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps of every row (default: the row's own; {DEFAULT_STEPS} for most)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="loss and weight tolerance (a row with its own, fp8's, takes the larger)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="non-fp32 runs report differences; the tolerance is only meaningful in fp32")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change the base config of every run, e.g. --set model.tie_embeddings=true")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    args = parser.parse_args(argv)
    if args.list:
        print_rows()
        return 0
    if args.steps is not None and args.steps < 1:
        raise UserError("--steps must be >= 1")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    check_rows(layouts, args.steps)  # before any output
    import torch  # lazy: not needed for --help and the argument errors above

    if torch.cuda.is_available() and args.device != "cpu":
        n = torch.cuda.device_count()
        too_big = [name for name in layouts if layout_overrides(name)[0] > n]
        if too_big and args.device == "cuda":
            raise UserError(f"layouts {', '.join(too_big)} need more ranks than the {n} visible GPUs")
    print(HEADER, flush=True)
    low_precision = Precision(args.precision).low_precision
    try:
        rows, _ = stoppable(lambda stopped: run_verify(
            layouts, args.steps, args.tolerance, args.precision, [f"training.device={args.device}", *args.set],
            echo=lambda line: print(line, flush=True), stopped=stopped))
        code = 0
    except Stopped as e:
        rows, code = e.rows, 128 + e.signum  # the shell's codes: 130 for SIGINT, 143 for SIGTERM
    failed = [r.layout for r in rows if not r.passed and (not low_precision or r.note)]
    summary = f"{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "")
    if code:
        print(f"interrupted ({signal.Signals(code - 128).name}) after {len(rows)} of {len(layouts)} rows: {summary}; "
              f"the other rows did not run", flush=True)
    else:
        print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)
    return code or (1 if failed else 0)  # low precision: differences are reported, only crashes fail


def print_rows() -> None:
    """Every row, one line each: its name, ranks, layout name and settings, steps and tolerances; `*`: in the sweep
    `paratrain verify` runs without --layouts."""
    names = [*LAYOUTS, *RESUMED]
    width = max(map(len, names))
    print(f"{len(names)} rows; *: run by `paratrain verify` without --layouts")
    print("(resume-A:B: row A trains with a checkpoint at half its steps, then resumes from it on layout B)")
    for name in names:
        print(f"{'*' if name in SWEEP else ' '} {name:<{width}}  {row_description(name)}")


def stoppable(work):
    """work(stopped) in a worker thread while this, the main thread, owns SIGINT and SIGTERM (the trainer's and the
    launcher's own handlers are the main thread's only, so none is installed under it): `stopped()` is the first such
    signal, or None. Once one arrives, the training running now stops at its next step and every rank process is
    killed (again until the work ends: a rank forked meanwhile too), so the work reaches its next check (Stopped)
    within a step. Returns what work returns; raises what it raises."""
    # lazy: torch-free callers (--list, --help) need neither the launcher nor the trainer
    from paratrain.distributed.launch import rank_processes
    from paratrain.training.preemption import active_watch

    first: list[int] = []
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = work(lambda: first[0] if first else None)
        except (Exception, KeyboardInterrupt) as e:  # (Stopped among them) raised again by the main thread
            outcome["error"] = e

    # (a plain thread, not concurrent.futures': processes forked from it, a forkserver, must not join it at exit)
    worker = threading.Thread(target=run, name="paratrain-verify", daemon=True)
    previous = {s: signal.signal(s, lambda signum, frame: first.append(signum)) for s in (signal.SIGINT,
                                                                                            signal.SIGTERM)}
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.1)
            if first:
                watch = active_watch()
                if watch is not None and not watch.interrupted:
                    watch.interrupt()
                for proc in rank_processes():
                    try:
                        proc.kill()
                    except Exception:  # noqa: BLE001 - it exited meanwhile
                        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
