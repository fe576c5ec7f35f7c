"""Training-state checkpoints with torch.distributed.checkpoint (DCP).

Layout of a run's checkpoints:  RUN_DIR/checkpoints/step-N/
    *.distcp + .metadata   model and optimizer, keyed by parameter name and sharded as they live on
                           the ranks, so a checkpoint saved on one layout loads on any other
    trainer.pt             step, data position, learning-rate scheduler, RNG states, config, model dimensions
                           (weights_only loads it)
    meta.json + tokenizer  the tokenizer, so generation needs nothing but this folder
    CHECKSUMS              SHA-256 of every file above (`sha256sum -c CHECKSUMS` format; integrity.py)
    COMPLETE               written last; a folder without it was interrupted and is never loaded

A save is written to a hidden temporary folder and renamed into place only after every rank has
finished writing (synchronously, or in the background with `async_save`) and the files have been hashed.
A background save first copies the rank's state into staging buffers (shared host memory, pinned on a GPU machine;
kept for the run and reused by every save), so the write never reads a tensor the next steps change; the rank's
writer process (save_process.py) writes the shard files from them while the rank's background thread runs DCP's plan,
the hashing and the commit; one save is in flight at a time (the next one waits for it).
A save that fails (a full disk, a read-only folder) removes its temporary folder and is one error line naming the
cause. A checkpoint is trusted only when its marker is there, its shards are present at full length and every file
matches its checksum; older complete checkpoints are pruned only once a newer one is committed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from paratrain.capabilities import checkpoint_state
from paratrain.data import dataset_meta
from paratrain.data.tokenizers import load_tokenizer, tokenizer_identity
from paratrain.distributed.initialize import canonical_name
from paratrain.faults import FaultInjector
from paratrain.errors import PeerFailed, UserError, environment_problem, translated
from paratrain.files import replace_dir
from paratrain.hf.arch import resume_hint
from paratrain.models.args import ARCHITECTURE_KEYS, DEFAULT_FAMILY, fields_problem, is_int
from paratrain.capabilities.lora import record_problem
from paratrain.capabilities import OPTIMIZERS, optimizer_entry
from paratrain.optimizers import HIDDEN_STATE, OptimizerEntry
from paratrain.training import integrity, safe_dcp
from paratrain.training.save_process import StagedFileWriter, WriterProcess
from paratrain.training.optim import inner_optimizer, is_zero1

MARKER = "COMPLETE"
# DCP warns when used without a process group; one process is a supported layout here, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _on_main(is_main: bool, fn, group=None) -> None:
    """Run fn on rank 0 while the others wait; if it fails, every rank raises (rank 0 its error, the others
    PeerFailed), so no rank is left waiting for a dead one."""
    error = None
    if is_main:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others have been told
            error = e
    if dist.is_initialized():
        box = [error is not None]
        dist.broadcast_object_list(box, src=0, group=group)
        failed = box[0]
    else:
        failed = error is not None
    if error is not None:
        raise error
    if failed:
        raise PeerFailed("rank 0 failed while committing a checkpoint")


def _hash_my_share(folder: Path) -> dict | OSError:
    """SHA-256 of this rank's share of the files DCP wrote (every rank lists the same files once the save is done)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        return integrity.hash_files(folder, integrity.share(integrity.listed_files(folder), rank, world))
    except OSError as e:
        return e


def _gather_digests(mine: dict | OSError, group=None) -> dict[str, str]:
    """Every rank's share of the digests, on every rank (or the same error everywhere)."""
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine, group=group)
    if isinstance(mine, Exception):
        raise mine
    if any(isinstance(p, Exception) for p in parts):
        raise PeerFailed("another rank could not hash its part of the checkpoint")
    return {k: v for p in parts for k, v in p.items()}


def save_failure(final: Path, tmp: Path, error: BaseException) -> BaseException:
    """The error to raise for a failed save: one line naming the cause and the file when the environment is to
    blame (full disk, read-only or missing folder, permissions), else the error itself (a bug)."""
    problem = environment_problem(error, where=tmp)
    if problem is None or isinstance(error, PeerFailed):
        return error
    return UserError(f"cannot save checkpoint {final.name} in {final.parent}: {problem}; "
                     f"the partial save {tmp.name} was removed")


# -- what is saved ------------------------------------------------------------------------------

def _fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): canonical_name(n) for n, p in model.named_parameters()}


