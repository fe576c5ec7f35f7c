"""What gradient compression costs and saves, from the parameters' shapes (torch-free): the planner's bytes and
compress/decompress compute, the estimator's error-feedback buffers. The runtime is paratrain/distributed/
compression.py; where each method applies is `paratrain.layout.grad_compression_site`, the settings
`paratrain.modes.Compression`.

For the gradients G (fp32) one data-parallel rank reduces with the compressed collective (ddp/zero1: all of its
gradients; hsdp's replicate hook: its FSDP shard), per optimizer step:

  method    wire bytes / fp32 ring all-reduce's     state kept between steps           temporaries in the hook
  bf16      1/2                                     -                                  a bf16 copy (G/2)
  powersgd  sum r(n+m) over the matrices it         error feedback (G) + Q (m r each)  the input's copy (G) and P
            compresses (n m > 2 r (n+m)) + the
            rest uncompressed, over G/4
  sign_ef   1/32 + scales (one fp32 per tensor      worker residual (G) + server       the padded matrix, its
            piece, or per `sign_ef_block`)          residual (G/p)                     residual, the signs (~2.2 G)

Compute: bf16 two casts; powersgd 6 n m r FLOPs per compressed matrix (P = M Q, Q = M^T P, M' = P Q^T) plus the
error feedback's element-wise passes; sign_ef ~14 element-wise passes over G (error feedback, scales, pack, unpack,
decompress, both phases). Each also costs operator launches (per parameter for powersgd and sign_ef).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.modes import Compression

FP32 = 4


@dataclass(frozen=True)
class CompressionCost:
    wire_fraction: float = 1.0  # bytes on the wire / those of the uncompressed fp32 reduction
    state_bytes: int = 0  # kept from step to step (error feedback, PowerSGD's Q)
    transient_bytes: int = 0  # alive while the hook runs
    memory_bytes: float = 0.0  # element-wise memory traffic of compressing and decompressing
    gemm_flops: float = 0.0  # PowerSGD's matrix products
    ops: int = 0  # operator launches per step
    collectives: int = 1  # collectives per bucket (latency): powersgd 3, sign_ef 2 (all-to-all + all-gather)


def powersgd_matrix(shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """torch's powerSGD_hook's decision for one gradient: (n, m, r) when it compresses the tensor as an n x m matrix
    (n = shape[0], m = numel / n) of rank r = min(n, m, rank), i.e. when r (n + m) x 2 < n m (its
    min_compression_rate 2); None when it sends it uncompressed (vectors, small matrices)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = math.prod(shape) // max(n, 1)
    r = min(n, m, rank)
    return (n, m, r) if r * (n + m) * 2 < n * m else None


def powersgd_split(shapes: list[tuple[int, ...]], rank: int) -> tuple[list[tuple[int, int, int]], int]:
    """([(n, m, r) of the matrices PowerSGD compresses], elements it sends uncompressed)."""
    compressed, plain = [], 0
    for shape in shapes:
        matrix = powersgd_matrix(shape, rank)
        if matrix is None:
            plain += math.prod(shape)
        else:
            compressed.append(matrix)
    return compressed, plain


def compression_cost(comp: Compression, shapes: list[tuple[int, ...]], p: int) -> CompressionCost:
    """The cost of compressing the gradients of `shapes` (what one rank reduces) over p ranks."""
    numel = sum(math.prod(s) for s in shapes)
    if not comp.enabled or numel == 0 or p <= 1:
        return CompressionCost()
    G = numel * FP32
    if comp.casts_to_bf16:
        return CompressionCost(0.5, 0, G // 2, 3 * G, 0.0, 2)
    if comp.low_rank:
        compressed, plain = powersgd_split(shapes, comp.powersgd_rank)
        sent = plain + sum(r * (n + m) for n, m, r in compressed)
        q = sum(m * r for _, m, r in compressed) * FP32
        pmem = sum(n * r for n, _, r in compressed) * FP32
        flops = sum(6 * n * m * r + 4 * (n + m) * r * r for n, m, r in compressed)
        return CompressionCost(sent / numel, G + q, G + pmem + plain * FP32, 8 * G, flops, 12 * len(compressed) + 8, 3)
    # sign_ef: 1 bit per element, scales per tensor piece (one per parameter and rank) or per block
    block = comp.sign_ef_block
    scales = numel / block if block else len(shapes) * p
    sent = numel / 8 + FP32 * scales
    return CompressionCost(sent / G, G + math.ceil(G / p), int(2.2 * G), 14 * G, 0.0, 20 + 6 * len(shapes), 2)
