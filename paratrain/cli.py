"""`paratrain <command>`: train, prepare, generate, verify."""

from __future__ import annotations

import argparse
import sys
import time

from paratrain.errors import UserError

COMMANDS = ("train", "prepare", "generate", "verify", "estimate", "plan", "report", "doctor")


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


def _is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and ("gloo" in text or "nccl" in text or "collective" in text)


def _rank_main(cfg, want_weights: bool = False):
    """What every launched rank runs: user errors become one line and exit code 2, a collective timeout
    one line naming the timeout and exit code 3."""
    from paratrain.distributed.env import world_from_env
    from paratrain.distributed.launch import EXIT_COLLECTIVE_TIMEOUT
    from paratrain.train import train

    rank = world_from_env()[0]
    try:
        return train(cfg, want_final_weights=want_weights)
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except Exception as e:
        if _is_collective_timeout(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"error: [rank {rank}] a collective did not complete within resilience.collective_timeout_s="
                  f"{cfg.resilience.collective_timeout_s:g} s; another rank is stuck or dead ({first})",
                  file=sys.stderr, flush=True)
            from paratrain.distributed.env import kill_local_peers

            kill_local_peers()
            sys.exit(EXIT_COLLECTIVE_TIMEOUT)
        # A bug, not bad input: the launcher would swallow the traceback, so print it with the rank.
        import traceback

        print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        raise


def cmd_train(argv: list[str]) -> int:
    from paratrain.config import load_config
    from paratrain.distributed.launch import inside_launcher, launch

    own, overrides = split_overrides(argv, {"--config", "--nproc", "--max-restarts"})
    if "--max-restarts" in own:
        overrides.append(f"resilience.max_restarts={_int_flag(own, '--max-restarts', 0)}")
    cfg = load_config(own.get("--config"), overrides)
    nproc = _int_flag(own, "--nproc", 1)
    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    if inside_launcher():
        _rank_main(cfg)
        return 0
    from paratrain.resilience import preempted_since
    from paratrain.train import plan_run, train

    if nproc == 1 and cfg.resilience.max_restarts == 0:
        train(cfg)
        return 0
    plan_run(cfg, nproc)  # validate the layout and prepare data before any process starts
    started = time.time()
    try:
        launch(_rank_main, (cfg,), nproc, cfg.resilience.max_restarts)
    except _signal_exception() as e:
        # The launcher itself was told to stop (SIGTERM to the whole job): the ranks saved and exited.
        if preempted_since(cfg.run_dir, started):
            return 0
        raise UserError(f"stopped by signal {getattr(e, 'sigval', '')} before a checkpoint was saved") from None
    return 0


def _signal_exception():
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="paratrain generate")
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder, or a run folder (newest checkpoint)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0")
    from paratrain.inference import load_for_generation
    from paratrain.generate import sample

    model, tokenizer, _, context = load_for_generation(args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    out = sample(model, ids, args.max_new_tokens, context, args.temperature, args.top_k, args.seed,
                 vocab_limit=tokenizer.vocab_size)
    print(args.prompt + tokenizer.decode(out))
    return 0


# Commands implemented in their own modules, imported only when used (start-up stays fast).
LAZY_COMMANDS = {
    "prepare": ("paratrain.data", "main_prepare"),
    "verify": ("paratrain.verify", "main_verify"),
    "estimate": ("paratrain.estimate", "main_estimate"),
    "plan": ("paratrain.planner", "main_plan"),
    "report": ("paratrain.report", "main_report"),
    "doctor": ("paratrain.doctor", "main_doctor"),
}


def _lazy(command: str):
    def run(argv: list[str]) -> int:
        import importlib

        module, function = LAZY_COMMANDS[command]
        return getattr(importlib.import_module(module), function)(argv)

    return run


USAGE = """usage: paratrain <command> [options]

commands:
  train      train a model: paratrain train [--config FILE.toml] [--nproc N] [--section.key=value ...]
  prepare    tokenize a corpus into token shards: paratrain prepare --input PATH|'GLOB' --out DIR [--tokenizer char] [--workers N]
  generate   sample from a checkpoint: paratrain generate --checkpoint DIR --prompt "..." [--max-new-tokens N]
  verify     prove parallel layouts match one process: paratrain verify [--layouts ddp2,fsdp2,...] [--steps 20]
  estimate   memory per rank before launch: paratrain estimate --model llama3-8b --gpu H100 [layout options]
  plan       rank parallel layouts by predicted speed: paratrain plan --model llama3-8b --gpus 8 --gpu H100
  report     plots and a summary of finished runs: paratrain report RUN_DIR [RUN_DIR ...]
  doctor     check the environment (torch, CUDA, NCCL, interconnect, disk, a collective test)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    handlers = {"train": cmd_train, "generate": cmd_generate, **{name: _lazy(name) for name in LAZY_COMMANDS}}
    if command not in handlers:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        print(f"error: unknown command '{command}'" + (f" (did you mean '{close[0]}'?)" if close else ""), file=sys.stderr)
        return 2
    try:
        return handlers[command](rest) or 0
    except UserError as e:
        if str(e):
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
