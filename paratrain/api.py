"""paratrain's Python API: what the CLI, `paratrain verify`, the benches and the tests call.

    from paratrain.api import train
    from paratrain.config import load_config

    result = train(load_config("my.toml", ["training.steps=100"]), nproc=4)   # 4 local ranks
    result.losses, result.val_loss

`train_rank(cfg)` is one rank's whole run (process group, data, resolve, train); `run_rank(cfg)` is the same with
the error handling of a launched rank (one `error:` line from the rank that failed; exit code 2 for bad input or
environment, 3 for a collective timeout, 1 for a crash); `train(cfg, nproc)` validates everything, then runs one
process or launches `nproc` ranks.
"""

from __future__ import annotations

import os
import sys
import time

from paratrain import allocator, capabilities
from paratrain.capabilities.grad_compression import Compression
from paratrain.config import Config
from paratrain.distributed import failure
from paratrain.distributed.launch import attempt, inside_launcher, launch, start_rank_server
from paratrain.distributed.orphans import LAUNCHER_ENV
from paratrain.errors import UserError, environment_error, translated
from paratrain.observe.metrics import check_metrics_config
from paratrain.preflight import check_launch, check_new_run, check_overwrite, start_over, warn_disk
from paratrain.runlock import hold_run_folder, refuse_if_live
from paratrain.spec import VOCAB_PAD, check, prepare_data, resolve
from paratrain.training.preemption import watching

__all__ = ["train", "train_rank", "run_rank", "launch_ranks", "TrainResult"]


def __getattr__(name: str):
    if name == "TrainResult":
        # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
        from paratrain.training.loop import TrainResult

        return TrainResult
    raise AttributeError(name)


def train_rank(cfg: Config, want_final_weights: bool = False, keep_group: bool = False):
    """One rank's run (or a single process's): everything after the launch. Returns a TrainResult.
    keep_group: leave the process group up for another run by the same ranks (tests run several runs per launch)."""
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.distributed.env import world_from_env

    _, world, _ = world_from_env()
    # Checks that need only the config run before the process group exists and before data is written.
    return _train_parts(check(cfg, world), want_final_weights, keep_group)


