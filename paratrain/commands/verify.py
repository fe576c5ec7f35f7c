"""`paratrain verify`: prove parallel layouts match one process (the matrices and runs are paratrain/verify.py's)."""

from __future__ import annotations

import json

from paratrain import verify
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.modes import PRECISIONS, Precision
from paratrain.verify import (CP_MATRIX, DEFAULT_MATRIX, EXACT_CAPABILITY_ROWS, HEADER, LAYOUTS, MEMORY_MATRIX,
                              MODEL_CAPABILITY_MATRIX, MOE_MATRIX, PP_MATRIX, QWEN_MATRIX, RESUMED,
                              check_rows, layout_overrides, run_verify)


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain verify", description=verify.__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(DEFAULT_MATRIX + MOE_MATRIX + PP_MATRIX + CP_MATRIX + QWEN_MATRIX
                                                      + MODEL_CAPABILITY_MATRIX + MEMORY_MATRIX
                                                      + EXACT_CAPABILITY_ROWS + list(RESUMED)),
                        help=f"comma-separated layout names (known: {', '.join([*LAYOUTS, *RESUMED])})")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="non-fp32 runs report differences; the tolerance is only meaningful in fp32")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change the base config of every run, e.g. --set model.tie_embeddings=true")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise UserError("--steps must be >= 1")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    check_rows(layouts, args.steps)  # before any output
    import torch  # lazy: not needed for --help and the argument errors above

    if torch.cuda.is_available() and args.device != "cpu":
        n = torch.cuda.device_count()
        too_big = [name for name in layouts if layout_overrides(name)[0] > n]
        if too_big and args.device == "cuda":
            raise UserError(f"layouts {', '.join(too_big)} need more ranks than the {n} visible GPUs")
    print(HEADER)
    rows, _ = run_verify(layouts, args.steps, args.tolerance, args.precision, [f"training.device={args.device}", *args.set],
                         echo=lambda line: print(line, flush=True))
    failed = [r.layout for r in rows if not r.passed and (not Precision(args.precision).low_precision or r.note)]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)
    return 1 if failed else 0  # low precision: differences are reported, only crashes fail
