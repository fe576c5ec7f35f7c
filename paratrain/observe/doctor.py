"""`paratrain doctor [--nproc N] [--checkpoint-dir DIR]`: check the environment and say what is wrong in plain words.
`paratrain doctor --hang RUN_DIR`: which rank of a hung run is behind, from its ranks' collective histories
(paratrain/observe/hang.py).

One line per check: OK, WARN (works, but slower or risky), FAIL (training will not work as configured) or SKIP
(does not apply here). Exit code 0 when nothing FAILs, 1 otherwise.

Checks: torch and CUDA versions; GPUs and their memory; the CUDA caching allocator's settings (and on a GPU whether
torch took them, its reserved - allocated gap and retries); NCCL (and gloo) availability and version; the GPU
interconnect (NVLink vs PCIe, from `nvidia-smi topo -m`); NCCL/gloo environment variables (e.g. an
NCCL_SOCKET_IFNAME that names no interface of this host); free disk for checkpoints and shared memory; and an
all-reduce across N local ranks (NCCL on GPUs, gloo on CPU) with its bus bandwidth.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain import allocator
from paratrain.config import MemoryConfig
from paratrain.distributed.launch import inside_launcher, launch
from paratrain.errors import UserError

GIB = 2**30
MIN_TORCH = (2, 6)


@dataclass
class Result:
    status: str  # OK | WARN | FAIL | SKIP
    name: str
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<20} {self.message}"


# -- torch, CUDA, GPUs ----------------------------------------------------------------------------

def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def check_torch() -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    py = ".".join(map(str, sys.version_info[:3]))
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else ("ROCm " + torch.version.hip if getattr(
        torch.version, "hip", None) else "CPU-only build")
    text = f"{torch.__version__} ({build}), Python {py}"
    if _version_tuple(torch.__version__)[:2] < MIN_TORCH:
        return [Result("FAIL", "torch", f"{text}: paratrain needs torch >= {'.'.join(map(str, MIN_TORCH))}")]
    return [Result("OK", "torch", text)]


def nvidia_smi(*args: str, timeout: float = 15) -> str | None:
    """stdout of `nvidia-smi ARGS`, or None when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def check_gpus() -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        smi = nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
        gpus = [line for line in (smi or "").splitlines() if line.strip()]
        if gpus:
            driver = gpus[0].split(",")[-1].strip()
            if not torch.version.cuda:
                why = f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch"
            elif visible is not None and visible.strip() in ("", "-1"):
                why = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
            else:
                why = (f"torch is built for CUDA {torch.version.cuda}; driver {driver} may be too old for it, "
                       "or the driver is not loaded in this container")
            return [Result("FAIL", "gpu", f"nvidia-smi sees {len(gpus)} GPU(s) ({gpus[0].split(',')[0].strip()}, "
                                          f"driver {driver}) but torch cannot use them: {why}")]
        note = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return [Result("OK", "gpu", f"no GPU{note}: this is a CPU-only machine; paratrain trains on CPU and "
                                    "uses gloo for collectives")]
    results, names = [], set()
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        names.add(p.name)
        free, total = torch.cuda.mem_get_info(i)
        text = (f"GPU {i}: {p.name}, {total / GIB:.1f} GiB ({free / GIB:.1f} GiB free), "
                f"compute capability {p.major}.{p.minor}")
        status = "OK"
        if free < 0.9 * total:
            status, text = "WARN", text + f": {(total - free) / GIB:.1f} GiB already in use by other processes"
        if p.major < 8:
            status, text = "WARN", text + ": no bf16 tensor cores (use training.precision=fp16 or fp32)"
        results.append(Result(status, "gpu", text))
    if len(names) > 1:
        results.append(Result("WARN", "gpu", f"mixed GPU models ({', '.join(sorted(names))}): the slowest sets the pace"))
    return results


