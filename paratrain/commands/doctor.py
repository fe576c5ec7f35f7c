"""`paratrain doctor`: check the environment (torch, CUDA, NCCL, interconnect, disk, a collective test), or with
`--hang RUN_DIR` read a run's collective histories (the checks are paratrain/observe/doctor.py's)."""

from __future__ import annotations

import os
from pathlib import Path

from paratrain.distributed.launch import inside_launcher
from paratrain.errors import OneLineArgumentParser, UserError
from paratrain.observe.doctor import run_checks
from paratrain.preflight import check_nproc


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain doctor", description="Check the environment for training.")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local ranks for the all-reduce test (default: the number of GPUs, or 2 on CPU; 0 skips); under "
                        "torchrun the test is the job's ranks on every node")
    parser.add_argument("--checkpoint-dir", default="runs", help="where checkpoints will go (default: runs)")
    parser.add_argument("--oversubscribe", action="store_true", help="allow more CPU ranks than paratrain train does")
    parser.add_argument("--hang", metavar="RUN_DIR", help="read the run's collective histories (RUN_DIR/hang, written "
                        "at a collective timeout): which rank is behind, at which collective")
    args = parser.parse_args(argv)
    if args.hang is not None:
        from paratrain.observe.hang import diagnose  # lazy: it imports torch, which --help and the checks load later

        print("\n".join(diagnose(Path(args.hang))))
        return 0
    if args.nproc is not None and args.nproc < 0:
        raise UserError("--nproc must be >= 0")
    # Under torchrun (`torchrun --nnodes N --nproc-per-node K -m paratrain doctor`) this process is one rank of the
    # job: the all-reduce test spans every node, and each node's first rank prints that node's report.
    under_agents = inside_launcher()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if under_agents and args.nproc is not None and args.nproc != local_world:
        raise UserError(f"--nproc {args.nproc} under torchrun, which started {local_world} rank(s) per node: the "
                        "job's ranks are torchrun's (--nproc-per-node); drop --nproc")
    if args.nproc and not under_agents:
        check_nproc("auto", args.nproc, args.oversubscribe)
    if os.path.isfile(args.checkpoint_dir):
        raise UserError(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a folder")
    reporter = not under_agents or os.environ.get("LOCAL_RANK", "0") == "0"
    if reporter:
        print("paratrain doctor", flush=True)
    results = []
    for r in run_checks(args.nproc, args.checkpoint_dir):
        if reporter or r.status == "FAIL":
            print(r.line(), flush=True)
        results.append(r)
    fails = sum(r.status == "FAIL" for r in results)
    warns = sum(r.status == "WARN" for r in results)
    verdict = ("ready to train" if not fails and not warns else
               "ready to train, with warnings" if not fails else "not ready: fix the FAIL lines")
    if reporter:
        print(f"{fails} FAIL, {warns} WARN: {verdict}", flush=True)
    return 1 if fails else 0
