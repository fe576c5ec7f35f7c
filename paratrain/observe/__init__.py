"""Observability: what a run and its machine show about themselves.

This package owns everything that measures, exports or summarises, and nothing that trains:
- `metrics`: the one metrics path (JSONL log, progress display, Prometheus endpoint, TensorBoard);
- `sysmetrics`: per-rank memory numbers and their gather, the step-time split;
- `flops`: peak FLOP/s by device name (the denominator of MFU);
- `report`: `paratrain report`, plots and a summary of finished runs from their logs;
- `doctor`: `paratrain doctor`, checks of the environment (torch, GPUs, NCCL/gloo, disk, a collective).

Import the submodules directly (`from paratrain.observe.metrics import MetricsLog`); this file imports nothing, so
importing one of them does not pull in the others (report needs matplotlib, metrics' sinks optional packages).
"""
