"""What `paratrain estimate` and `paratrain plan` print for every documented example, saved to compare before/after.

A refactor of the estimator or the planner must not change a byte of what these commands print or write. This script
runs every `paratrain estimate` / `paratrain plan` command of the ```bash blocks of README.md and docs/*.md (found by
the journeys' own extraction, tests/test_journeys.py `doc_commands`; `plan ...` stands for the journeys' `PLAN`
options, as the documentation says), plus a `--json` variant of each that does not give `--json` already (each
argument list once), and saves per command its stdout, stderr, exit code and the files it wrote (e.g. plan's
`plan/config.toml`, `plan/plan.sbatch`). `--calibrate` commands are skipped (they measure this machine): listed on
the screen and in the recording's entry `_skipped`.

Each command runs through the real CLI (`sys.executable -m paratrain`, this checkout first on PYTHONPATH) in a fresh
temporary folder with XDG_CACHE_HOME inside it (no saved calibration profile of this machine is read), PARATRAIN_*
variables removed, PYTHONHASHSEED=0 and OMP_NUM_THREADS=1. A command that reads a file another documented command
writes gets that command run first in the same folder (`PREREQUISITES`): `plan/config.toml` from the first plan
example; `runs/default/config.toml` from `make run`'s `paratrain train --checkpoint.resume=auto`, cut to one CPU
step (the options added are ones the estimate does not read: steps, eval sequences, sample length, progress, device).

Normalised, in stdout, stderr and written files alike (nothing else is changed):
  - the temporary folder's path (as given and resolved) -> `<TMP>`;
  - clock timings: `planned in 1.23 s`, `built in 3.2 s` -> `<SECONDS>`, and the JSON values of `"planning_seconds"`
    and `"seconds"` -> `"<SECONDS>"`.

    python bench/cli_outputs.py --out DIR               # record (e.g. before and after a refactor)
    python bench/cli_outputs.py --compare DIR_A DIR_B   # table + unified diffs, last line `N same, M different`;
                                                        # exit 1 if any differ
    python bench/cli_outputs.py --smoke                 # two commands recorded twice and compared (the test suite)
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from test_journeys import PLAN, doc_commands  # noqa: E402  (the journeys' extraction: the same commands)

SUBCOMMANDS = ("paratrain estimate", "paratrain plan")
SKIPPED = "_skipped"  # the recording's entry listing the commands not run
# A file a documented command reads -> the documented command that writes it (with options making it quick).
PREREQUISITES = {
    "plan/config.toml": PLAN,
    "runs/default/config.toml": "paratrain train --checkpoint.resume=auto --training.steps=1 "
                                "--training.eval_sequences=8 --sample.max_new_tokens=0 --metrics.progress=none "
                                "--training.device=cpu",
}
TIMINGS = [(re.compile(r"\b(planned|built) in \d+(\.\d+)? s\b"), r"\1 in <SECONDS> s"),
           (re.compile(r'("(?:planning_)?seconds": )-?\d+(\.\d+)?(e-?\d+)?'), r'\1"<SECONDS>"')]


def documented_commands() -> tuple[list[list[str]], list[str]]:
    """The argument lists to run (after `paratrain`), `--json` variants included, and the skipped commands."""
    runs, skipped = [], []
    for command in doc_commands():
        if not command.startswith(SUBCOMMANDS):
            continue
        if "--calibrate" in command:
            skipped.append(command)
            continue
        words = shlex.split(command)[1:]
        if "..." in words:  # "paratrain plan ... --json": the first plan example's options
            at = words.index("...")
            words[at:at + 1] = shlex.split(PLAN)[2:]
        for variant in (words, *([] if "--json" in words else [[*words, "--json"]])):
            if variant not in runs:  # `plan ... --json` is the first plan example's --json variant
                runs.append(variant)
    return runs, skipped


def environment(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, "XDG_CACHE_HOME": str(folder / ".cache"), "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def paratrain(words: list[str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratrain", *words], cwd=folder, env=environment(folder),
                          capture_output=True, timeout=900)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def normalise(data: bytes, folder: Path) -> bytes:
    text = data.decode("utf-8", "surrogateescape")
    for path in sorted({str(folder), str(folder.resolve())}, key=len, reverse=True):
        text = text.replace(path, "<TMP>")
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    return text.encode("utf-8", "surrogateescape")


def entry_name(words: list[str]) -> str:
    """A folder name for the command: readable, and unique by a hash of the whole command."""
    text = shlex.join(words)
    slug = re.sub(r"[^A-Za-z0-9.,=+-]+", "_", text.replace("--", ""))[:90]
    return f"{slug}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def capture(words: list[str], out: Path) -> int:
    """Run one command in a fresh folder (its prerequisites first) and save what it printed and wrote."""
    entry = out / entry_name(words)
    entry.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-cli-") as tmp:
        folder = Path(tmp)
        for needed, command in PREREQUISITES.items():
            if needed in words:
                done = paratrain(shlex.split(command)[1:], folder)
                if done.returncode:
                    raise SystemExit(f"{command}: exit {done.returncode}\n{done.stderr.decode()[-3000:]}")
        before = snapshot(folder)
        done = paratrain(words, folder)
        written = {p: b for p, b in snapshot(folder).items() if before.get(p) != b}
        saved = {"command.txt": ("paratrain " + shlex.join(words) + "\n").encode(), "stdout.txt": done.stdout,
                 "stderr.txt": done.stderr, "exit_code.txt": f"{done.returncode}\n".encode(),
                 **{f"files/{p}": b for p, b in written.items()}}
        for name, data in saved.items():
            (entry / name).parent.mkdir(parents=True, exist_ok=True)
            (entry / name).write_bytes(normalise(data, folder))
    return done.returncode


def record(out: Path, limit: int | None = None) -> int:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    runs, skipped = documented_commands()
    runs = runs[:limit]
    (out / SKIPPED).mkdir()
    (out / SKIPPED / "command.txt").write_text("(the --calibrate commands, skipped: they measure this machine)\n")
    (out / SKIPPED / "commands.txt").write_text("".join(f"{c}\n" for c in skipped))
    for command in skipped:
        print(f"skipped (--calibrate measures this machine): {command}")
    started = time.perf_counter()
    for i, words in enumerate(runs, 1):
        t0 = time.perf_counter()
        code = capture(words, out)
        print(f"[{i}/{len(runs)}] exit {code}  {time.perf_counter() - t0:5.1f} s  paratrain {shlex.join(words)}",
              flush=True)
    print(f"{len(runs)} commands captured into {out} in {time.perf_counter() - started:.0f} s "
          f"({len(skipped)} skipped)")
    return 0


def differences(a: Path, b: Path, name: str) -> list[str]:
    """Unified diffs of every file of entry `name` that differs between the two recordings."""
    files_a, files_b = (snapshot(d / name) if (d / name).is_dir() else {} for d in (a, b))
    diff = []
    for file in sorted(files_a.keys() | files_b.keys()):
        old, new = files_a.get(file), files_b.get(file)
        if old != new:
            old_lines = [] if old is None else old.decode("utf-8", "replace").splitlines(keepends=True)
            new_lines = [] if new is None else new.decode("utf-8", "replace").splitlines(keepends=True)
            lines = list(difflib.unified_diff(old_lines, new_lines, f"{a.name}/{name}/{file}",
                                              f"{b.name}/{name}/{file}"))
            lines = lines or [f"{name}/{file}: {'absent' if old is None else 'present'} in {a.name}, "
                              f"{'absent' if new is None else 'present'} in {b.name}, bytes differ\n"]
            diff += [line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n" for line in lines]
    return diff


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for d in (a, b) for p in d.iterdir() if p.is_dir()})
    diffs = {name: differences(a, b, name) for name in names}
    print("| command | result |\n| --- | --- |")
    for name, diff in diffs.items():
        entry = a / name if (a / name).is_dir() else b / name
        print(f"| {(entry / 'command.txt').read_text().strip()} | {'different' if diff else 'same'} |")
    for name, diff in diffs.items():
        if diff:
            print(f"\n=== {name}\n" + "".join(diff), end="")
    different = sum(bool(d) for d in diffs.values())
    print(f"\n{len(diffs) - different} same, {different} different")
    return 1 if different else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="record every command's output into this (new or empty) folder")
    group.add_argument("--compare", type=Path, nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two recordings")
    group.add_argument("--smoke", action="store_true", help="the first two commands, recorded twice and compared "
                                                             "(the test suite: tests/test_bench_smoke.py)")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="cli-outputs-smoke-") as tmp:
            for recording in ("a", "b"):
                record(Path(tmp, recording), limit=2)
            return compare(Path(tmp, "a"), Path(tmp, "b"))
    return record(args.out) if args.out else compare(*args.compare)


if __name__ == "__main__":
    sys.exit(main())