def check_backends() -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch
    # lazy: a torch that does not import is this check's FAIL line
    import torch.distributed as dist

    out = []
    if not dist.is_available():
        return [Result("FAIL", "torch.distributed", "this torch build has no torch.distributed")]
    out.append(Result("OK" if dist.is_gloo_available() else "FAIL", "gloo",
                      "available (CPU collectives, rendezvous helpers)" if dist.is_gloo_available()
                      else "not available in this torch build: CPU training over several ranks will not work"))
    if not torch.cuda.is_available():
        out.append(Result("SKIP", "nccl", "no GPU: NCCL is not used on a CPU-only machine"))
    elif not dist.is_nccl_available():
        out.append(Result("FAIL", "nccl", "torch was built without NCCL: multi-GPU training cannot start"))
    else:
        v = torch.cuda.nccl.version()
        version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        out.append(Result("OK", "nccl", f"NCCL {version}"))
    return out


def check_allocator() -> list[Result]:
    """The CUDA caching allocator's settings in effect (paratrain/allocator.py: yours, or memory.allocator's default,
    which `run_checks` set before CUDA started); on a GPU whether torch took them (the segments of a probe
    allocation say whether they are expandable), its reserved - allocated gap and its retries."""
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    setting, source = allocator.in_effect()
    text = f"{setting or 'torch defaults'} ({source})"
    trouble = allocator.problem(setting)
    if trouble:
        return [Result("FAIL", "allocator", f"{text}: {trouble}; torch refuses it when CUDA starts")]
    if not torch.cuda.is_available():
        return [Result("OK", "allocator", f"{text}; no GPU: it acts on CUDA only")]
    probe = torch.empty(2**20, device="cuda")
    expandable = any(s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"])
    del probe
    stats = torch.cuda.memory_stats()
    gap = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)) / 2**20
    text += (f"; segments {'expandable' if expandable else 'fixed'}, reserved - allocated {gap:.1f} MiB, "
             f"{stats.get('num_alloc_retries', 0)} retries")
    wanted = "expandable_segments:True" in setting.replace(" ", "")
    if wanted != expandable:
        return [Result("WARN", "allocator", f"{text}: torch did not take the setting (CUDA started before it was set?)")]
    return [Result("OK", "allocator", text)]


# -- interconnect ---------------------------------------------------------------------------------

NVLINK = re.compile(r"^NV\d+$")
LINK_WORDS = {"PIX": "PCIe, same switch", "PXB": "PCIe, several switches", "PHB": "PCIe through the CPU host bridge",
              "NODE": "PCIe across host bridges in one NUMA node", "SYS": "PCIe across CPU sockets (SMP interconnect)"}


