"""The order in which a pipeline rank runs its forwards and backwards: what decides its memory.

The memory estimator walks this order (paratrain/estimate/core.py): a micro-batch's activations are held from its
forward to its backward (to its weight-gradient step in the zero-bubble schedules, which split the backward into
an input-gradient step "I" and a weight-gradient step "W"), so the peak is where the most are in flight.

These are the compute orders of `torch.distributed.pipelining`'s schedules (torch 2.13), written out without torch
so that the planner can walk thousands of layouts quickly; `torch_order` asks torch itself, and
tests/test_planfid.py checks that both agree for every schedule over a grid of stages, ranks and micro-batches.
  gpipe             every forward, then every backward, in micro-batch order
  1f1b              min(m, pp - rank) warm-up forwards, then one backward and one forward until the forwards run out,
                    then the remaining backwards
  interleaved_1f1b  v stages per rank in rounds of micro-batches; (v-1) x per-round + 2 (pp-1-rank) warm-up forwards
  interleaved_zero_bubble  the same with one warm-up forward less per hop, input-gradient steps in the backward's place,
                    and weight-gradient steps from the (rank+1)-th backward on, in backward order
  zbv               two stages per rank in a V (rank r runs r and 2pp-1-r), input and weight gradients split
"""

from __future__ import annotations

import functools

from functools import lru_cache

from paratrain.modes import SCHEDULES, Schedule

Action = tuple[int, str, int]  # (stage, kind: F | B | I | W, micro-batch)


@lru_cache(maxsize=4096)
def rank_actions(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """The compute actions pipeline rank `rank` runs in one step, in order."""
    m = microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule}")
    schedule = Schedule(schedule)
    if schedule.all_forwards_first:  # gpipe
        return tuple([(rank, "F", j) for j in range(m)] + [(rank, "B", j) for j in range(m)])
    if schedule.interleaved:
        return _interleaved(pp, virtual, m, rank, schedule.zero_bubble)
    if schedule.v_shaped:  # zbv
        return _zbv(pp, m, rank)
    warm = min(m, pp - rank)  # 1f1b
    ops: list[Action] = [(rank, "F", j) for j in range(warm)]
    f = warm
    for b in range(m):
        ops.append((rank, "B", b))
        if f < m:
            ops.append((rank, "F", f))
            f += 1
    return tuple(ops)


def _interleaved(pp: int, v: int, m: int, rank: int, split_backward: bool) -> tuple[Action, ...]:
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + (1 if split_backward else 2) * (pp - 1 - rank), m * v)
    total = m * v  # forwards (and backwards) this rank runs

    def fwd_stage(op):
        return (op // per_round) % v * pp + rank

    def bwd_stage(op):
        return (v - 1 - ((op - warm) // per_round) % v) * pp + rank

    count: dict[tuple[int, str], int] = {}

    def act(stage, kind):
        j = count.get((stage, kind), 0)
        count[(stage, kind)] = j + 1
        return (stage, kind, j)

    ops: list[Action] = []
    backward_ops: list[int] = []
    weights_done = 0

    def backward(op):
        nonlocal weights_done
        ops.append(act(bwd_stage(op), "I" if split_backward else "B"))
        backward_ops.append(op)
        if split_backward and op - warm >= rank:  # the weight gradients trail the input gradients by `rank` steps
            ops.append(act(bwd_stage(backward_ops[weights_done]), "W"))
            weights_done += 1

    for op in range(warm):
        ops.append(act(fwd_stage(op), "F"))
    for op in range(warm, total):
        ops.append(act(fwd_stage(op), "F"))
        backward(op)
    for op in range(total, total + warm):
        backward(op)
    while split_backward and weights_done < len(backward_ops):
        ops.append(act(bwd_stage(backward_ops[weights_done]), "W"))
        weights_done += 1
    return tuple(ops)


def _zbv(pp: int, m: int, rank: int) -> tuple[Action, ...]:
    n = max(2 * pp - 1, m)  # the order is built for at least 2pp-1 micro-batches; the extra ones are dropped
    s0, s1 = rank, 2 * pp - 1 - rank
    f0 = f1 = b0 = b1 = 0
    ops: list[Action] = []
    for _ in range(2 * (pp - rank) - 1):
        ops.append((s0, "F", f0))
        f0 += 1
    for _ in range(rank):
        ops += [(s1, "F", f1), (s0, "F", f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        ops += [(s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((s0, "F", f0))
            f0 += 1
        ops += [(s0, "I", b0), (s0, "W", b0), (s1, "F", f1), (s1, "I", b1), (s1, "W", b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(s0, "I", b0), (s1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        ops += [(s0, "I", b0), (s0, "W", w0)]
        b0 += 1
        w0 += 1
    ops += [(s1, "W", j) for j in range(w1, b1)] + [(s0, "W", j) for j in range(w0, b0)]
    return tuple(op for op in ops if op[2] < m)


def torch_order(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[Action, ...]:
    """The same order computed by torch's own schedule classes (for the test that keeps the two in step)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S  # lazy: the cost model is torch-free

    cls = getattr(S, Schedule(schedule).torch_schedule_name)
    rounds = max(1, m // pp)
    # the attributes these schedules' constructors set before computing the order (no stages or groups needed)
    fake = SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=m, number_of_rounds=rounds,
                           microbatches_per_round=m // rounds, num_stages=pp * virtual, rank=rank)
    out = []
    for action in cls._calculate_single_rank_operations(fake, rank):
        if action is not None:
            kind = getattr(action.computation_type, "value", action.computation_type)
            out.append((action.stage_index, str(kind), action.microbatch_index))
    return tuple(out)


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; the planner asks for the same ones often
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
