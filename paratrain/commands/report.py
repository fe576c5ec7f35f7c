"""`paratrain report`: plots and a markdown summary of finished runs (paratrain/observe/report.py draws them)."""

from __future__ import annotations

from paratrain.errors import OneLineArgumentParser
from paratrain.observe.report import write_report


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain report",
                                     description="Plots and a markdown summary of finished runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (runs/<name>) holding metrics.jsonl")
    parser.add_argument("--out", default=None,
                        help="output folder (default: RUN_DIR/report for one run, ./report for several)")
    args = parser.parse_args(argv)
    files = write_report(args.runs, args.out)
    for name, path in files.items():
        print(f"wrote {path}")
    return 0