def _zero1_state(model: nn.Module, optimizer) -> dict:
    """ZeRO-1's moments in the same name-keyed form DCP uses for every other optimizer.

    Each rank contributes the entries of the parameters it owns; DCP stores the union, so the
    checkpoint is indistinguishable from an unsharded optimizer's and reshards like one.
    """
    names = _fqns(model)
    local = optimizer.optim
    state = {names[id(p)]: dict(local.state[p]) for g in local.param_groups for p in g["params"] if p in local.state}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _load_zero1_state(model: nn.Module, optimizer, path: Path, entry: OptimizerEntry) -> None:
    """Fill this rank's ZeRO-1 partition from a name-keyed optimizer checkpoint (from any layout); `entry` (the
    optimizer's registry entry) names the state each parameter has."""
    names = _fqns(model)
    local = optimizer.optim
    wanted = {names[id(p)]: p for g in local.param_groups for p in g["params"]}
    hidden = {id(p) for g in local.param_groups if g.get(HIDDEN_STATE) for p in g["params"]}
    template = {fqn: ({k: torch.empty_like(p, dtype=torch.float32) for k in entry.hidden_state} if id(p) in hidden
                      else {**{k: torch.empty_like(p, dtype=torch.float32) for k in entry.param_state},
                            **{k: torch.zeros((), dtype=torch.float32) for k in entry.scalar_state}})
                for fqn, p in wanted.items()}
    loaded = {"optim": {"state": template}}
    safe_dcp.load(loaded, path)
    for fqn, p in wanted.items():
        entry = loaded["optim"]["state"][fqn]
        local.state[p] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).to(p.device) for k, v in entry.items()}


