"""`paratrain <command>`: argument parsing and dispatch; every command's errors become one `error:` line."""

from __future__ import annotations

import argparse
import sys

from paratrain.errors import UserError, environment_error, translated

COMMANDS = ("train", "profile", "prepare", "generate", "verify", "estimate", "plan", "report", "doctor", "export",
            "checkpoint", "replay")


def split_overrides(argv: list[str], flags_with_value: set[str]) -> tuple[dict, list[str]]:
    """Our own flags (e.g. --config F) vs `--section.key=value` config overrides (also `--section.key value`)."""
    own, overrides, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, has_eq, value = arg.partition("=")
        if name in flags_with_value:
            if not has_eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            own[name] = value
        elif arg.startswith("--") and "." in name:
            if not has_eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            overrides.append(f"{name[2:]}={value}")
        else:
            raise UserError(f"unexpected argument '{arg}' (config overrides look like --section.key=value)")
        i += 1
    return own, overrides


def _int_flag(own: dict, name: str, default: int) -> int:
    try:
        value = int(own.get(name, default))
    except ValueError:
        raise UserError(f"{name} must be an integer, got {own[name]!r}") from None
    if value < 0:
        raise UserError(f"{name} must be >= 0")
    return value


def cmd_train(argv: list[str]) -> int:
    from paratrain.api import train
    from paratrain.config import load_config

    if argv and argv[0] in ("-h", "--help"):
        from paratrain.config import config_keys_help

        print(TRAIN_USAGE + config_keys_help())
        return 0
    oversubscribe = "--oversubscribe" in argv  # more CPU ranks than paratrain.preflight allows by default
    dry_run = "--dry-run" in argv  # build the layout of --world N ranks here, without training
    own, overrides = split_overrides([a for a in argv if a not in ("--oversubscribe", "--dry-run")],
                                     {"--config", "--nproc", "--max-restarts", "--world"})
    if "--max-restarts" in own:
        overrides.append(f"resilience.max_restarts={_int_flag(own, '--max-restarts', 0)}")
    if "--world" in own and not dry_run:
        raise UserError("--world is the world size of --dry-run; training takes its ranks from --nproc or the launcher")
    cfg = load_config(own.get("--config"), overrides)
    if dry_run:
        from paratrain.observe.dryrun import main_dry_run

        return main_dry_run(cfg, _int_flag(own, "--world", _int_flag(own, "--nproc", 1)))
    global _LEAVE_PROMPTLY
    try:
        result = train(cfg, nproc=_int_flag(own, "--nproc", 1), oversubscribe=oversubscribe)
    except UserError:
        _LEAVE_PROMPTLY = _int_flag(own, "--nproc", 1) > 1  # launched ranks failed: the job ends now (see main)
        raise
    if result is None or getattr(result, "preempted", False):
        _LEAVE_PROMPTLY = True  # a scheduler is waiting for this process to end (see main)
    return 0


_LEAVE_PROMPTLY = False

TRAIN_USAGE = """usage: paratrain train [--config FILE.toml] [--nproc N] [--oversubscribe] [--max-restarts N] [--section.key=value ...]
       paratrain train --dry-run --world N [--config FILE.toml] [--section.key=value ...]

  --config FILE.toml   a config file (e.g. a run's config.toml, or plan/config.toml); overrides win over it
  --nproc N            start N local ranks (one per GPU; on CPU gloo ranks)
  --oversubscribe      allow more CPU ranks than the machine's cores comfortably run
  --max-restarts N     relaunch failed ranks from the newest checkpoint up to N times
  --dry-run --world N  build the real layout of N ranks here (fake process group, meta device), one rank per
                       pipeline stage, and print their model-state bytes beside the estimator's; no training

Examples: paratrain train --nproc 4 --parallel.tp=2;  paratrain train --checkpoint.resume=auto

config keys (section.key=default):
"""


