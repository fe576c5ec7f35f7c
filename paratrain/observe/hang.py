"""Hang diagnosis: every rank's recent collectives, dumped when a collective times out and read back by
`paratrain doctor --hang RUN_DIR`.

torch's flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives of each process (op, sizes, dtypes, process
group, sequence number in the group, the Python stack that issued it), on gloo as on NCCL; paratrain turns it on
(`distributed/env.py`: COLLECTIVE_HISTORY entries, unless the variable is set) before its process group starts.
When a collective fails (a timeout, or a peer gone), the rank writes its record to RUN_DIR/hang/rank<r>.json at
once, with the step it was in, its main thread's Python stack, the process groups it belongs to and the state of
the ranks on its host (running, stopped, gone: a SIGSTOPped rank cannot write its own); it then asks its local
peers to write theirs (SIGUSR2: a thread answers it, so a rank blocked inside a collective answers too) and waits a
few seconds for them before they are stopped. SIGUSR2 from outside (`kill -USR2 PID`) makes a running rank write
its record the same way, without stopping anything.

`diagnose` reads the records: the op each rank waits in (its newest one the recorder has not seen complete) and
the ranks of that op's group that have not joined it (no record, or fewer collectives issued in that group); the
rank among those that waits for no one else (or wrote nothing) is the one to look at.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import torch
from torch.distributed import distributed_c10d
import torch.distributed as dist

from paratrain.distributed.env import HISTORY_ENV, local_peer_pids
from paratrain.errors import UserError

FOLDER = "hang"
PEER_WAIT_S = 5.0  # how long the rank that noticed waits for its local peers' records
_STEP: list[int | None] = [None]  # the step this process is in (set by the trainer, read by a dump)
_FAILED = [False]  # this process wrote the record of its own failed collective
# One record at a time per process: the main thread's (its collective failed) and the watcher thread's (a peer's
# SIGUSR2 request) can coincide, and must not write the same temporary file at once.
_WRITING = threading.Lock()
_ENTRY_FIELDS = ("pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes",
                 "input_dtypes", "output_sizes", "output_dtypes", "state", "retired", "is_p2p", "time_created_ns")
# c10's scalar type names without a width in them; the others carry theirs (BFloat16, the 8-bit floating types, ...)
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a flight-recorder dtype name (4 where it is not known)."""
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    width = re.match(r"[A-Za-z]+(\d+)", name)
    return int(width.group(1)) // 8 if width and int(width.group(1)) >= 8 else 4


def at_step(step: int) -> None:
    _STEP[0] = step


# -- writing ---------------------------------------------------------------------------------------

def _flight_record() -> dict:
    """torch's flight recorder of this process: {pg_status, entries} (empty when it keeps none)."""
    import pickle

    try:  # the bytes come from torch in this process, not from a file
        raw = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    except (AttributeError, RuntimeError, pickle.UnpicklingError):
        return {"pg_status": {}, "entries": []}
    entries = []
    for e in raw.get("entries", []):
        entry = {k: e.get(k) for k in _ENTRY_FIELDS}
        entry["process_group"] = list(entry["process_group"] or ())
        entry["frames"] = [{"name": f.get("name"), "file": f.get("filename"), "line": f.get("line")}
                           for f in (e.get("frames") or [])]
        entries.append(entry)
    return {"pg_status": raw.get("pg_status", {}), "entries": entries}


def _groups() -> dict[str, dict]:
    """Every process group this rank belongs to, by name: its description (mesh_tp, ...) and global ranks (the
    flight recorder names a collective's group but not its ranks)."""

    out = {}
    for pg, name in list(distributed_c10d._world.pg_names.items()):
        try:
            out[str(name)] = {"desc": str(getattr(pg, "group_desc", "") or ""),
                              "ranks": dist.get_process_group_ranks(pg)}
        except (RuntimeError, ValueError):  # a group this rank is not part of
            continue
    return out


def _main_stack() -> list[str]:
    import threading
    import traceback

    frame = sys._current_frames().get(threading.main_thread().ident)
    return [line.rstrip() for line in traceback.format_stack(frame)[-12:]] if frame is not None else []


