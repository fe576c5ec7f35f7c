"""lm-evaluation-harness's tasks on paratrain's model: the settings, their checks before launch, one evaluation on
every rank, lm-eval's own results files, and the flat metrics the run's log and sinks take.

lm-eval is the engine (task YAML, few-shot examples, metrics, results and samples files); paratrain gives it the
model (harness/model.py). Nothing here downloads: the Hugging Face hub is put offline unless the user's environment
says otherwise (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set to 0), so a task reads local files or the user's caches. A
task folder can run Python (`!function` in its YAML): it is code, trusted as such (docs/security.md).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from paratrain.errors import UserError, one_line

BUNDLED_TASKS = Path(__file__).resolve().parent.parent / "assets" / "eval_tasks"  # shakespeare, shakespeare_*
PIP_HINT = "pip install 'lm-eval>=0.4.10'  (or: pip install 'paratrain[eval]')"


@dataclass
class HarnessSettings:
    """What to evaluate and how (the `[eval]` section, or `paratrain eval`'s flags)."""
    tasks: list[str] = field(default_factory=list)
    include_path: str = ""  # a folder of task YAML files (besides lm-eval's own tasks)
    num_fewshot: int | None = None  # None: each task's own
    limit: int | None = None  # documents per task; None: all
    batch_size: int = 8  # requests per forward
    bootstrap_iters: int = 0  # lm-eval's bootstrapped standard errors (0: none)
    log_samples: bool = False
    output_path: str = ""  # where lm-eval's results (and samples) files go; "": not written


def run_settings(eval_cfg, output_path: str = "") -> HarnessSettings:
    """The `[eval]` section (config.EvalConfig) as HarnessSettings."""
    return HarnessSettings(tasks=list(eval_cfg.tasks), include_path=eval_cfg.include_path,
                           num_fewshot=None if eval_cfg.num_fewshot < 0 else eval_cfg.num_fewshot,
                           limit=eval_cfg.limit or None, batch_size=eval_cfg.batch_size, output_path=output_path)


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"downstream evaluation needs lm-evaluation-harness: {PIP_HINT}") from None


def offline() -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")


_MANAGERS: dict = {}


def _git_describe() -> str | None:
    """lm-eval's record of the working folder's git commit, without git's "fatal: not a git repository" on stderr
    when there is none."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


class _Quiet:
    """Drops lm-eval's notice that a task reads its data through a function (every bundled task does)."""

    @staticmethod
    def filter(record) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(settings: HarnessSettings):
    """lm-eval's TaskManager over the bundled tasks and the include path: those alone when every task asked for is
    there (indexing lm-eval's ~15,000 task files takes seconds), else with lm-eval's own. One per process and
    include path."""
    offline()
    import logging

    import lm_eval.evaluator
    import lm_eval.loggers.utils
    from lm_eval.tasks import TaskManager

    lm_eval.loggers.utils.get_git_commit_hash = lm_eval.evaluator.get_git_commit_hash = _git_describe
    log = logging.getLogger("lm_eval")
    log.setLevel(logging.WARNING)  # (its INFO lines on every rank)
    for handler in [*log.handlers, *logging.getLogger().handlers]:
        handler.addFilter(_Quiet)
    logging.getLogger("lm_eval.api.task").addFilter(_Quiet)
    key = settings.include_path
    paths = [str(BUNDLED_TASKS)] + ([key] if key else [])
    if key not in _MANAGERS:
        manager = TaskManager(include_path=paths, include_defaults=False)
        if not set(settings.tasks) <= set(manager.all_tasks):
            manager = TaskManager(include_path=paths)
        _MANAGERS[key] = manager
    manager = _MANAGERS[key]
    if not set(settings.tasks) <= set(manager.all_tasks):  # asked for more than the cached one knows
        manager = _MANAGERS[key] = TaskManager(include_path=paths)
    return manager