def _options(model: nn.Module):
    """Frozen parameters (LoRA's base) are not saved: they come from the base at every start."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def model_optim_state(model: nn.Module, optimizer) -> dict:
    """Name-keyed state that DCP can save and reload on any layout (the trainable parameters: all of them, or
    LoRA's adapters)."""
    options = _options(model)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    elif is_zero1(optimizer):
        state = {"model": get_model_state_dict(model, options=options), "optim": _zero1_state(model, optimizer)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    return checkpoint_state(state)  # (plain tensors where a capability wraps parameters or their states)


# -- saving -------------------------------------------------------------------------------------

class CheckpointWriter:
    """Saves step-N folders; with `async_save`, the state is staged (copied to host buffers), then the write and the
    hashing happen in the background and the folder is committed (checksums + marker + rename) at a later step
    boundary once every rank has finished both."""

    def __init__(self, ckpt_root: Path, keep: int, is_main: bool, async_save: bool = False, tokenizer=None):
        self.root, self.keep, self.is_main, self.async_save = ckpt_root, keep, is_main, async_save
        self.tokenizer = tokenizer
        self.pending: _PendingSave | None = None
        # Background writes run their own collectives: on the training group they would interleave with
        # the training step's collectives and deadlock, so they get a dedicated gloo group.
        self.group = dist.new_group(backend="gloo") if (async_save and dist.is_initialized()) else None
        self.stager = staging_buffers() if async_save else None
        # DCP's write of the staged copy, the hashing and rank 0's commit run on one thread of their own (over
        # self.group), kept for the run, at the lowest CPU priority: the training steps pay only the staging copy
        # (bench/checkpoint_async.py)
        self._background = ThreadPoolExecutor(1, thread_name_prefix="paratrain-save",
                                              initializer=_lowest_priority) if async_save else None
        # The shard files of background saves are written by a process of this rank's (its own GIL), started at the
        # first background save (runs that never save in the background never start one) and ended by close()
        self._child: list[WriterProcess] = []  # (a list: shared with the finalizer, which must not hold self)
        self._closer = weakref.finalize(self, _close_child, self._child, self._background)  # (a run that ends by an
        # error: when the writer is collected; multiprocessing ends it at the interpreter's exit, the kernel at the
        # rank's death)
        self.faults = FaultInjector(dist.get_rank() if dist.is_initialized() else 0)  # (tests: PARATRAIN_FAULTS)

    def save(self, step: int, model: nn.Module, optimizer, trainer_state: dict, extra: dict | None = None,
             background: bool | None = None) -> Path:
        """`extra`: more tensors under their own top-level keys (this rank's gradient-compression state).
        `background`: write in the background (default: `async_save`); False writes and commits before returning
        (a preemption's save, whose grace period must not end with the write in flight)."""
        self.finish()  # never two saves in flight
        background = self.async_save if background is None else background
        tmp = self.root / f".step-{step}.tmp"

        def prepare():
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)

        with self._saving(step, tmp):
            _on_main(self.is_main, prepare)
            _barrier()
            state = {**model_optim_state(model, optimizer), **(extra or {})}
            writer = StagedFileWriter(tmp, step, self.faults) if self.faults else None
            if background and self.stager is not None:
                # staged here, on this thread (the copy is finished when stage returns: the next steps may change
                # the tensors), then written from the staging buffers by the writer process
                staged = self.stager.stage(state)
                writer = StagedFileWriter(tmp, step, self.faults or None, self._writer_process())
                self.pending = _PendingSave(step, self._background.submit(self._in_background, staged, step, tmp,
                                                                          trainer_state, writer))
                return self.root / f"step-{step}"
        return self._write_and_commit(state, step, tmp, trainer_state, writer)

    def poll(self) -> None:
        """At a step boundary: a background save that every rank has written, hashed and committed is done (an error
        is raised here, on every rank at the same step)."""
        p = self.pending
        if p is None:
            return
        done = torch.tensor([1.0 if p.done.done() else 0.0])
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight, if any (committed when this returns; its error raised)."""
        p, self.pending = self.pending, None
        if p is not None:
            p.done.result()

    def close(self) -> None:
        """At the end of the run: the save in flight finished, the writer process ended (no process outlives the
        run)."""
        try:
            self.finish()
        finally:
            self._closer()

    def _writer_process(self) -> WriterProcess:
        """The writer process, started on this thread (the training loop's: the kernel ends the process when the
        thread that started it ends), again if it died."""
        if self._child and not self._child[0].alive:
            self._child.pop().close()
        if not self._child:
            self._child.append(WriterProcess())
        return self._child[0]

    def _in_background(self, staged: dict, step: int, tmp: Path, trainer_state: dict, writer) -> Path:
        """On the background thread (the lowest CPU priority), over the save's own group. Its Python (DCP's plan, one
        torch.save per tensor) takes the GIL in turns with the training thread, which waits up to the interpreter's
        switch interval each time it wants it back (after the backward, which releases it): 1 ms instead of 5 while a
        save is in flight (bench/checkpoint_async.py)."""
        before = sys.getswitchinterval()
        sys.setswitchinterval(min(before, 0.001))
        try:
            return self._write_and_commit(staged, step, tmp, trainer_state, writer, self.group)
        finally:
            sys.setswitchinterval(before)

    def _write_and_commit(self, state: dict, step: int, tmp: Path, trainer_state: dict, writer, group=None) -> Path:
        """DCP's write, this rank's share of the files hashed, then the commit; over `group` (the background save's
        own, on its thread; every rank raises the same error if any part fails on some rank)."""
        with self._saving(step, tmp):
            # returns on every rank once all shards and .metadata are written
            dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=group)
            digests = _gather_digests(_hash_my_share(tmp), group)  # read back from the page cache
        return self._commit(step, tmp, trainer_state, digests, group)

    def _saving(self, step: int, tmp: Path):
        """Around each part of a save: when it fails on some rank, every rank removes what was written (the folder
        is shared) and raises; the cause is read first (the removal frees the disk again)."""
        return translated(lambda error: save_failure(self.root / f"step-{step}", tmp, error),
                          cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))

    def _commit(self, step: int, tmp: Path, trainer_state: dict, digests: dict[str, str], group=None) -> Path:
        """Rank 0 adds trainer.pt and the tokenizer, lists every file's checksum, writes the marker and renames."""
        final = self.root / f"step-{step}"

        def publish():
            torch.save(trainer_state, tmp / "trainer.pt")
            if self.tokenizer is not None:
                self.tokenizer.save(tmp)
            extras = [n for n in integrity.listed_files(tmp) if n not in digests]
            _fsync_files(tmp, extras)  # (DCP's shards and .metadata are fsynced by DCP itself: sync_files)
            integrity.write_checksums(tmp, {**digests, **integrity.hash_files(tmp, extras)})
            (tmp / MARKER).write_text(f"{step}\n")
            replace_dir(tmp, final)  # the same step may be saved again (after a rollback)
            prune(self.root, self.keep, final)

        with self._saving(step, tmp):
            _on_main(self.is_main, publish, group)
        _barrier(group)
        return final


def staging_buffers() -> DefaultStager:
    """DCP's stager for background saves: pinned host memory where CUDA is (the device-to-host copy at full speed,
    non-blocking, then one synchronize), a plain host copy on a CPU-only machine. Staging is synchronous (the copy is
    finished before training goes on, so the write never reads a tensor a later step changes) and its buffers are
    kept and reused by every save: host memory of the rank's checkpointed state (the estimator's "checkpoint
    staging")."""
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


@dataclass
class _PendingSave:
    """A background save: its step, and the committer thread's future (the step-N folder, once committed)."""

    step: int
    done: Future


def _close_child(child: list[WriterProcess], background: ThreadPoolExecutor | None) -> None:
    while child:
        child.pop().close()
    if background is not None:
        background.shutdown(wait=False)


def _lowest_priority() -> None:
    """Run by the background save's thread: on Linux a thread has its own nice value, so the save takes only the CPU
    the training step leaves (on a shared or busy host; on a GPU machine the host's cores are mostly idle anyway)."""
    if sys.platform.startswith("linux"):  # (elsewhere the id names no thread to setpriority: left as it is)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # (a sandbox that forbids it: the save still works, at the process's priority)
            pass


