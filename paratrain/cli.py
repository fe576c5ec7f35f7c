"""`paratrain <command>`: dispatch to paratrain/commands/<command>.py; every command's errors become one `error:` line
and its exit code."""

from __future__ import annotations

import importlib
import sys

from paratrain import __version__
from paratrain.errors import UserError, did_you_mean, environment_error, translated

COMMANDS = ("train", "profile", "prepare", "generate", "verify", "estimate", "plan", "report", "doctor", "export",
            "checkpoint", "replay", "scaling", "eval")


# command -> the module that holds its arguments, usage and call into the library (`main(argv) -> int`), imported
# only when that command runs: `paratrain --help` and a mistyped command stay fast.
# (Written out: tests/test_architecture.py reads these names as imports.)
COMMAND_MODULES = {
    "train": "paratrain.commands.train",
    "profile": "paratrain.commands.profile",
    "prepare": "paratrain.commands.prepare",
    "generate": "paratrain.commands.generate",
    "verify": "paratrain.commands.verify",
    "estimate": "paratrain.commands.estimate",
    "plan": "paratrain.commands.plan",
    "report": "paratrain.commands.report",
    "doctor": "paratrain.commands.doctor",
    "export": "paratrain.commands.export",
    "checkpoint": "paratrain.commands.checkpoint",
    "replay": "paratrain.commands.replay",
    "scaling": "paratrain.commands.scaling",
    "eval": "paratrain.commands.eval",
}


USAGE = """usage: paratrain <command> [options]    (paratrain --version: the version)

commands:
  train      train a model: paratrain train [--config FILE.toml] [--nproc N] [--oversubscribe] [--section.key=value ...]
  profile    a few steps under torch.profiler: paratrain profile [train options] [--steps 3] [--warmup 1]
  prepare    tokenize a corpus into token shards: paratrain prepare --input PATH|'GLOB' --out DIR [--tokenizer char] [--workers N]
  generate   sample from a checkpoint: paratrain generate --checkpoint DIR --prompt "..." [--max-new-tokens N]
  verify     prove parallel layouts match one process: paratrain verify [--layouts ddp2,fsdp2,...] [--steps 20]
  estimate   memory per rank before launch: paratrain estimate --model llama3-8b --gpu H100 [layout options]
  plan       rank parallel layouts by predicted speed: paratrain plan --model llama3-8b --gpus 8 --gpu H100
  report     plots and a summary of finished runs: paratrain report RUN_DIR [RUN_DIR ...]
  doctor     check the environment (torch, CUDA, NCCL, interconnect, disk, a collective test)
  export     a checkpoint as a Hugging Face model: paratrain export RUN_DIR --format hf --out DIR [--dtype bf16]
  checkpoint check checkpoints against their checksums: paratrain checkpoint verify RUN_DIR|step-N [...]
  replay     run step N of a run again with the numerics watch: paratrain replay RUN_DIR step-N [--nproc N]
  scaling    a timed weak or strong scaling sweep: paratrain scaling --weak --nproc 1,2,4 [--layout fsdp]
  eval       downstream tasks (lm-eval) on a checkpoint: paratrain eval RUN_DIR|hf:DIR --tasks T1,T2 [--nproc N]
"""


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (not a call from Python): after a preemption, end without the teardown
        code = _main(sys.argv[1:])
        if getattr(_RAN, "LEAVE_PROMPTLY", False):  # the command says so (paratrain/commands/train.py)
            from paratrain.api import exit_now  # lazy: torch is not needed for --help

            exit_now(code)
        if getattr(_RAN, "OBJECTS_LIVE_TO_EXIT", False):  # the command says so (paratrain/commands/plan.py)
            import gc

            gc.freeze()  # (the interpreter's exit does not collect frozen objects: no pass over them all)
        return code
    return _main(argv)


_RAN = None  # the command module that ran last


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"paratrain {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMAND_MODULES:
        print(f"error: unknown command '{command}'{did_you_mean(command, COMMANDS)}", file=sys.stderr)
        return 2
    global _RAN
    try:
        with translated(environment_error):  # a full disk, a read-only or missing folder: one line, not a bug
            _RAN = importlib.import_module(COMMAND_MODULES[command])
            return _RAN.main(rest) or 0
    except UserError as e:
        if str(e):
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output went to a pipe that closed (`paratrain train --help | head`)
        import os  # lazy: only a closed pipe needs it

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
