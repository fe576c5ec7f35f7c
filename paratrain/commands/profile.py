"""`paratrain profile`: a few training steps under torch.profiler: traces per rank and the compute / communication
split (paratrain/observe/profile.py reads the traces)."""

from __future__ import annotations

from paratrain.commands.train import int_flag, split_overrides
from paratrain.config import load_config
from paratrain.errors import UserError

USAGE = "paratrain profile [--config F.toml] [--nproc N] [--section.key=value ...] [--steps N] [--warmup W]"


def profile_overrides(steps: int, warmup: int, overrides: list[str]) -> list[str]:
    """`paratrain profile`'s run: W warm-up steps, then N profiled steps of the configured training (no evaluation,
    checkpoint or sample); run.name defaults to "profile"."""
    named = any(o.startswith("run.name=") for o in overrides)
    return ([] if named else ["run.name=profile"]) + overrides + [
        f"training.steps={warmup + steps}", f"metrics.profile_steps={steps}", f"metrics.profile_start={warmup}",
        "training.eval_every=0", "checkpoint.save_final=false", "checkpoint.every=0", "checkpoint.resume=none",
        "sample.max_new_tokens=0"]


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: " + USAGE)
        return 0
    oversubscribe = "--oversubscribe" in argv
    own, overrides = split_overrides([a for a in argv if a != "--oversubscribe"],
                                     {"--config", "--nproc", "--steps", "--warmup"}, ("--oversubscribe",))
    steps, warmup = int_flag(own, "--steps", 3), int_flag(own, "--warmup", 1)
    if steps < 1:
        raise UserError("--steps must be >= 1")
    cfg = load_config(own.get("--config"), profile_overrides(steps, warmup, overrides))
    if not any(o.startswith("run.name=") for o in overrides) and not any(cfg.run_dir.glob("checkpoints/*")):
        cfg.run.overwrite = True  # the default runs/profile holds an earlier profile (no checkpoints): replace it
    # lazy: torch (through the trainer) is not needed for --help and the argument errors above
    from paratrain.api import train

    train(cfg, nproc=int_flag(own, "--nproc", 1), oversubscribe=oversubscribe)
    print(f"traces: {cfg.run_dir / 'profile'}/rank<r>.json (https://ui.perfetto.dev); summary: "
          f"{cfg.run_dir / 'profile' / 'summary.json'}")
    return 0