def _fsync_files(folder: Path, names: list[str]) -> None:
    for name in names:
        with open(folder / name, "rb") as fh:
            os.fsync(fh.fileno())


# -- finding a checkpoint to resume -------------------------------------------------------------

def checkpoint_problem(path: Path, index: int = 0, count: int = 1, checksums: bool = True) -> str | None:
    """Why `path` is not a loadable checkpoint, or None if it is complete and its files are intact: the marker,
    trainer.pt, the DCP metadata (its checksum first: it is a pickle), every shard present at full length, and every
    file against CHECKSUMS. With count > 1 this call hashes only its share (index) of the files; checksums=False
    leaves out all but the metadata's (a quick look)."""
    if not path.is_dir():
        return "not a folder" if path.exists() else "no such folder"
    if not (path / MARKER).exists():
        started = any((path / name).exists() for name in (".metadata", "trainer.pt")) or any(path.glob("*.distcp"))
        return resume_hint(path) or (f"no {MARKER} marker (the save was interrupted)" if started else
                                     f"no checkpoint was ever saved there (no step-N folder, no {MARKER} marker)")
    if not (path / "trainer.pt").exists():
        return "missing trainer.pt"
    digests = integrity.read_checksums(path)
    if isinstance(digests, str):
        return digests
    names = []
    if digests is not None:
        names = sorted(digests)
        if ".metadata" in digests:
            problems = integrity.verify_files(path, digests, [".metadata"])
            if problems:
                return problems[0]
            names.remove(".metadata")
    try:
        metadata = safe_dcp.read_metadata(path)  # an allow-list unpickler: no code from the file runs
    except safe_dcp.MetadataProblem as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same problem to the user
        return f"unreadable DCP metadata ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        f = path / name
        if not f.exists():
            return f"missing shard {name}"
        if f.stat().st_size < size:
            return f"truncated shard {name} ({f.stat().st_size} of {size} bytes)"
    try:
        safe_dcp.check_byte_entries(path, metadata)  # small pickles of plain data, read with weights_only
    except safe_dcp.MetadataProblem as e:
        return str(e)
    except OSError as e:
        return f"cannot read {Path(e.filename or '').name or 'a shard'} ({e.strerror or e})"
    if digests is None or not checksums:
        return None  # saved before checksums: sizes are all that can be checked
    if missing := sorted(set(needed) - set(digests)):
        return f"{integrity.CHECKSUMS} does not list shard {missing[0]}"
    problems = integrity.verify_files(path, digests, integrity.share(names, index, count))
    if problems:
        return "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    return None


def run_identity(tokenizer, data_cfg) -> dict:
    """{"tokenizer_sha256", "data_sha256"}: the hash of the tokenizer's vocabulary and special tokens, and of the
    data it was applied to (the prepared datasets' sources and token counts)."""
    import hashlib
    import json


    out = {}
    if tokenizer is not None:
        out["tokenizer_sha256"] = tokenizer_identity(tokenizer)
    try:
        meta = dataset_meta(data_cfg)
    except UserError:
        return out
    parts = [[m.get("dir"), m.get("weight")] for m in meta.get("mixture", [])] or [[meta.get("source_sha256"),
                                                                                    meta.get("train_tokens")]]
    out["data_sha256"] = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return out


