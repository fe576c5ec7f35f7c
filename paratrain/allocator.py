"""The CUDA caching allocator's settings (`[memory] allocator`): checked before launch, put in every rank's
environment before CUDA starts.

torch reads them once, from the environment, when its allocator first starts (the first CUDA tensor), in the syntax
`key:value,key:value` (torch's "CUDA memory management" notes). torch >= 2.9 reads PYTORCH_ALLOC_CONF and still
PYTORCH_CUDA_ALLOC_CONF, the older name (the newer wins when both are set); older releases read the older name only.
A person's own variable wins over the config: `apply` then leaves the environment as it is. Torch-free: the checks
before launch and the launcher call it.
"""

from __future__ import annotations

import os

from paratrain.errors import ConfigError

NEW_NAME, OLD_NAME = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
ENV_NAMES = (NEW_NAME, OLD_NAME)  # in the order torch reads them
SET_BY_PARATRAIN = "PARATRAIN_ALLOCATOR"  # the value paratrain put there (a person's own variable is not this)

# torch 2.13's keys, by the kind of value each takes (c10's AcceleratorAllocatorConfig and CUDAAllocatorConfig)
FLAGS = frozenset({"expandable_segments", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                   "pinned_use_background_threads", "graph_capture_record_stream_reuse"})
NUMBERS = frozenset({"max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                     "garbage_collection_threshold", "pinned_num_register_threads", "pinned_max_round_threshold_mb",
                     "pinned_max_cached_size_mb", "pinned_reserve_segment_size_mb", "per_process_memory_fraction"})
CHOICES = {"backend": ("native", "cudaMallocAsync")}
ROUNDUP = "roundup_power2_divisions"  # a number, or [size:divisions,...]


def entries(setting: str) -> list[str]:
    """`key:value` entries of a setting, split on the commas outside brackets (roundup_power2_divisions's list)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(setting):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(setting[start:i])
            start = i + 1
    return [*parts, setting[start:]]


def problem(setting: str) -> str | None:
    """What is wrong with an allocator setting, or None ("" is torch's default)."""
    if not setting:
        return None
    for entry in entries(setting):
        key, colon, value = (part.strip() for part in entry.partition(":"))
        if not colon or not key or not value:
            return f"'{entry}' is not key:value"
        if key in FLAGS:
            if value not in ("True", "False"):
                return f"{key} takes True or False, got '{value}'"
        elif key in NUMBERS or (key == ROUNDUP and not value.startswith("[")):
            try:
                float(value)
            except ValueError:
                return f"{key} takes a number, got '{value}'"
        elif key in CHOICES:
            if value not in CHOICES[key]:
                return f"{key} takes {' or '.join(CHOICES[key])}, got '{value}'"
        elif key == ROUNDUP:
            if not value.endswith("]"):
                return f"{key}: '{value}' has no closing ']'"
        else:
            known = sorted([*FLAGS, *NUMBERS, *CHOICES, ROUNDUP])
            return f"unknown key '{key}' (torch's keys: {', '.join(known)})"
    return None


def check(setting: str) -> None:
    trouble = problem(setting)
    if trouble:
        raise ConfigError(f"memory.allocator: {trouble}")


def env_name() -> str:
    """The variable this torch reads first (PYTORCH_ALLOC_CONF from torch 2.9)."""
    import importlib.metadata  # here, not at the top: it pulls in the email package, ~30 ms for every command

    try:
        major, minor = (int(part) for part in importlib.metadata.version("torch").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return NEW_NAME
    return NEW_NAME if (major, minor) >= (2, 9) else OLD_NAME


def users_own() -> tuple[str, str] | None:
    """(variable, value) a person set before paratrain ran, if any (the first one torch reads)."""
    ours = os.environ.get(SET_BY_PARATRAIN)
    for name in ENV_NAMES:
        value = os.environ.get(name)
        if value is not None and value != ours:
            return name, value
    return None


def apply(setting: str) -> None:
    """Put `setting` in this process's environment, for torch here and for the ranks it starts (they inherit it),
    unless the person set their own variable. Call before CUDA starts; again in a rank: idempotent."""
    if users_own() is not None:
        return
    for name in ENV_NAMES:  # a setting paratrain made earlier in this process (another run's)
        if os.environ.get(name) == os.environ.get(SET_BY_PARATRAIN):
            os.environ.pop(name, None)
    if setting:
        os.environ[env_name()] = os.environ[SET_BY_PARATRAIN] = setting
    else:
        os.environ.pop(SET_BY_PARATRAIN, None)


def in_effect() -> tuple[str, str]:
    """(the setting torch reads in this process, where it comes from) for `doctor` and the run's record."""
    own = users_own()
    if own is not None:
        return own[1], f"your {own[0]}"
    ours = os.environ.get(SET_BY_PARATRAIN)
    if ours:
        return ours, "memory.allocator"
    return "", "torch's default"