def _local_peers() -> dict[int, dict]:
    """The ranks on this host other than this one: {rank: {pid, state}}."""
    import psutil

    peers = {}
    for rank, pid in local_peer_pids(timeout_s=2).items():
        try:
            state = psutil.Process(pid).status()
        except psutil.Error:
            state = "gone"
        peers[rank] = {"pid": pid, "state": state}
    return peers


def dump(run_dir: Path, reason: str, peers: dict | None = None, failed: bool = False) -> Path | None:
    """Write this rank's collective history to RUN_DIR/hang/rank<r>.json (atomically); None without a process group,
    or when it cannot be written. `failed`: this rank's own collective failed (a later request from a peer keeps
    that record). Never raises: it runs on the failure path and in the signal thread."""
    try:
        with _WRITING:
            return _dump(run_dir, reason, peers, failed)
    except Exception:  # noqa: BLE001 - a record that cannot be made must not change how the run ends
        return None


def _dump(run_dir: Path, reason: str, peers: dict | None, failed: bool) -> Path | None:
    if not dist.is_initialized() or (_FAILED[0] and not failed):
        return None
    _FAILED[0] = _FAILED[0] or failed
    rank = dist.get_rank()
    record = {"paratrain_hang_dump": 1, "rank": rank, "world_size": dist.get_world_size(), "pid": os.getpid(),
              "host": socket.gethostname(), "time": time.time(), "step": _STEP[0], "reason": reason,
              "history": os.environ.get(HISTORY_ENV, "0"), "peers": peers or {}, "main_stack": _main_stack(),
              "groups": _groups(), **_flight_record()}
    folder = Path(run_dir) / FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        tmp = folder / f".rank{rank}.json.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(record, default=str))
        os.replace(tmp, path)
        return path
    except OSError:  # a full or read-only disk: the failure's own line is what the user sees
        return None


def collect(run_dir: Path, reason: str) -> None:
    """A collective failed on this rank: write its history, ask the local peers for theirs (SIGUSR2) and wait for
    them a few seconds (a stopped or gone peer writes nothing), before the caller stops them."""
    import signal

    if not dist.is_initialized():
        return
    peers = _local_peers()
    mine = dump(run_dir, reason, peers, failed=True)
    if mine is None:
        return
    started = time.time()
    waiting = [r for r, p in peers.items() if p["state"] not in ("stopped", "tracing-stop", "zombie", "dead", "gone")]
    for r in waiting:
        try:
            os.kill(peers[r]["pid"], signal.SIGUSR2)
        except OSError:
            pass
    deadline = time.monotonic() + PEER_WAIT_S
    while waiting and time.monotonic() < deadline:
        waiting = [r for r in waiting if not _fresh(mine.parent / f"rank{r}.json", started)]
        time.sleep(0.05)