def step_folders(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    return [p for p in step_folders(ckpt_root) if (p / MARKER).exists()]


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def prune(ckpt_root: Path, keep: int, current: Path) -> None:
    """After `current` was committed: delete the complete checkpoints older than the `keep` newest up to it. Never
    `current`, and never a newer one (left when a run resumed from an older checkpoint, e.g. because the newer ones
    failed their checksums): the last good checkpoint is never deleted."""
    upto = [p for p in complete_checkpoints(ckpt_root) if step_of(p) <= step_of(current)]
    for old in upto[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def tidy(ckpt_root: Path, warn) -> None:
    """At the start of a run (rank 0): remove the temporary folders of interrupted saves, and put back a checkpoint
    that a save of the same step had moved aside when it was interrupted before the new one was in place."""
    if not ckpt_root.is_dir():
        return
    for p in sorted(ckpt_root.iterdir()):
        m = re.match(r"^\.(step-\d+)\.(tmp|old)$", p.name)
        if not m or not p.is_dir():
            continue
        final = ckpt_root / m.group(1)
        if m.group(2) == "old" and not final.exists() and (p / MARKER).exists():
            os.replace(p, final)
            warn(f"warning: restored {final} (a save of the same step was interrupted)")
        else:
            shutil.rmtree(p, ignore_errors=True)
            if m.group(2) == "tmp":
                warn(f"warning: removed {p.name}, the partial folder of an interrupted save")


def newest_valid_checkpoint(ckpt_root: Path, warn=None, problem=checkpoint_problem) -> Path | None:
    """The newest loadable checkpoint; each newer one that is skipped is reported with its reason."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for path in reversed(step_folders(ckpt_root)):
        why = problem(path)
        if why is None:
            return path
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def resolve_resume(resume: str, ckpt_root: Path, warn=None, problem=checkpoint_problem) -> Path | None:
    """`none` -> None, `auto` -> newest valid checkpoint (None if there is none), else a path that must be valid."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_valid_checkpoint(ckpt_root, warn, problem)
    path = Path(resume)
    why = problem(path)
    if why:
        raise UserError(f"checkpoint.resume={path} is not a usable paratrain checkpoint: {why}")
    return path


def model_mismatch(trainer_state: dict, model_args) -> str | None:
    """How the model saved in a checkpoint differs from `model_args` (a ModelArgs), or None."""
    saved = trainer_state.get("model_args")
    if not isinstance(saved, dict):
        return "its trainer.pt has no model dimensions"
    ours = dataclasses.asdict(model_args)
    # saved before families had names, before blocks could be dense by index, before a key existed: its default
    saved = {**{f.name: f.default for f in dataclasses.fields(model_args) if f.name in ARCHITECTURE_KEYS
                and f.default is not dataclasses.MISSING}, "family": DEFAULT_FAMILY, "moe_dense_layers": (), **saved}
    saved["moe_dense_layers"] = tuple(saved["moe_dense_layers"])
    diffs = [f"{k} {saved.get(k)} (this run: {ours.get(k)})" for k in ARCHITECTURE_KEYS if saved.get(k) != ours.get(k)]
    return "it holds another model: " + ", ".join(diffs) if diffs else None


def lora_base(cfg) -> str:
    """The frozen base a LoRA run's adapters belong to: its Hugging Face folder, or the preset's seeded weights."""
    return cfg.model.init_from or f"preset {cfg.model.preset}, seed {cfg.training.seed}"


def lora_mismatch(trainer_state: dict, spec) -> str | None:
    """How a checkpoint's adapters differ from what this run trains (other adapters, another base, none), or None."""
    saved, ours = trainer_state.get("lora"), spec.lora.record() if spec.lora is not None else None

    def described(record) -> str:
        return f"rank {record['rank']} adapters on {','.join(record['targets'])}" if record else "no adapters"

    if saved != ours:
        return f"it holds {described(saved)} (this run: {described(ours)}; see [lora])"
    if ours is not None and trainer_state.get("lora_base") != lora_base(spec.cfg):
        return (f"its adapters belong to the base {trainer_state.get('lora_base')!r}, this run's base is "
                f"{lora_base(spec.cfg)!r}")
    return None


# -- loading ------------------------------------------------------------------------------------

def resume_path(folder) -> Path | None:
    """The checkpoint a run (its `preflight.RunFolder`) would resume from, at a quick look before launch (marker,
    files, sizes; checksums are left to the ranks, which verify before loading and, for auto, fall back to an older
    one)."""
    if folder.resume == "none":
        return None
    if folder.resume == "auto":
        found = complete_checkpoints(folder.path / "checkpoints")
        return found[-1] if found else None
    path = Path(folder.resume)
    problem = checkpoint_problem(path, checksums=False)
    if problem:
        raise UserError(f"checkpoint.resume={path} is not a usable paratrain checkpoint: {problem}")
    return path


def check_resume(folder, model_args) -> None:
    """The checkpoint `checkpoint.resume` names (or the newest complete one, for auto) holds this run's model."""
    path = resume_path(folder)
    if path is None:
        return
    mismatch = model_mismatch(load_trainer_state(path), model_args)
    if mismatch:
        raise UserError(f"cannot resume from {path}: {mismatch}; resume from a checkpoint of this model, or give "
                        "this run another run.name")


def load_trainer_state(path: Path) -> dict:
    """trainer.pt (weights_only: plain data and tensors), every field checked; a one-line UserError naming the field
    otherwise."""
    try:
        state = torch.load(path / "trainer.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise UserError(f"{path}: cannot read trainer.pt ({type(e).__name__})") from None
    problem = trainer_state_problem(state)
    if problem:
        raise UserError(f"{path / 'trainer.pt'}{problem}")
    return state


def trainer_state_problem(state) -> str | None:
    """What is wrong with a trainer.pt's content (': field ...', or ' holds ...'), or None."""
    if not isinstance(state, dict):
        return f" holds a {type(state).__name__}, not the trainer's state"
    counts = {"step": 0, "data_step": 0, "skipped_steps": 0, "micro_batch": 1, "accum_steps": 1, "seq_len": 1}
    for key, low in counts.items():
        if key in state or key == "step":
            value = state.get(key)
            if not is_int(value) or value < low:
                return f": {key} must be an integer >= {low}, got {value!r}"
    if "model_args" in state:
        why = fields_problem(state["model_args"], "model_args.")
        if why:
            return f": {why}"
    skip = state.get("skip_batches", [])
    if not isinstance(skip, (list, tuple)) or not all(is_int(b) and b >= 0 for b in skip):
        return ": skip_batches must be a list of batch numbers"
    for key in ("config_toml", "tokenizer_sha256", "data_sha256", "optimizer", "lora_base"):
        if key in state and not isinstance(state[key], str):
            return f": {key} must be a string, got {type(state[key]).__name__}"
    if "lora" in state:
        why = record_problem(state["lora"])
        if why:
            return f": lora.{why}"
    for key in ("rng_cpu", "rng_cuda"):
        if key in state and not (isinstance(state[key], torch.Tensor) and state[key].dtype == torch.uint8):
            return f": {key} must be a byte tensor (an RNG state)"
    return None


def load_checkpoint(path: Path, model: nn.Module, optimizer, entry: OptimizerEntry = OPTIMIZERS["adamw"]) -> dict:
    """Load model (+ optimizer, of registry entry `entry`) in place, whatever layout saved them; returns the trainer
    state."""
    trainer_state = load_trainer_state(path)
    options = _options(model)
    if optimizer is not None and is_zero1(optimizer):
        state = {"model": model_optim_state(model, None)["model"]}
        safe_dcp.load(state, path)
        set_model_state_dict(model, state["model"], options=options)
        _load_zero1_state(model, optimizer, path, entry)
        return trainer_state
    state = model_optim_state(model, optimizer)
    safe_dcp.load(state, path)
    if "optim" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    return trainer_state


def full_weights(model: nn.Module, pp_group=None) -> dict:
    """Every parameter's whole value, by name, on every rank (a collective); pipeline stages are merged over the
    pp group."""
    if pp_group is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    mine = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    parts = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in mine.items()}, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}


def export_safetensors(model: nn.Module, out_file: Path, is_main: bool) -> Path | None:
    """Consolidated (unsharded) weights as one safetensors file; every rank takes part in the gather."""
    from safetensors.torch import save_file

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    tensors, seen = {}, {}
    for name, t in full.items():
        key = t.data_ptr()
        if key in seen:  # tied weights: safetensors refuses shared storage, keep one name
            continue
        seen[key] = name
        tensors[name] = t.contiguous()
    tmp = out_file.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "tied": ",".join(sorted(set(full) - set(tensors)))})
    os.replace(tmp, out_file)
    return out_file


