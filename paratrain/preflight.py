"""Checks of the machine and of the paths a run will use, made before any file is written or any rank started.

`paratrain.api.train` calls `check_launch` (run folder writable, metrics ports free, ranks vs cores or GPUs) before
the data is prepared, and `check_resume` + `warn_disk` once the model is resolved. The run folder's checks read a
`RunFolder`, taken from the config once (by `paratrain.spec.check`). The config's own values (finite
numbers, run names) are checked earlier, by `paratrain.config.validate`.

Ranks per machine: one rank per GPU on CUDA (NCCL cannot share a GPU between ranks). CPU ranks (gloo, one thread
each) may oversubscribe the cores a little; up to max(8, 4 x cores) are started without asking (the test suite and
`paratrain verify` run 8 ranks on 2 cores), more only with `--oversubscribe`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import ConfigError, UserError
from paratrain.files import holds
from paratrain.models.presets import count_params
from paratrain.observe.metrics import check_metrics_config

CPU_RANKS_PER_CORE = 4
CPU_RANKS_ALWAYS_ALLOWED = 8


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def max_cpu_ranks() -> int:
    return max(CPU_RANKS_ALWAYS_ALLOWED, CPU_RANKS_PER_CORE * available_cores())


def check_nproc(device: str, nproc: int, oversubscribe: bool | None = False, what: str = "--nproc") -> None:
    """`nproc` local ranks fit this machine: at most one per GPU on CUDA; on CPU at most max_cpu_ranks() unless
    oversubscribe (None: the command has no --oversubscribe)."""
    if nproc <= 1:
        return
    # lazy: torch is not needed for the checks before launch
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise ConfigError(f"{what} {nproc} but this machine has {gpus} GPU(s): one rank per GPU (NCCL cannot "
                              f"share a GPU between ranks); use {what} {gpus}, or training.device=cpu")
        return
    limit, cores = max_cpu_ranks(), available_cores()
    if nproc > limit and not oversubscribe:
        hint = "; pass --oversubscribe to start them anyway" if oversubscribe is not None else ""
        raise ConfigError(f"{what} {nproc} is more than this machine's {cores} CPU core(s) can run "
                          f"(at most {limit} CPU ranks: {CPU_RANKS_PER_CORE} per core, or "
                          f"{CPU_RANKS_ALWAYS_ALLOWED}){hint}")


def nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(folder: Path, key: str) -> None:
    """`folder` can be created (or exists as a folder) and written to; names the path that is in the way."""
    folder = Path(folder)
    probe = Path(os.path.abspath(folder))
    parts = [probe, *probe.parents]
    for p in reversed(parts):  # from the root down: a file where a folder should be
        if p.exists() and not p.is_dir():
            raise UserError(f"{key}: {p} is a file, not a folder")
        if not p.exists():
            break
    existing = nearest_existing(folder)
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "is on a read-only file system" if _read_only(existing) else "is not writable"
        raise UserError(f"{key}: {existing} {reason}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@dataclass(frozen=True)
class RunFolder:
    """The run folder and what a run does to it: whether it resumes (checkpoint.resume: none, auto or a path) or
    starts over (run.overwrite), how many checkpoints it keeps, and the inputs it reads, by config key (run.overwrite
    never deletes a folder holding one)."""

    path: Path
    overwrite: bool = False
    resume: str = "none"
    keep: int = 1
    inputs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, cfg) -> RunFolder:
        inputs = {"data.dir": cfg.data.dir, "checkpoint.resume": cfg.checkpoint.resume,
                  "model.init_from": cfg.model.init_from.removeprefix("hf:")}
        inputs.update({f"data.sources[{i}]": s.get("dir", "") for i, s in enumerate(cfg.data.sources)
                       if isinstance(s, dict)})
        if cfg.data.source and cfg.data.source != "tinyshakespeare":
            inputs["data.source"] = cfg.data.source
        return cls(cfg.run_dir, cfg.run.overwrite, cfg.checkpoint.resume, cfg.checkpoint.keep,
                   tuple((k, str(v)) for k, v in inputs.items() if v and v not in ("none", "auto")))

    @property
    def starts_over(self) -> bool:
        """run.overwrite on a new run (a resumed run keeps its folder)."""
        return self.overwrite and self.resume == "none"


def check_run_folder(folder: RunFolder) -> None:
    """The run folder and its checkpoints folder can be written; its existing files are files."""
    check_writable_folder(folder.path / "checkpoints", "run.out_dir")
    for name in ("config.toml", "metrics.jsonl"):
        f = folder.path / name
        if f.is_dir():
            raise UserError(f"{f} is a folder; the run writes a file there")
        if f.exists() and not os.access(f, os.W_OK):
            raise UserError(f"{f} is not writable")


def existing_run_files(folder: RunFolder) -> list[str]:
    """What an earlier run left in this run's folder (empty: a new folder)."""
    if not folder.path.is_dir():
        return []
    return sorted(p.name for p in folder.path.iterdir())