def _fresh(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since - 1
    except OSError:
        return False


# -- reading -----------------------------------------------------------------------------------------

def _field(data: dict, key: str, kind, path: Path):
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(f"{path}: field '{key}' is missing or not {getattr(kind, '__name__', kind)}: not a paratrain "
                        "hang record")
    return value


def load_dumps(run_dir: Path) -> dict[int, dict]:
    """The hang records of a run ({rank: record}), every field used checked."""
    folder = Path(run_dir) / FOLDER
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    files = sorted(folder.glob("rank*.json")) if folder.is_dir() else []
    if not files:
        raise UserError(f"{folder}: no hang records (they are written when a collective times out, or on SIGUSR2)")
    dumps = {}
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not a JSON hang record ({e})") from None
        if not isinstance(data, dict) or data.get("paratrain_hang_dump") != 1:
            raise UserError(f"{path}: not a paratrain hang record (field 'paratrain_hang_dump')")
        rank, world = _field(data, "rank", int, path), _field(data, "world_size", int, path)
        if not 0 <= rank < world:
            raise UserError(f"{path}: field 'rank' {rank} is not a rank of world_size {world}")
        for key, kind in (("entries", list), ("pg_status", dict), ("peers", dict), ("groups", dict),
                          ("main_stack", list)):
            _field(data, key, kind, path)
        for e in data["entries"]:
            if not isinstance(e, dict) or not all(isinstance(e.get(k), int) for k in ("collective_seq_id",
                                                                                  "p2p_seq_id", "pg_id")) \
                    or not isinstance(e.get("process_group"), list):
                raise UserError(f"{path}: field 'entries' holds an entry without collective_seq_id, p2p_seq_id, "
                                "pg_id and process_group")
        dumps[rank] = data
    return dumps


def _group(dump: dict, entry: dict) -> tuple[str, tuple[int, ...]]:
    """(description, global ranks) of an entry's process group, the same key on every rank."""
    name, desc = (entry["process_group"] + ["", ""])[:2]
    info = dump["groups"].get(str(name))
    ranks = info.get("ranks") if isinstance(info, dict) else None
    if not (isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
        ranks = list(range(dump["world_size"])) if desc == "default_pg" else []
    return str(desc), tuple(ranks)


class Issued:
    """A collective (or point-to-point op) a rank issued."""

    def __init__(self, rank: int, dump: dict, entry: dict):
        self.rank, self.entry = rank, entry
        self.group = _group(dump, entry)
        self.p2p = bool(entry.get("is_p2p"))
        self.seq = entry["p2p_seq_id" if self.p2p else "collective_seq_id"]
        created, now = entry.get("time_created_ns"), dump.get("time")
        self.created = created if isinstance(created, (int, float)) else 0
        self.age_s = now - created / 1e9 if isinstance(created, (int, float)) and isinstance(now, (int, float)) \
            else None

    @property
    def op(self) -> str:
        return str(self.entry.get("profiling_name") or "?").split(":", 1)[-1]

    def size(self) -> str:
        sizes, dtypes = self.entry.get("input_sizes") or [], self.entry.get("input_dtypes") or []
        total, parts = 0, []
        for shape, dtype in zip(sizes, dtypes):
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                continue
            n = 1
            for d in shape:
                n *= d
            total += n * dtype_bytes(str(dtype))
            parts.append(f"{'x'.join(map(str, shape)) or 'scalar'} {str(dtype).lower()}")
        return f"{', '.join(parts) or '?'} ({_bytes(total)})"

    def where(self) -> str:
        """The innermost frames of the stack that issued it, in paratrain's code."""
        frames = [f for f in self.entry.get("frames") or [] if isinstance(f, dict)]
        ours = [f for f in frames if "paratrain" in str(f.get("file"))][:3]
        return " < ".join(f"{Path(str(f.get('file'))).name}:{f.get('line')} {f.get('name')}" for f in ours)

    def describe(self) -> str:
        desc, ranks = self.group
        return (f"{self.op} #{self.seq} of {desc or 'a group'}" + (f" (ranks {_ranks(ranks)})" if ranks else "")
                + f", {self.size()}")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def blocked_on(rank: int, dump: dict) -> Issued | None:
    """The op a rank waits in: its newest one that the flight recorder has not seen complete (the one that timed out
    can be marked complete once it failed: then its newest one)."""
    status = {k: v.get("last_completed_collective") for k, v in dump["pg_status"].items() if isinstance(v, dict)}
    issued = [Issued(rank, dump, e) for e in dump["entries"]]
    if not issued:
        return None
    open_ = [i for i in issued if not i.p2p and isinstance(status.get(str(i.entry["pg_id"])), int)
             and i.seq > status[str(i.entry["pg_id"])]] + [i for i in issued if i.p2p and not i.entry.get("retired")]
    return max(open_ or issued, key=lambda i: i.created)


def last_in_group(dump: dict, rank: int, group: tuple) -> Issued | None:
    """A rank's newest collective in `group`."""
    mine = [Issued(rank, dump, e) for e in dump["entries"] if not e.get("is_p2p")]
    mine = [i for i in mine if i.group == group]
    return max(mine, key=lambda i: i.seq) if mine else None


def diagnose(run_dir: Path) -> list[str]:
    """A few lines: which rank is behind, at which collective (op, size, group), and what the others wait for."""
    dumps = load_dumps(run_dir)
    world = max(d["world_size"] for d in dumps.values())
    silent = [r for r in range(world) if r not in dumps]
    peers = {}
    for d in dumps.values():
        for r, p in d["peers"].items():
            if isinstance(p, dict) and str(r).isdigit():
                peers.setdefault(int(r), p)
    steps = sorted({d["step"] for d in dumps.values() if isinstance(d.get("step"), int)})
    lines = [f"hang records of {run_dir}: {len(dumps)} of {world} ranks"
             + (f" (at step {', '.join(str(s + 1) for s in steps)})" if steps else "")
             + (f"; none from rank {_ranks(silent)}" if silent else "")]
    blocked = {r: b for r, d in dumps.items() if (b := blocked_on(r, d)) is not None}
    # each waited-for op, the ranks in it, and the ranks of its group that are not: those hold it up
    waited: dict[tuple, list[Issued]] = {}
    for b in blocked.values():
        waited.setdefault((b.group, b.p2p, b.seq), []).append(b)
    missing: dict[int, list[tuple[Issued, list[int], str]]] = {}
    lacking: dict[tuple, set[int]] = {}  # per waited-for op, the ranks of its group that hold it up
    for (group, p2p, seq), ws in waited.items():
        inside = {w.rank for w in ws}
        for m in group[1]:
            if m in inside:
                continue
            if m not in dumps:
                why = f"it has not joined it: {_silence(m, peers)}"
            elif p2p:
                why = f"it waits elsewhere, in {blocked[m].describe()}" if m in blocked else "it waits in nothing"
            else:
                last = last_in_group(dumps[m], m, group)
                if last is not None and last.seq >= seq:
                    continue  # it issued this one: not what holds it up
                why = (f"it never issued it (its last in this group: {f'#{last.seq} {last.op}' if last else 'none'}); "
                       + (f"it waits in {blocked[m].describe()}" if m in blocked and blocked[m].group != group
                          else f"it is busy outside collectives, at {_last_frame(dumps[m])}"))
            missing.setdefault(m, []).append((ws[0], sorted(inside), why))
            lacking.setdefault((group, p2p, seq), set()).add(m)

    def waits_for_someone(m: int) -> bool:
        return any(lacking.get(key, set()) - {m} for key, ws in waited.items() if m in {w.rank for w in ws})

    # the rank to look at: behind, and not itself waiting for another rank that is behind
    roots = [m for m in missing if m not in dumps or not waits_for_someone(m)]
    for m in sorted(roots or missing):
        (first, inside, why), *more = missing[m]
        also = "".join(f"; it also holds up {op.describe()}, which rank{'s' if len(ins) > 1 else ''} {_ranks(ins)} "
                       f"wait{'' if len(ins) > 1 else 's'} in" for op, ins, _ in more)
        lines.append(f"rank {m} is behind: rank{'s' if len(inside) > 1 else ''} {_ranks(inside)} "
                     f"wait{'' if len(inside) > 1 else 's'} in {first.describe()}; {why}{also}")
    for m in silent:
        if m not in missing and m in peers:  # no op to tie it to (e.g. no history kept): what its peers saw
            lines.append(f"rank {m} {_silence(m, peers).removeprefix('it ')}")
    if not missing:
        lines.append("no rank is missing from the collectives the others wait in (a hang outside collectives, in one "
                     "older than this record, or no history kept: TORCH_FR_BUFFER_SIZE=0)")
    for r in sorted(blocked):
        b = blocked[r]
        held = f" for {b.age_s:.1f} s" if b.age_s is not None and b.age_s >= 0 else ""
        where = f", issued at {b.where()}" if b.where() else ""
        lines.append(f"  rank {r} waits in {b.describe()}{held}{where}")
    return lines


def _silence(rank: int, peers: dict) -> str:
    p = peers.get(rank)
    if p is None:
        return "it wrote no record (on another host, killed, or without a process group)"
    state = {"stopped": "stopped (SIGSTOP, or a debugger)", "tracing-stop": "stopped by a debugger",
             "zombie": "gone (exited)", "dead": "gone", "gone": "gone"}.get(str(p.get("state")), str(p.get("state")))
    return f"it wrote no record: its process (pid {p.get('pid')}) was {state} when its peers looked"


def _last_frame(d: dict) -> str:
    stack = [line for line in d["main_stack"] if isinstance(line, str) and "paratrain" in line]
    return stack[-1].strip().splitlines()[0] if stack else "an unknown place"
