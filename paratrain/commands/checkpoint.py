"""`paratrain checkpoint verify PATH [PATH ...]`: check checkpoints the way `resume=auto` does, and say what is wrong.

Exit code 0 when every checkpoint checked is OK, 1 when one is not, 2 when PATH holds no checkpoint at all
(paratrain/training/checkpoint_check.py checks them).
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import OneLineArgumentParser


def main(argv: list[str]) -> int:
    p = OneLineArgumentParser(prog="paratrain checkpoint", description="Check checkpoints.")
    sub = p.add_subparsers(dest="action", required=True, parser_class=OneLineArgumentParser)
    v = sub.add_parser("verify", help="check checkpoints against their checksums")
    v.add_argument("paths", nargs="+", metavar="PATH", help="a step-N folder, a run folder or a checkpoints folder")
    a = p.parse_args(argv)
    from paratrain.training.checkpoint_check import verify  # lazy: torch is not needed for --help and bad arguments

    ok = True
    for path in a.paths:
        ok = verify(Path(path)) and ok
    return 0 if ok else 1