def _train_parts(parts, want_final_weights: bool, keep_group: bool):
    """train_rank from the config's parts (`spec.check`, already made in this process)."""
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    import torch
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    import torch.distributed as dist

    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.data import dataset_meta
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.distributed.env import init_distributed, shutdown_distributed
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.training.checkpoint import resume_path
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.training.loop import Trainer
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.training.memory_fit import check_memory_fits

    cfg, folder, world = parts.cfg, parts.folder, parts.world_size
    allocator.apply(cfg.memory.allocator)  # before CUDA starts (init_distributed): under torchrun, no launcher of ours
    check_metrics_config(cfg.metrics)
    first_launch = not relaunched()
    if first_launch:  # every rank looks before any of them can write (they meet in init_distributed first)
        check_new_run(folder)
        check_overwrite(folder)
    # (CPU offload: on CUDA also collectives on host tensors, where the gradients are)
    host_collectives = any(c.states_on_host for c in capabilities.active(cfg))
    # torch's PowerSGD hook waits on a collective inside a gloo worker's callback: two workers (gloo_workers.py)
    gloo_threads = 2 if Compression(cfg.parallel.grad_compression).low_rank or any(
        c.waits_in_collective_callbacks for c in capabilities.active(cfg)) else 1
    env = init_distributed(cfg.training.device, cfg.resilience.collective_timeout_s, host_collectives, gloo_threads)
    if world > 1:
        # One rank prepares the data; the others wait, then read it or raise the same error.
        box = [None]
        if env.is_main:
            try:
                prepare_data(parts.data, resume_path(folder))
            except UserError as e:
                box = [str(e)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UserError(box[0])
        meta = dataset_meta(parts.data.data)
    else:
        meta = prepare_data(parts.data, resume_path(folder))
    spec = resolve(parts, meta)
    # before anything is allocated or deleted; the node's ranks share its host memory (LOCAL_WORLD_SIZE: elastic's)
    check_memory_fits(spec, env.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if first_launch and env.is_main:
        start_over(folder)  # run.overwrite: only now that every check has passed
    if first_launch and folder.overwrite and world > 1:
        dist.barrier()
    torch.manual_seed(cfg.training.seed)
    result = Trainer(spec, env, want_final_weights).fit()
    if keep_group and dist.is_initialized():
        dist.barrier()
    else:
        shutdown_distributed()  # every rank got here at the same step: leave the process group cleanly
    return result


def relaunched() -> bool:
    """This rank belongs to a restart (paratrain's launcher or torchrun's --max-restarts), not the first launch."""
    return attempt() > 0


def run_rank(cfg: Config, want_final_weights: bool = False, keep_group: bool = False):
    """What every launched rank runs. SIGTERM is watched from the first line (a notice during start-up is kept).
    Any failure ends in `paratrain.distributed.failure.report`: the rank that failed prints one `error:` line (a bug:
    its traceback), its peers stop quietly, and the exit code is 2 for bad input or environment (never retried),
    3 for a collective timeout, 1 for a crash."""
    with watching(cfg.resilience.preempt_grace_s) as watch:
        # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
        from paratrain.observe import hang

        watch.on_signal.append(failure.stop_if_peer_failed)
        watch.on_dump.append(lambda: hang.dump(cfg.run_dir, "SIGUSR2"))  # its collective history, on request

        def report_and_exit(error: BaseException):
            # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
            from paratrain.distributed.env import kill_local_peers_after_exit, world_from_env

            rank, world, _ = world_from_env()
            code = failure.report(error, rank, world, cfg.resilience.collective_timeout_s, cfg.run_dir)
            if failure.collective_failed(error):  # this rank's collective history, and its local peers'
                hang.collect(cfg.run_dir, failure.first_line(error))
            if code == failure.EXIT_COLLECTIVE_TIMEOUT and failure.first_failed_rank() in (None, rank):
                kill_local_peers_after_exit(code)  # a frozen peer would hold the launcher for its shutdown timeout
            exit_now(code)

        with translated(report_and_exit, untouched=(SystemExit,)):  # an interrupt is reported too (exit 130)
            result = train_rank(cfg, want_final_weights, keep_group)
            leave_promptly()
            return result


def exit_now(code: int) -> None:
    """End this process with `code` at once: stdio flushed, no interpreter teardown (seconds with torch loaded on a
    busy machine, while the launcher, its peers and a scheduler wait)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_promptly() -> None:
    """Once this process's work is done and its files closed: skip the interpreter's teardown at exit (with torch
    loaded it takes seconds on a busy machine, which a preempted job waiting on its ranks cannot spare). Python's
    atexit handlers run last-registered first, so this one ends the process before the slow part; the exit status
    stays 0, as a normal end would leave it."""
    import atexit

    atexit.register(exit_now, 0)


RANK_MODULES = ("paratrain.spec", "paratrain.training.loop")  # what a training rank imports (its forkserver's preload)


def launch_ranks(entrypoint, args: tuple, nproc: int, max_restarts: int = 0, grace_s: float = 30.0):
    """Run `entrypoint(*args)` on `nproc` local ranks (torch elastic); returns rank 0's return value. SIGTERM to
    this process is passed on to the ranks, which get `grace_s` seconds to save and stop."""
    return launch(entrypoint, args, nproc, max_restarts, grace_s, preload=RANK_MODULES)


def train(cfg: Config, nproc: int = 1, want_final_weights: bool = False, oversubscribe: bool = False):
    """Validate, prepare the data, and train on this process (nproc=1, no restarts) or on `nproc` local ranks
    (relaunched from the newest checkpoint up to resilience.max_restarts times). Returns rank 0's TrainResult.

    Before anything is written or started: the run folder must be writable, the metrics ports free, nproc within
    the machine's GPUs or cores (`oversubscribe` lifts the CPU limit), and a checkpoint to resume from must hold this
    model; a disk too small for the checkpoints is a warning."""
    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    if inside_launcher():  # torchrun: global rank 0 holds the run folder (runlock.py) for the run's life
        lock = hold_run_folder(cfg.run_dir) if _holds_the_run() else None
        try:
            return run_rank(cfg, want_final_weights)
        finally:
            if lock is not None:
                lock.release()
    parts = check(cfg, nproc)  # the layout against the world size and the model: needs no torch, so it answers at once
    allocator.apply(cfg.memory.allocator)  # before CUDA starts, here or in the ranks (they inherit the environment)
    launching = nproc > 1 or cfg.resilience.max_restarts > 0
    if launching:  # the ranks' forkserver imports torch while this process checks and prepares the data
        start_rank_server(RANK_MODULES)
    # a live run in this folder: one line naming it before any other check (runlock.py)
    refuse_if_live(parts.folder.path, "this train")
    check_launch(parts.folder, cfg.training.device, cfg.metrics, nproc, oversubscribe)
    if cfg.eval.tasks:  # lm-eval there, the tasks known, their data readable: before anything starts
        from paratrain.harness.tasks import check_settings, run_settings  # lazy: lm-eval only for runs that ask

        check_settings(run_settings(cfg.eval), what="eval.")
    # lazy: the checks above answer without torch (the ranks' forkserver imports it meanwhile)
    from paratrain.training.checkpoint import check_resume, resume_path
    from paratrain.training.memory_fit import check_host_memory

    resume = resume_path(parts.folder)  # a checkpoint.resume that is no checkpoint: one line before anything starts
    check_host_memory(parts, nproc)  # a model this machine's RAM cannot hold: one line, nothing written or allocated
    spec = None
    if launching:
        # everything is checked and the data prepared before any start
        spec = resolve(parts, prepare_data(parts.data, resume))
        check_resume(parts.folder, spec.model_args)
    # Every check passed: this process holds the run folder for the run's life (a launch that started at the same
    # moment gets the one line here).
    lock = hold_run_folder(parts.folder.path)
    try:
        if not launching:
            return _train_here(parts, want_final_weights)
        return _launch(cfg, parts, spec, nproc, want_final_weights)
    finally:
        lock.release()


def _holds_the_run() -> bool:
    """Under torchrun (not paratrain's launcher, which holds the lock itself): global rank 0."""
    return os.environ.get("RANK", "0") == "0" and LAUNCHER_ENV not in os.environ


def _launch(cfg, parts, spec, nproc: int, want_final_weights: bool):
    """The ranks, launched (the checks passed, the data prepared, this process holding the run folder)."""
    warn_disk(parts.folder, spec.model_args, lambda text: print(text, file=sys.stderr, flush=True))
    started = time.time()
    # lazy: the checks before launch answer without torch (the ranks' forkserver imports it meanwhile)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.training.resilience import preempted_since

    try:
        return launch_ranks(run_rank, (cfg, want_final_weights), nproc, cfg.resilience.max_restarts,
                            cfg.resilience.preempt_grace_s)
    except SignalException as e:
        # The launcher itself was told to stop (SIGHUP, SIGQUIT: torch elastic stops the ranks).
        if preempted_since(cfg.run_dir, started):
            return None
        raise UserError(f"stopped by signal {getattr(e, 'sigval', '')} before a checkpoint was saved") from None


def _train_here(parts, want_final_weights: bool):
    """One process, no launcher: a failure caused by the environment (full disk, read-only folder) is one line."""

    warn_disk(parts.folder, parts.source.args(VOCAB_PAD), lambda text: print(text, file=sys.stderr, flush=True))
    with translated(environment_error):
        return _train_parts(parts, want_final_weights, keep_group=False)
