"""The order in which a pipeline rank runs its forwards and backwards: what decides its memory.

The memory estimator walks this order (paratrain/estimate/core.py): a micro-batch's activations are held from its
forward to its backward (to its weight-gradient step in the zero-bubble schedules, which split the backward into
an input-gradient step "I" and a weight-gradient step "W"), so the peak is where the most are in flight.

gpipe and 1f1b are `torch.distributed.pipelining`'s single-stage schedules, written out here (gpipe: every
forward, then every backward in order; 1f1b: min(m, pp - rank) warm-up forwards, then one backward and one forward
until the forwards run out, then the remaining backwards). The multi-stage schedules (interleaved_1f1b,
interleaved_zero_bubble, zbv) are computed by torch's own `_calculate_single_rank_operations`, so the estimate
follows the schedule that actually runs, for whatever stages, ranks and micro-batches.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

Action = tuple[int, str, int]  # (stage, kind: F | B | I | W, micro-batch)


@lru_cache(maxsize=4096)
def rank_actions(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """The compute actions pipeline rank `rank` runs in one step, in order."""
    m = microbatches
    if schedule == "gpipe":
        return tuple([(rank, "F", j) for j in range(m)] + [(rank, "B", j) for j in range(m)])
    if schedule == "1f1b":
        warm = min(m, pp - rank)
        ops: list[Action] = [(rank, "F", j) for j in range(warm)]
        f = warm
        for b in range(m):
            ops.append((rank, "B", b))
            if f < m:
                ops.append((rank, "F", f))
                f += 1
        return tuple(ops)
    return _torch_order(schedule, pp, virtual, m, rank)


def _torch_order(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[Action, ...]:
    from torch.distributed.pipelining import schedules as S

    cls = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
           "zbv": S.ScheduleZBVZeroBubble}[schedule]
    rounds = max(1, m // pp)
    # The attributes these schedules' constructors set before computing the order (no stages or groups needed).
    fake = SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=m, number_of_rounds=rounds,
                           microbatches_per_round=m // rounds, num_stages=pp * virtual, rank=rank)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out = []
    for action in cls._calculate_single_rank_operations(fake, rank):
        if action is None:
            continue
        kind = kinds.get(str(action.computation_type.value) if hasattr(action.computation_type, "value")
                         else str(action.computation_type))
        if kind is None:
            raise RuntimeError(f"unexpected pipeline action {action} in torch's {schedule} order")
        out.append((action.stage_index, kind, action.microbatch_index))
    return tuple(out)


def max_in_flight(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> float:
    """The most micro-batches whose activations rank `rank` holds at once, in units of all its stages (a stage is
    1/virtual of the rank's blocks)."""
    held: dict[tuple[int, int], bool] = {}
    best = 0
    for stage, kind, mb in rank_actions(schedule, pp, virtual, microbatches, rank):
        if kind == "F":
            held[(stage, mb)] = True
            best = max(best, len(held))
        elif kind in ("B", "W"):
            held.pop((stage, mb), None)
    return best / virtual
