"""`paratrain train`: train a model (one process or N local ranks), or with `--dry-run` build an N-rank layout here."""

from __future__ import annotations

from paratrain.config import config_keys_help, load_config
from paratrain.distributed.failure import EXIT_INTERRUPTED
from paratrain.errors import UserError, did_you_mean

USAGE = """usage: paratrain train [--config FILE.toml] [--nproc N] [--oversubscribe] [--max-restarts N] [--force] [--verbose] [--section.key=value ...]
       paratrain train --dry-run --world N [--config FILE.toml] [--section.key=value ...]

  --config FILE.toml   a config file (e.g. a run's config.toml, or plan/config.toml); overrides win over it
  --nproc N            start N local ranks (one per GPU; on CPU gloo ranks)
  --oversubscribe      allow more CPU ranks than the machine's cores comfortably run
  --max-restarts N     relaunch failed ranks from the newest checkpoint up to N times
  --force              start even when the memory estimate says the run does not fit this machine
  --verbose            at start-up also print the memory estimate's table and each rank's place in the mesh
  --dry-run --world N  build the real layout of N ranks here (fake process group, meta device), one rank per
                       pipeline stage, and print their model-state bytes beside the estimator's; no training

Examples: paratrain train --nproc 4 --parallel.tp=2;  paratrain train --checkpoint.resume=auto

config keys (section.key=default):
"""

# Set when this process should end without the interpreter's teardown (paratrain/cli.py reads it): a scheduler is
# waiting for it after a preemption, or launched ranks failed and the job ends now.
LEAVE_PROMPTLY = False
MAX_WORLD = 1 << 16  # --dry-run's ranks: beyond any cluster paratrain plans for; the mesh's groups grow with the world


def split_overrides(argv: list[str], flags_with_value: set[str], switches=()) -> tuple[dict, list[str]]:
    """Our own flags (e.g. --config F) vs `--section.key=value` config overrides (also `--section.key value`); anything
    else is a one-line error naming the closest of the flags and `switches` (the flags without a value)."""
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
            hint = did_you_mean(name, {*flags_with_value, *switches, "--help"})
            raise UserError(f"unexpected argument '{arg}'" + (hint or " (config overrides look like --section.key=value)"))
        i += 1
    return own, overrides


def int_flag(own: dict, name: str, default: int) -> int:
    try:
        value = int(own.get(name, default))
    except ValueError:
        raise UserError(f"{name} must be an integer, got {own[name]!r}") from None
    if value < 0:
        raise UserError(f"{name} must be >= 0")
    return value


def main(argv: list[str]) -> int:
    global LEAVE_PROMPTLY
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + config_keys_help())
        return 0
    oversubscribe = "--oversubscribe" in argv  # more CPU ranks than paratrain.preflight allows by default
    dry_run = "--dry-run" in argv  # build the layout of --world N ranks here, without training
    switches = ("--oversubscribe", "--dry-run", "--force", "--verbose")  # flags without a value
    own, overrides = split_overrides([a for a in argv if a not in switches],
                                     {"--config", "--nproc", "--max-restarts", "--world"}, switches)
    if "--force" in argv:  # try a run the memory estimate says does not fit
        overrides.append("resilience.memory_check=false")
    if "--verbose" in argv:
        overrides.append("metrics.verbose=true")
    if "--max-restarts" in own:
        overrides.append(f"resilience.max_restarts={int_flag(own, '--max-restarts', 0)}")
    if "--world" in own and not dry_run:
        raise UserError("--world is the world size of --dry-run; training takes its ranks from --nproc or the launcher")
    cfg = load_config(own.get("--config"), overrides)
    if dry_run:
        return main_dry_run(cfg, int_flag(own, "--world", int_flag(own, "--nproc", 1)))
    # lazy: torch (through the trainer) is not needed for --help and the argument errors above
    from paratrain.api import train

    try:
        result = train(cfg, nproc=int_flag(own, "--nproc", 1), oversubscribe=oversubscribe)
    except UserError:
        LEAVE_PROMPTLY = int_flag(own, "--nproc", 1) > 1  # launched ranks failed: the job ends now (see cli.main)
        raise
    if result is None or getattr(result, "preempted", False):
        LEAVE_PROMPTLY = True  # a scheduler is waiting for this process to end (see cli.main)
    return EXIT_INTERRUPTED if getattr(result, "interrupted", False) else 0  # Ctrl-C: saved, and the shell's 130


def main_dry_run(cfg, world: int) -> int:
    """`paratrain train --dry-run --world N`: print the table; exit 1 when built and estimated states disagree."""
    if not 1 <= world <= MAX_WORLD:
        raise UserError(f"--world must be between 1 and {MAX_WORLD:,}, got {world:,}")
    # lazy: torch is not needed for --help and the argument errors above
    from paratrain.training.dryrun import dry_run, format_dry_run

    d = dry_run(cfg, world)
    print(format_dry_run(d), flush=True)
    return 0 if d.agrees else 1
