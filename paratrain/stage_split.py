"""Blocks per pipeline stage: the split `Layout.validate` fills in (balanced by the parameters each token is multiplied
by: the parameter count of a dense model, the compute of a mixture of experts) and the min-max partition the planner
cuts heterogeneous stages with. Torch-free.
"""

from __future__ import annotations

import bisect
import functools

from paratrain.models.presets import block_param_count
from paratrain.models.registry import side_params, used_numel


def balanced_split(args, num_stages: int) -> tuple[int, ...]:
    """Contiguous blocks per stage minimising the largest stage's active parameters (the embedding counts on the first
    stage, norm + output and the side heads' modules on the last). For a dense model these are all its
    parameters; a mixture of experts' blocks count the router, the shared experts and top_k of the routed ones, what a
    token's compute multiplies (counting every expert, DeepSeek-V3's three dense blocks would share one stage with two
    MoE blocks and make it the slowest; the experts' memory is spread by expert parallelism and FSDP instead)."""
    return _min_max_split(_block_costs(args), num_stages)


@functools.lru_cache(maxsize=256)
def _block_costs(args) -> tuple[int, ...]:
    cost = [block_param_count(args, i, active=True) for i in range(args.n_layers)]
    cost[0] += args.vocab_size * args.dim
    side = sum(used_numel(args, p) for p in side_params(args))
    cost[-1] += args.vocab_size * args.dim + args.dim + side
    return tuple(cost)


@functools.lru_cache(maxsize=1024)
def _min_max_split(cost: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    """Contiguous parts of `cost` (non-negative) minimising the largest part's sum: the cut `min_max_partition` makes
    (the first best start of each last part), found by bisection. With sums of non-negative costs the best largest
    part of the first j items, best(j), grows with j and the last part's sum shrinks with its start j, so
    max(best(j), sum(j..i)) falls, then rises: O(parts x n log n) instead of O(parts x n^2)."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    best = list(prefix)  # one part: the first i items
    cuts = [[0] * (n + 1)]
    for s in range(2, num_stages + 1):
        row, cut = [float("inf")] * (n + 1), [0] * (n + 1)
        # (the first i items in s parts leave n - i items for the other num_stages - s parts, one at least each: a
        # larger i is never read again)
        for i in range(s, n - (num_stages - s) + 1):
            # j in [s - 1, i): the last part is items j..i-1; lo: the first j where best[j] >= its sum
            lo, hi, top = s - 1, i, prefix[i]
            while lo < hi:
                mid = (lo + hi) // 2
                if best[mid] >= top - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            # from lo on the maximum is best[j] (rising): smallest at lo; before lo it is the last part's sum
            # (falling): smallest at lo - 1, first reached at the first j with prefix[j] == prefix[lo - 1]
            value, where = (best[lo], lo) if lo < i else (float("inf"), i)
            if lo > s - 1 and top - prefix[lo - 1] <= value:
                value, where = top - prefix[lo - 1], bisect.bisect_left(prefix, prefix[lo - 1], s - 1, lo - 1)
            row[i], cut[i] = value, where
        best = row
        cuts.append(cut)
    sizes, i = [], n
    for s in range(num_stages, 1, -1):
        j = cuts[s - 1][i]
        sizes.append(i - j)
        i = j
    sizes.append(i)
    return tuple(reversed(sizes))


def min_max_partition(n: int, parts: int, part_cost, max_size=None) -> tuple[int, ...] | None:
    """Cut items 0..n-1 into `parts` contiguous parts of at least one item (at most max_size[p] for part p) minimising
    the largest part_cost(p, start, end) (items start..end-1 as part p); the sizes, or None when the limits leave no
    cut. Dynamic programming over (parts, items): O(parts x n^2)."""
    inf = float("inf")
    # best[s][i]: the smallest largest part cost of the first i items cut into s parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for s in range(1, parts + 1):
        low = 0 if max_size is None else max_size[s - 1]
        for i in range(s, n + 1):
            for j in range(max(s - 1, i - low) if low else s - 1, i):
                value = max(best[s - 1][j], part_cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[parts][n] == inf:
        return None
    sizes, i = [], n
    for s in range(parts, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))