def parse_topology(text: str) -> dict[tuple[str, str], str]:
    """`nvidia-smi topo -m` -> {(GPU0, GPU1): link}, e.g. "NV18", "PIX", "SYS" (GPU-to-GPU entries only)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s*GPU0\b", ln)), None)
    if header is None:
        return {}
    cols = header.split()
    gpus = [c for c in cols if re.match(r"^GPU\d+$", c)]
    links = {}
    for ln in lines[lines.index(header) + 1:]:
        parts = ln.split()
        if not parts or not re.match(r"^GPU\d+$", parts[0]):
            continue
        row, cells = parts[0], parts[1:1 + len(gpus)]
        for col, cell in zip(gpus, cells):
            if col != row:
                links[(row, col)] = cell
    return links


def describe_topology(links: dict[tuple[str, str], str]) -> Result:
    pairs = {tuple(sorted(k)): v for k, v in links.items()}
    if not pairs:
        return Result("SKIP", "interconnect", "nvidia-smi topo -m printed no GPU matrix")
    nv = [p for p, v in pairs.items() if NVLINK.match(v)]
    if len(nv) == len(pairs):
        widths = sorted({pairs[p] for p in nv})
        return Result("OK", "interconnect", f"NVLink between all {len(pairs)} GPU pairs ({', '.join(widths)})")
    slow = {p: v for p, v in pairs.items() if not NVLINK.match(v)}
    worst = sorted(slow.items(), key=lambda kv: ["PIX", "PXB", "PHB", "NODE", "SYS"].index(kv[1])
                   if kv[1] in LINK_WORDS else 9)[-1]
    text = (f"{len(slow)} of {len(pairs)} GPU pairs have no NVLink; e.g. {worst[0][0]}-{worst[0][1]}: "
            f"{worst[1]} ({LINK_WORDS.get(worst[1], 'unknown link')}). Collectives between them go over PCIe: "
            "prefer tensor parallelism only inside NVLink groups")
    return Result("WARN", "interconnect", text)


def check_interconnect() -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return [Result("SKIP", "interconnect", "fewer than 2 GPUs: no GPU-to-GPU links to check")]
    text = nvidia_smi("topo", "-m")
    if text is None:
        return [Result("WARN", "interconnect", "nvidia-smi topo -m is not available: cannot tell NVLink from PCIe")]
    return [describe_topology(parse_topology(text))]


# -- environment variables ------------------------------------------------------------------------

def interfaces() -> list[str]:
    names = set()
    try:
        names |= {p.name for p in Path("/sys/class/net").iterdir()}
    except OSError:
        pass
    try:
        names |= {name for _, name in socket.if_nameindex()}
    except OSError:
        pass
    return sorted(names)


def ifname_matches(spec: str, available: list[str]) -> list[str]:
    """Interfaces selected by an NCCL_SOCKET_IFNAME value (NCCL's syntax).

    Comma-separated prefixes ("eth" matches eth0, eth1); "=" before a name asks for an exact match; a leading "^"
    turns the whole list into exclusions ("^docker,lo": everything but those).
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    items = [s.strip() for s in spec.lstrip("^").split(",") if s.strip()]

    def match(iface: str, item: str) -> bool:
        return iface == item[1:] if item.startswith("=") else iface.startswith(item)

    if exclude:
        return [i for i in available if not any(match(i, it) for it in items)]
    return [i for i in available if any(match(i, it) for it in items)]


def check_env(environ=None) -> list[Result]:
    env = os.environ if environ is None else environ
    out = []
    available = interfaces()
    have = ", ".join(available) or "none found"
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec is not None:
        chosen = ifname_matches(spec, available)
        if not chosen:
            out.append(Result("FAIL", "NCCL_SOCKET_IFNAME",
                              f"NCCL_SOCKET_IFNAME={spec!r} matches no network interface on this host "
                              f"(interfaces here: {have}); NCCL will fail to start or hang. Set it to one of "
                              "these, or unset it"))
        else:
            out.append(Result("OK", "NCCL_SOCKET_IFNAME", f"{spec!r} selects {', '.join(chosen)}"))
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo is not None:
        missing = [n for n in (s.strip() for s in gloo.split(",")) if n and n not in available]
        if missing or not gloo.strip():
            out.append(Result("FAIL", "GLOO_SOCKET_IFNAME",
                              f"GLOO_SOCKET_IFNAME={gloo!r} names interface(s) that do not exist here "
                              f"({', '.join(missing) or 'empty'}; interfaces here: {have}): gloo cannot start"))
        else:
            out.append(Result("OK", "GLOO_SOCKET_IFNAME", f"{gloo!r} exists"))
    hca = env.get("NCCL_IB_HCA")
    if hca is not None:
        ib = Path("/sys/class/infiniband")
        devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
        if not devices or not ifname_matches(hca, devices):
            out.append(Result("WARN", "NCCL_IB_HCA", f"NCCL_IB_HCA={hca!r} matches no InfiniBand device here "
                                                     f"({', '.join(devices) or 'none found'}): NCCL falls back to "
                                                     "sockets (much slower between nodes)"))
        else:
            out.append(Result("OK", "NCCL_IB_HCA", f"{hca!r} selects {', '.join(ifname_matches(hca, devices))}"))
    for var, what in (("NCCL_P2P_DISABLE", "direct GPU-to-GPU copies (NVLink/PCIe P2P)"),
                      ("NCCL_IB_DISABLE", "InfiniBand/RoCE between nodes"),
                      ("NCCL_SHM_DISABLE", "shared-memory transport between local ranks")):
        if env.get(var, "0").strip() not in ("", "0"):
            out.append(Result("WARN", var, f"{var}={env[var]} turns off {what}: collectives will be slower"))
    if env.get("NCCL_DEBUG"):
        out.append(Result("OK", "NCCL_DEBUG", f"NCCL_DEBUG={env['NCCL_DEBUG']}: NCCL prints its own logs"))
    names = sorted(k for k in env if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_")))
    out.append(Result("OK", "environment", "NCCL/gloo variables set: " + ", ".join(f"{k}={env[k]}" for k in names)
                      if names else "no NCCL_* / GLOO_* variables set (library defaults)"))
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        out.append(Result("WARN", "hostname", f"this host's name ({socket.gethostname()}) does not resolve: "
                                              "multi-node rendezvous needs MASTER_ADDR / --rdzv-endpoint as an IP"))
    return out


# -- disk -------------------------------------------------------------------------------------------

def check_disk(checkpoint_dir: str | Path) -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    path = Path(checkpoint_dir).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    free = usage.free / GIB
    where = f"{path}" + ("" if probe == path else f" (not created yet; checked {probe})")
    advice = ("a checkpoint holds about 12 bytes per parameter with AdamW (fp32 weights and two moments): "
              "1B parameters ~ 12 GB per checkpoint, times checkpoint.keep")
    out = []
    if not os.access(probe, os.W_OK):
        out.append(Result("FAIL", "checkpoint disk", f"{where} is not writable: checkpoints cannot be saved"))
    elif free < 1:
        out.append(Result("FAIL", "checkpoint disk", f"{where}: only {free:.2f} GiB free; {advice}"))
    elif free < 10:
        out.append(Result("WARN", "checkpoint disk", f"{where}: {free:.1f} GiB free, enough only for small models; "
                                                     f"{advice}"))
    else:
        out.append(Result("OK", "checkpoint disk", f"{where}: {free:.1f} GiB free of {usage.total / GIB:.1f} GiB"))
    shm = Path("/dev/shm")
    if shm.is_dir():
        size = shutil.disk_usage(shm).total / GIB
        if torch.cuda.is_available() and torch.cuda.device_count() > 1 and size < 1:
            out.append(Result("WARN", "shared memory", f"/dev/shm is {size * 1024:.0f} MiB: NCCL between local "
                                                       "GPUs needs more (docker: --shm-size=16g or --ipc=host)"))
        else:
            out.append(Result("OK", "shared memory", f"/dev/shm: {size:.1f} GiB"))
    return out


# -- collective test --------------------------------------------------------------------------------

def first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _allreduce_worker(backend: str, nbytes: int, iters: int) -> dict:
    """Runs on each launched rank: time an all-reduce of `nbytes` and check its result."""
    try:
        return _allreduce(backend, nbytes, iters)
    except Exception as e:
        print(f"[rank {os.environ.get('RANK', '?')}] {backend} all-reduce test failed: {first_line(e)}", file=sys.stderr,
              flush=True)
        raise


def _allreduce(backend: str, nbytes: int, iters: int) -> dict:
    # lazy: a torch that does not import is this check's FAIL line
    import torch
    # lazy: a torch that does not import is this check's FAIL line
    import torch.distributed as dist

    # lazy: a torch that does not import is this check's FAIL line
    from paratrain.distributed.env import init_process_group, world_from_env

    rank, world, local_rank = world_from_env()
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    init_process_group(device, timeout_s=60)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up (and correctness: every element must equal the world size)
        ok = bool((x == world).all().item())
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
        return {"rank": rank, "world": world, "seconds": t.item(), "correct": ok}
    finally:
        dist.destroy_process_group()


def check_collective(nproc: int | None) -> list[Result]:
    # lazy: a torch that does not import is this check's FAIL line
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if inside_launcher():  # torchrun's agents started this process as one rank of the job: the test is the job's
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    elif nproc is None:
        nproc = gpus if gpus else 2
    if nproc == 0:
        return [Result("SKIP", "all-reduce", "--nproc 0: collective test skipped")]
    backend = "nccl" if gpus and nproc <= gpus else "gloo"
    notes = ""
    if gpus and nproc > gpus:
        notes = f" (more ranks than the {gpus} GPU(s): tested gloo on CPU)"
    nbytes, iters = (256 * 2**20, 20) if backend == "nccl" else (8 * 2**20, 5)
    if inside_launcher():
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        notes = f" on {nodes} node{'s' * (nodes > 1)}, {nproc} per node{notes}"
        try:
            out = _allreduce(backend, nbytes, iters)
        except Exception as e:  # noqa: BLE001 - this rank's failure is its FAIL line; the agents end the others
            return [Result("FAIL", "all-reduce", f"rank {os.environ.get('RANK', '?')} of the job could not "
                                                 f"all-reduce over {backend}: {first_line(e)}; check that every node "
                                                 "reaches the rendezvous host and MASTER_PORT, and the "
                                                 "NCCL/GLOO_SOCKET_IFNAME variables")]
    else:
        try:
            out = launch(_allreduce_worker, (backend, nbytes, iters), nproc)
        except UserError:
            return [Result("FAIL", "all-reduce", f"{nproc} local {backend} ranks could not all-reduce (their "
                                                 "errors are printed above): check the NCCL/GLOO variables, and "
                                                 "that nothing blocks TCP on 127.0.0.1")]
    if not out or not out.get("correct"):
        return [Result("FAIL", "all-reduce", f"{nproc} {backend} ranks: wrong all-reduce result")]
    n, t = out["world"], out["seconds"]
    algbw = nbytes / t / 1e9
    busbw = algbw * 2 * (n - 1) / n
    if n == 1:
        return [Result("OK", "all-reduce", f"1 {backend} rank initialised and reduced {nbytes // 2**20} MiB "
                                           f"(one rank: no bandwidth to measure){notes}")]
    status = "WARN" if backend == "nccl" and busbw < 1 else "OK"
    text = (f"{n} {backend} ranks, {nbytes // 2**20} MiB float32: {t * 1e3:.2f} ms -> bus bandwidth {busbw:.2f} GB/s "
            f"(algorithm bandwidth {algbw:.2f} GB/s){notes}")
    if status == "WARN":
        text += ": far below NVLink/PCIe speeds; NCCL may be going over sockets (see NCCL_P2P_DISABLE, topology)"
    return [Result(status, "all-reduce", text)]


# -- all of them ----------------------------------------------------------------------------------------

def run_checks(nproc: int | None, checkpoint_dir: str | Path):
    """Yields each check's results as it finishes (so a rank's error prints next to the all-reduce line)."""
    allocator.apply(MemoryConfig.allocator)  # what a training sets, before CUDA starts here (yours wins)
    checks = (check_torch, check_gpus, check_allocator, check_backends, check_interconnect, check_env,
              lambda: check_disk(checkpoint_dir), lambda: check_collective(nproc))
    names = ("torch", "gpu", "allocator", "backends", "interconnect", "environment", "checkpoint disk", "all-reduce")
    for check, name in zip(checks, names):
        try:
            yield from check()
        except Exception as e:  # noqa: BLE001 - a broken check is reported, the others still run
            yield Result("FAIL", name, f"check crashed: {e!r}")