# -- the run's side of checkpointing ------------------------------------------------------------

@dataclass
class Progress:
    """Where a run is, beyond its weights: saved in every checkpoint so a resumed run continues exactly."""

    micro_batch: int  # the batch split can change at run time (out-of-memory adaptation); the global batch never
    accum_steps: int
    data_step: int = 0  # the next batch to read: optimizer step t reads batch data_step
    skip_batches: set = field(default_factory=set)  # batches a rollback found bad; never read again
    skipped: int = 0  # updates skipped for a non-finite loss or gradient norm

    def next_batch(self) -> int:
        while self.data_step in self.skip_batches:
            self.data_step += 1
        return self.data_step

    def state(self) -> dict:
        return {"data_step": self.data_step, "skip_batches": sorted(self.skip_batches), "micro_batch": self.micro_batch,
                "accum_steps": self.accum_steps, "skipped_steps": self.skipped}

    def load(self, state: dict, step: int) -> None:
        self.data_step = int(state.get("data_step", step))
        self.skip_batches |= set(int(b) for b in state.get("skip_batches", []))
        self.skipped = int(state.get("skipped_steps", 0))
        if "micro_batch" in state and int(state["micro_batch"]) < self.micro_batch:
            # an earlier out-of-memory adaptation of this run still applies
            self.micro_batch, self.accum_steps = int(state["micro_batch"]), int(state["accum_steps"])


def nonfinite_state(model: nn.Module, optimizer) -> str | None:
    """The first of this run's parameters or optimizer-state tensors that holds a NaN or an infinity on some rank (its
    name and the rank), the same answer on every rank; None when every one is finite. Each rank checks its own shards
    with one device-to-host read; one all-gather of the answers."""
    named = [(f"parameter {name}", p.detach()) for name, p in model.named_parameters()]
    for i, state in enumerate(inner_optimizer(optimizer).state.values()):
        named += [(f"optimizer state {key} of parameter {i}", t) for key, t in state.items()
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
    locals_ = [(name, t.to_local() if isinstance(t, DTensor) else t) for name, t in named]
    # (a quantized state is a tensor subclass: its dequantized values are checked where it can give them)
    checked = [(name, t) for name, t in locals_ if type(t) in (torch.Tensor, nn.Parameter) and t.numel()]
    mine = None
    if checked:
        device = checked[0][1].device
        finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in checked]).tolist()
        mine = next((name for (name, _), ok in zip(checked, finite) if not ok), None)
    if not dist.is_initialized():
        return mine
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, mine)
    return next((f"{name} (rank {rank})" for rank, name in enumerate(answers) if name is not None), None)