def check_settings(settings: HarnessSettings, what: str = "--") -> None:
    """Everything that needs no model: lm-eval there, the include path, the task names, the counts; then the tasks
    loaded (their data read) and the few-shot count against each task's split. `what`: how the settings are named
    in errors ("--" for flags, "eval." for config keys)."""
    flag = (lambda name: f"--{name.replace('_', '-')}") if what == "--" else (lambda name: f"eval.{name}")
    if not settings.tasks:
        raise UserError(f"{flag('tasks')} names no task")
    if settings.limit is not None and settings.limit <= 0:
        raise UserError(f"{flag('limit')} must be at least 1 (documents per task), got {settings.limit}")
    if settings.num_fewshot is not None and settings.num_fewshot < 0:
        raise UserError(f"{flag('num_fewshot')} must be >= 0, got {settings.num_fewshot}")
    if settings.batch_size < 1:
        raise UserError(f"{flag('batch_size')} must be at least 1, got {settings.batch_size}")
    if settings.bootstrap_iters < 0:
        raise UserError(f"{flag('bootstrap_iters')} must be >= 0, got {settings.bootstrap_iters}")
    if settings.include_path and not Path(settings.include_path).is_dir():
        raise UserError(f"{flag('include_path')} {settings.include_path}: no such folder")
    require_lm_eval()
    manager = task_manager(settings)
    known = set(manager.all_tasks)
    for name in settings.tasks:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f" (close: {', '.join(close)})" if close else (
                f" (none close among {len(known):,} tasks{'' if settings.include_path else '; a local task folder is ' + flag('include_path')})")
            raise UserError(f"unknown task '{name}'{hint}")
    for name, task in load_tasks(settings).items():
        if settings.num_fewshot:
            pool = task.fewshot_docs()
            size = len(pool) if pool is not None else len(task.eval_docs) - 1  # (the others of the test split)
            if settings.num_fewshot > size:
                raise UserError(f"{flag('num_fewshot')} {settings.num_fewshot} is more than task {name}'s few-shot "
                                f"split holds ({size} documents)")


def load_tasks(settings: HarnessSettings) -> dict:
    """{task name: lm-eval Task} (groups flattened), each task's data read."""
    from lm_eval.tasks import get_task_dict

    try:
        tasks = get_task_dict(settings.tasks, task_manager(settings))
    except Exception as e:  # lm-eval and datasets raise many kinds for a bad YAML or a missing data file
        raise UserError(f"cannot load the tasks {','.join(settings.tasks)}: {one_line(e)}") from None

    def leaves(d: dict):
        for name, value in d.items():
            if isinstance(value, dict):
                yield from leaves(value)
            else:
                yield getattr(name, "group_name", name), value

    return dict(leaves(tasks))


@contextlib.contextmanager
def kept_random_state():
    """lm-eval seeds Python's, numpy's and torch's generators; a training run in between keeps its own."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


@contextlib.contextmanager
def without_progress_bars():
    """lm-eval draws a tqdm bar per task while it builds the requests (`Task.build_all_requests`, no switch to turn
    it off): on every rank, into logs and pipes. A run prints one line per evaluation instead."""
    import lm_eval.api.task

    drawn = lm_eval.api.task.tqdm
    lm_eval.api.task.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        lm_eval.api.task.tqdm = drawn


def evaluate(lm, settings: HarnessSettings, describe: dict) -> dict | None:
    """lm-eval's results for `lm` on the first rank of each host (lm-eval's rule: LOCAL_RANK 0), None on the other
    ranks, which take part in every forward. `describe`: what was evaluated (checkpoint, step, layout, precision),
    put in the results."""
    from lm_eval import simple_evaluate

    with kept_random_state(), without_progress_bars():
        results = simple_evaluate(model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                                  limit=settings.limit, bootstrap_iters=settings.bootstrap_iters,
                                  log_samples=settings.log_samples, task_manager=task_manager(settings),
                                  batch_size=settings.batch_size, verbosity="WARNING")
    if results is None:
        return None
    results["config"]["model"] = "paratrain"
    results["config"]["model_args"] = ",".join(f"{k}={v}" for k, v in describe.items())
    results["paratrain"] = dict(describe)
    return results


def write_results(results: dict, settings: HarnessSettings) -> Path | None:
    """lm-eval's results JSON (and samples JSONL with log_samples) under output_path/paratrain/; its path."""
    if not settings.output_path:
        return None
    from lm_eval.loggers import EvaluationTracker

    results = dict(results)
    samples = results.pop("samples", None)
    tracker = EvaluationTracker(output_path=settings.output_path)
    tracker.general_config_tracker.model_name = "paratrain"
    tracker.general_config_tracker.model_name_sanitized = "paratrain"
    tracker.save_results_aggregated(results=results, samples=samples if settings.log_samples else None)
    if settings.log_samples and samples:
        for name in results["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
    return newest_results(Path(settings.output_path))


def newest_results(folder: Path) -> Path | None:
    found = sorted((folder / "paratrain").glob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    if "groups" in results:
        text += "\n" + make_table(results, "groups")
    return text


def downstream_metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's results (no standard errors; a filter other than lm-eval's "none" is
    kept in the name: exact_match_strict-match)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, comma, filt = key.partition(",")  # (lm-eval's metric keys are "metric,filter")
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            out.setdefault(task, {})[metric if filt in ("", "none") else f"{metric}_{filt}"] = float(value)
    return out