def check_new_run(folder: RunFolder) -> None:
    """A new run (no resume) never writes into the folder of an earlier run: its config.toml, metrics.jsonl and
    checkpoints would be mixed with this one's. run.overwrite=true is the consent to delete that folder."""
    if folder.resume != "none" or folder.overwrite:
        return
    found = existing_run_files(folder)
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(f"{folder.path} already holds a run ({shown}): continue it with --checkpoint.resume=auto, "
                        f"start over with --run.overwrite=true (deletes it), or choose another --run.name")


def check_overwrite(folder: RunFolder) -> None:
    """run.overwrite deletes the run folder: never one that holds this run's own inputs."""
    if not folder.starts_over or not folder.path.exists():
        return
    for key, value in folder.inputs:
        if holds(folder.path, value):
            raise UserError(f"run.overwrite=true would delete {folder.path}, which holds {key}={value}; "
                            "move it out of the run folder first")


def start_over(folder: RunFolder, say=print) -> None:
    """run.overwrite=true on a first launch: delete what an earlier run left in the run folder, and `say` what."""
    import shutil  # lazy: the planner's commands import this module and delete nothing

    found = existing_run_files(folder) if folder.starts_over else []
    if not found:
        return
    summary = deleted_summary(folder.path, found)
    for name in found:  # (the folder itself stays: this run holds its lock, runlock.py)
        path = folder.path / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    say(f"run.overwrite: deleted {folder.path} ({summary})")


def deleted_summary(run_dir: Path, names: list[str]) -> str:
    """The run folder's entries `names` in a few words, its checkpoints by name: 'checkpoints step-10, step-20;
    config.toml, metrics.jsonl'. A long list shows its first and last names and its length."""
    ckpt = run_dir / "checkpoints"
    parts = []
    if "checkpoints" in names and ckpt.is_dir() and not ckpt.is_symlink():
        steps = sorted((p.name for p in ckpt.iterdir()), key=lambda n: (len(n), n))  # step-9 before step-10
        parts.append("checkpoints " + (_few(steps) if steps else "(none)"))
        names = [n for n in names if n != "checkpoints"]
    return "; ".join(parts + ([_few(names)] if names else []))


def _few(names: list[str], most: int = 4) -> str:
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most - 1])}, ..., {names[-1]} ({len(names)} in all)"


def check_ports(m, nproc: int) -> None:
    """The Prometheus port(s) the run will serve on are free now (checked again when bound)."""
    import socket  # lazy: only a run serving metrics binds a port

    check_metrics_config(m)  # the port's range, the host, prometheus_client installed
    if not m.prometheus_port:
        return
    ports = [m.prometheus_port + i for i in range(nproc)] if m.prometheus_per_rank else [m.prometheus_port]
    if ports[-1] > 65535:
        raise ConfigError(f"metrics.prometheus_port={m.prometheus_port} with prometheus_per_rank and {nproc} ranks "
                          f"needs ports up to {ports[-1]}, above 65535")
    for port in ports:
        try:
            infos = socket.getaddrinfo(m.prometheus_host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ConfigError(f"metrics.prometheus_host={m.prometheus_host}: cannot resolve it ({e.strerror})") from None
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server does
            try:
                s.bind(address)
            except OSError as e:
                raise ConfigError(f"metrics.prometheus_port: cannot serve metrics on {m.prometheus_host}:{port} "
                                  f"({e.strerror}); choose another port or set it to 0") from None


def check_launch(folder: RunFolder, device: str, metrics, nproc: int, oversubscribe: bool = False) -> None:
    """Everything about the machine (training.device, the `[metrics]` ports) and the paths a run can be refused for
    before anything is written (the data included); then `training.checkpoint.resume_path` looks at the checkpoint
    to resume from."""
    check_nproc(device, nproc, oversubscribe)
    check_run_folder(folder)
    check_new_run(folder)
    check_overwrite(folder)
    check_ports(metrics, nproc)


def checkpoint_bytes(model_args) -> int:
    """About one checkpoint: fp32 weights and AdamW's two fp32 moments (12 bytes per parameter)."""
    return 12 * count_params(model_args)


def warn_disk(folder: RunFolder, model_args, warn) -> None:
    """A warning when the run folder's disk cannot hold the checkpoints the run will keep."""
    import shutil

    need = checkpoint_bytes(model_args)
    where = nearest_existing(folder.path)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    keep = folder.keep + 1  # the ones kept, and the one being written
    if free < need * keep:
        warn(f"warning: {where} has {_size(free)} free; one checkpoint of this model is about {_size(need)} and "
             f"checkpoint.keep={folder.keep} keeps {keep - 1} plus the one being written: saves may fail with "
             f"a full disk")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_export_out(out: Path, reads, overwrite: bool) -> None:
    """An export's --out may be written: not a file, empty unless --overwrite, holding none of the (what, path) it
    `reads`, writable."""
    for what, path in reads:
        if path is not None and holds(out, path):
            raise UserError(f"--out {out} would delete {what} ({path}): choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder: choose a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    check_writable_folder(out, "--out")