class Checkpointer:
    """Saves, resumes and rolls back one run's training state (model, optimizer, progress, RNG, config)."""

    def __init__(self, spec, model: nn.Module, optimizer, progress: Progress, is_main: bool, tokenizer, config_toml: str,
                 notice=print, warn=None, comm=None, scheduler=None):
        cfg = spec.cfg
        self.spec, self.model, self.optimizer, self.progress = spec, model, optimizer, progress
        self.scheduler = scheduler  # the learning-rate scheduler (training/optim.py WarmupCosine): saved in trainer.pt
        self.comm = comm  # distributed.compression.GradComm: error feedback and PowerSGD state, saved per rank
        self.root, self.config_toml, self.notice = cfg.run_dir / "checkpoints", config_toml, notice
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.writer = CheckpointWriter(self.root, cfg.checkpoint.keep, is_main, cfg.checkpoint.async_save, tokenizer)
        self.last_save: dict | None = None  # the last save's duration and step, reported once in the next record
        self.last_save_at = time.monotonic()  # checkpoint.every_minutes counts from the start and from each save
        self.save_asked = False  # the wall-clock timer ran out on some rank: every rank saves after this step
        self.saved_path: Path | None = None  # this run's newest save
        # What makes a resumed run the same run: the ids (the tokenizer) and the data they index.
        self.identity = run_identity(tokenizer, cfg.data)

    def due(self, step: int) -> bool:
        every = self.spec.cfg.checkpoint.every
        return (self.save_asked or bool(every) and step % every == 0) and step < self.spec.cfg.training.steps

    def timer_ran_out(self) -> bool:
        """checkpoint.every_minutes have passed since the start or the last save, on this rank's clock (the ranks
        agree on it through `ResilienceGuard.at_boundary`)."""
        minutes = self.spec.cfg.checkpoint.every_minutes
        return minutes > 0 and time.monotonic() - self.last_save_at >= minutes * 60

    def save(self, next_step: int, background: bool | None = None) -> Path:
        """`background`: CheckpointWriter.save's (None: checkpoint.async_save)."""
        bad = nonfinite_state(self.model, self.optimizer)
        if bad is not None:  # a checkpoint is what a run goes back to: never one that cannot train
            raise UserError(f"checkpoint at step {next_step} refused: {bad} holds a NaN or an infinity; the "
                            f"checkpoints in {self.root} are kept as they were")
        start = time.perf_counter()
        extra = self.comm.state_dict() if self.comm is not None else None
        path = self.writer.save(next_step, self.model, self.optimizer, self._state(next_step), extra, background)
        self.last_save = {"checkpoint_save_s": time.perf_counter() - start, "checkpoint_step": next_step}
        self.last_save_at, self.save_asked, self.saved_path = time.monotonic(), False, path
        return path

    def take_save(self) -> dict:
        """The keys of the save made since the last call ({} if none), for the metrics record."""
        saved, self.last_save = self.last_save or {}, None
        return saved

    def _state(self, next_step: int) -> dict:
        state = {"step": next_step, **self.progress.state(), "rng_cpu": torch.get_rng_state(),
                 "seq_len": self.spec.cfg.training.seq_len, "config_toml": self.config_toml,
                 "optimizer": self.spec.cfg.optimizer.name,
                 "model_args": dataclasses.asdict(self.spec.model_args), **self.identity}
        if self.spec.lora is not None:  # the adapters, and the base they belong to (not saved: it never changes)
            state.update(lora=self.spec.lora.record(), lora_base=lora_base(self.spec.cfg))
        if self.scheduler is not None:
            state["lr_scheduler"] = self.scheduler.state_dict()
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def restore(self, path: Path) -> int:
        """Load a checkpoint (saved on any layout) into this run; returns its step."""
        saved = load_trainer_state(path)
        mismatch = (model_mismatch(saved, self.spec.model_args) or self._tokenizer_mismatch(saved, path)
                    or lora_mismatch(saved, self.spec))
        if mismatch:
            raise UserError(f"cannot resume from {path}: {mismatch}; resume from a checkpoint of this model, or "
                            "give this run another run.name")
        ours, theirs = self.spec.cfg.optimizer.name, saved.get("optimizer", "adamw")  # older: AdamW, the only one
        if theirs != ours:
            raise UserError(f"cannot resume from {path}: it holds the state of optimizer.name={theirs} (this run: "
                            f"{ours}); resume with optimizer.name={theirs}, or give this run another run.name")
        if saved.get("data_sha256") not in (None, self.identity.get("data_sha256")):
            self.warn(f"warning: {path} was trained on other data than data.dir={self.spec.cfg.data.dir} holds now "
                      "(another corpus, or the same one prepared again): the batches after the resume differ")
        def unreadable(error: BaseException) -> UserError | None:
            refused = safe_dcp.refused_entry(error)
            problem = str(refused) if refused is not None else environment_problem(error)
            return None if problem is None else UserError(f"cannot read checkpoint {path}: {problem}")

        with translated(unreadable):
            state = load_checkpoint(path, self.model, self.optimizer, optimizer_entry(ours))
            self._restore_comm(path)
        step = int(state["step"])
        self.progress.load(state, step)
        if self.scheduler is not None:  # after the optimizer's state: the lr of the next update, whatever was loaded
            self.scheduler.load_state_dict(state.get("lr_scheduler", {"last_epoch": step}))  # older: from the step
        torch.set_rng_state(state["rng_cpu"])
        return step

    def _tokenizer_mismatch(self, saved: dict, path: Path) -> str | None:
        """Why the checkpoint's tokenizer is not this run's (its ids mean other text), or None. Checkpoints that
        predate the recorded identity are compared through the tokenizer files saved beside them."""
        ours = self.identity.get("tokenizer_sha256")
        theirs = saved.get("tokenizer_sha256")
        if theirs is None and (path / "meta.json").is_file():
            theirs = tokenizer_identity(load_tokenizer(path))
        if ours is None or theirs is None or theirs == ours:
            return None

        tok, mine = load_tokenizer(path) if (path / "meta.json").is_file() else None, self.writer.tokenizer
        said = f" ({tok.kind}, vocab {tok.vocab_size})" if tok is not None else ""
        same = " with the same vocabulary size but other ids" if tok is not None and \
            tok.vocab_size == mine.vocab_size else ""
        return (f"it was trained with another tokenizer{said} than data.dir={self.spec.cfg.data.dir} uses "
                f"({mine.kind}, vocab {mine.vocab_size}){same}")

    def problem(self, path: Path) -> str | None:
        """checkpoint_problem agreed by every rank, each hashing a share of the files."""
        if not dist.is_initialized():
            return checkpoint_problem(path)
        mine = checkpoint_problem(path, dist.get_rank(), dist.get_world_size())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return next((p for p in every if p), None)
    def _restore_comm(self, path: Path) -> None:
        """This rank's compression state, when the checkpoint was saved by the same method on the same world size
        (error feedback is per rank); otherwise it starts from zero, said once."""
        if self.comm is None or not self.comm.has_state:
            return
        saved = self.comm.saved_keys(safe_dcp.read_metadata(path))
        found = torch.tensor([1.0 if saved else 0.0])
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
        if found.item() == 0.0:
            self.notice(self.comm.missing_state(path))
            return
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
        safe_dcp.load(state, path)
        self.comm.load_state_dict(state)

    def resume(self, restarted: bool) -> int:
        """The step to start from: checkpoint.resume (auto after a relaunch), else 0."""
        resume = self.spec.cfg.checkpoint.resume
        if resume == "none" and restarted:
            resume = "auto"  # a relaunch after a crash continues from the newest checkpoint
        if self.writer.is_main:
            tidy(self.root, self.warn)
        _barrier()
        path = resolve_resume(resume, self.root, warn=self.warn, problem=self.problem)
        self.last_save_at = time.monotonic()  # the wall-clock timer counts training, not start-up
        if path is None:
            if resume == "auto":  # a person who asked to continue must learn that nothing was there
                self.notice(f"no checkpoint in {self.spec.cfg.run_dir}: starting from step 0")
            return 0
        step = self.restore(path)
        self.notice(f"resumed from {path} at step {step}")
        return step

    def rollback(self, bad_batches: list[int]) -> int | None:
        """After repeated non-finite steps: reload the newest checkpoint and never use those batches again."""
        self.writer.finish()
        path = newest_valid_checkpoint(self.root, warn=self.warn, problem=self.problem)
        if path is None:
            return None
        self.progress.skip_batches |= set(bad_batches)
        skipped = self.progress.skipped
        step = self.restore(path)  # adds the checkpoint's own skip list to ours
        self.progress.skipped = max(skipped, self.progress.skipped)  # the steps skipped stay counted: never backwards
        self.notice(f"rolled back to {path} (step {step}); skipping batches {sorted(bad_batches)}")
        return step

    def poll(self) -> None:
        self.writer.poll()

    def finish(self) -> None:
        self.writer.finish()

    def close(self) -> None:
        """At the end of the run (the background save's writer process ended)."""
        self.writer.close()
