"""paratrain's Python API: what the CLI, `paratrain verify`, the benches and the tests call.

    from paratrain.api import train
    from paratrain.config import load_config

    result = train(load_config("my.toml", ["training.steps=100"]), nproc=4)   # 4 local ranks
    result.losses, result.val_loss

`train_rank(cfg)` is one rank's whole run (process group, data, resolve, train); `run_rank(cfg)` is the same with
the error handling of a launched rank (one `error:` line and exit code 2 for bad input, 3 for a collective
timeout); `train(cfg, nproc)` validates everything, then runs one process or launches `nproc` ranks.
"""

from __future__ import annotations

import sys
import time

from paratrain.config import Config
from paratrain.errors import UserError

__all__ = ["train", "train_rank", "run_rank", "launch_ranks", "TrainResult"]


def __getattr__(name: str):
    if name == "TrainResult":
        from paratrain.training.loop import TrainResult

        return TrainResult
    raise AttributeError(name)


def train_rank(cfg: Config, want_final_weights: bool = False, keep_group: bool = False):
    """One rank's run (or a single process's): everything after the launch. Returns a TrainResult.
    keep_group: leave the process group up for another run by the same ranks (tests run several runs per launch)."""
    import torch
    import torch.distributed as dist

    from paratrain.data import read_meta
    from paratrain.distributed.env import init_distributed, shutdown_distributed, world_from_env
    from paratrain.observe.metrics import check_metrics_config
    from paratrain.spec import check, prepare_data, resolve
    from paratrain.training.loop import Trainer

    _, world, _ = world_from_env()
    # Checks that need only the config run before the process group exists and before data is written.
    check(cfg, world)
    check_metrics_config(cfg.metrics)
    env = init_distributed(cfg.training.device, cfg.resilience.collective_timeout_s)
    if world > 1:
        # One rank prepares the data; the others wait, then read it or raise the same error.
        box = [None]
        if env.is_main:
            try:
                prepare_data(cfg)
            except UserError as e:
                box = [str(e)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UserError(box[0])
        meta = read_meta(cfg.data.dir)
    else:
        meta = prepare_data(cfg)
    spec = resolve(cfg, env.world_size, meta["vocab_size"])
    torch.manual_seed(cfg.training.seed)
    result = Trainer(spec, env, want_final_weights).fit()
    if keep_group and dist.is_initialized():
        dist.barrier()
    else:
        shutdown_distributed()  # every rank got here at the same step: leave the process group cleanly
    return result


def _is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and ("gloo" in text or "nccl" in text or "collective" in text)


def run_rank(cfg: Config, want_final_weights: bool = False, keep_group: bool = False):
    """What every launched rank runs: user errors become one line and exit code 2, a collective timeout one line
    naming the timeout and exit code 3; a bug prints its traceback with the rank."""
    from paratrain.distributed.env import kill_local_peers, world_from_env
    from paratrain.distributed.launch import EXIT_COLLECTIVE_TIMEOUT

    rank = world_from_env()[0]
    try:
        return train_rank(cfg, want_final_weights, keep_group)
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
            kill_local_peers()
            sys.exit(EXIT_COLLECTIVE_TIMEOUT)
        # A bug, not bad input: the launcher would swallow the traceback, so print it with the rank.
        import traceback

        print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        raise


def launch_ranks(entrypoint, args: tuple, nproc: int, max_restarts: int = 0):
    """Run `entrypoint(*args)` on `nproc` local ranks (torch elastic); returns rank 0's return value."""
    from paratrain.distributed.launch import launch

    return launch(entrypoint, args, nproc, max_restarts)


def train(cfg: Config, nproc: int = 1, want_final_weights: bool = False):
    """Validate, prepare the data, and train on this process (nproc=1, no restarts) or on `nproc` local ranks
    (relaunched from the newest checkpoint up to resilience.max_restarts times). Returns rank 0's TrainResult."""
    from paratrain.distributed.launch import inside_launcher
    from paratrain.spec import resolve_run

    if nproc < 1:
        raise UserError("--nproc must be >= 1")
    if inside_launcher():
        return run_rank(cfg, want_final_weights)
    if nproc == 1 and cfg.resilience.max_restarts == 0:
        return train_rank(cfg, want_final_weights)
    resolve_run(cfg, nproc)  # everything is checked and the data prepared before any process starts
    started = time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.training.resilience import preempted_since

    try:
        return launch_ranks(run_rank, (cfg, want_final_weights), nproc, cfg.resilience.max_restarts)
    except SignalException as e:
        # The launcher itself was told to stop (SIGTERM to the whole job): the ranks saved and exited.
        if preempted_since(cfg.run_dir, started):
            return None
        raise UserError(f"stopped by signal {getattr(e, 'sigval', '')} before a checkpoint was saved") from None