def cmd_profile(argv: list[str]) -> int:
    """A few training steps under torch.profiler: traces per rank and the compute / communication split."""
    from paratrain.api import train
    from paratrain.config import load_config
    from paratrain.observe.profile import USAGE, profile_overrides

    if argv and argv[0] in ("-h", "--help"):
        print("usage: " + USAGE)
        return 0
    oversubscribe = "--oversubscribe" in argv
    own, overrides = split_overrides([a for a in argv if a != "--oversubscribe"],
                                     {"--config", "--nproc", "--steps", "--warmup"})
    steps, warmup = _int_flag(own, "--steps", 3), _int_flag(own, "--warmup", 1)
    if steps < 1:
        raise UserError("--steps must be >= 1")
    cfg = load_config(own.get("--config"), profile_overrides(steps, warmup, overrides))
    if not any(o.startswith("run.name=") for o in overrides) and not any(cfg.run_dir.glob("checkpoints/*")):
        cfg.run.overwrite = True  # the default runs/profile holds an earlier profile (no checkpoints): replace it
    train(cfg, nproc=_int_flag(own, "--nproc", 1), oversubscribe=oversubscribe)
    print(f"traces: {cfg.run_dir / 'profile'}/rank<r>.json (https://ui.perfetto.dev); summary: "
          f"{cfg.run_dir / 'profile' / 'summary.json'}")
    return 0


MAX_NEW_TOKENS = 1_000_000


def cmd_generate(argv: list[str]) -> int:
    from paratrain.errors import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="paratrain generate")
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder, or a run folder (newest checkpoint)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens and --top-k must be >= 0")
    if args.max_new_tokens > MAX_NEW_TOKENS:  # every token is one forward over the context, and kept in memory
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is more than {MAX_NEW_TOKENS} (a typo?)")
    if args.temperature < 0:  # NaN and infinity are refused by the parser
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    from paratrain.inference import load_for_generation
    from paratrain.generate import prompt_ids, sample

    model, tokenizer, _, context = load_for_generation(args.checkpoint)
    ids = prompt_ids(tokenizer, args.prompt)
    out = sample(model, ids, args.max_new_tokens, context, args.temperature, args.top_k, args.seed,
                 vocab_limit=tokenizer.vocab_size)
    print(args.prompt + tokenizer.decode(out))
    return 0


# Commands implemented in their own modules, imported only when used (start-up stays fast).
LAZY_COMMANDS = {
    "prepare": ("paratrain.data", "main_prepare"),
    "verify": ("paratrain.verify", "main_verify"),
    "estimate": ("paratrain.estimate", "main_estimate"),
    "plan": ("paratrain.planner.cli", "main_plan"),
    "report": ("paratrain.observe.report", "main_report"),
    "doctor": ("paratrain.observe.doctor", "main_doctor"),
    "export": ("paratrain.hf", "main_export"),
    "checkpoint": ("paratrain.training.checkpoint_cli", "main_checkpoint"),
    "replay": ("paratrain.observe.replay", "main_replay"),
}


def _lazy(command: str):
    def run(argv: list[str]) -> int:
        import importlib

        module, function = LAZY_COMMANDS[command]
        return getattr(importlib.import_module(module), function)(argv)

    return run


USAGE = """usage: paratrain <command> [options]

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
"""


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (not a call from Python): after a preemption, end without the teardown
        code = _main(sys.argv[1:])
        if _LEAVE_PROMPTLY:
            from paratrain.api import exit_now

            exit_now(code)
        return code
    return _main(argv)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    handlers = {"train": cmd_train, "profile": cmd_profile, "generate": cmd_generate, **{name: _lazy(name) for name in LAZY_COMMANDS}}
    if command not in handlers:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        print(f"error: unknown command '{command}'" + (f" (did you mean '{close[0]}'?)" if close else ""), file=sys.stderr)
        return 2
    try:
        with translated(environment_error):  # a full disk, a read-only or missing folder: one line, not a bug
            return handlers[command](rest) or 0
    except UserError as e:
        if str(e):
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output went to a pipe that closed (`paratrain train --help | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
