"""`paratrain report`: plots and a markdown summary of finished runs (paratrain/observe/report.py draws them)."""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import OneLineArgumentParser
from paratrain.observe.report import write_report
from paratrain.runlock import refuse_if_live


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain report",
                                     description="Plots and a markdown summary of finished runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (runs/<name>) holding metrics.jsonl")
    parser.add_argument("--out", default=None,
                        help="output folder (default: RUN_DIR/report for one run, ./report for several)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report" if len(args.runs) == 1 else Path("report")
    refuse_if_live(out, "paratrain report (give --out a folder outside the run to report on a live run)")
    files = write_report(args.runs, out, say=print)
    for name, path in files.items():
        print(f"wrote {path}")
    return 0
