"""One metrics path: each step's record goes to the JSONL log, the progress display, and the optional sinks.

The trainer builds one `record` dict per step and hands it to `MetricsLog.log`. From there:
- rank 0 appends it to `runs/<name>/metrics.jsonl` and shows it (progress bar or lines);
- a `PrometheusSink` (metrics.prometheus_port > 0) serves the latest values at http://HOST:PORT/metrics: by default
  one endpoint per node (local rank 0), with every rank's memory labelled `rank="N"`; with
  metrics.prometheus_per_rank each rank serves its own numbers on port + local_rank;
- a `TensorBoardSink` (metrics.tensorboard) writes scalars under `runs/<name>/tensorboard` (rank 0).

Record keys (all optional but `step`): loss, val_loss, lr, grad_norm, tokens_per_s, tokens_per_s_per_device,
samples_per_s (sequences per second), mfu,
step_time_s and its split data_time_s / compute_time_s / comm_time_s, skipped_steps, loss_scale (fp16), restarts,
tokens, rank_memory (list of per-rank dicts, log steps only; each with the `allocator` settings that rank started
with), on CUDA mem_fragmentation_mib (the worst rank's reserved - allocated) and alloc_retries (the caching
allocator's, all ranks; both absent on a CPU), checkpoint_save_s and checkpoint_step (duration and
step of the save made since the previous record), on the first record of each process layout, world_size, model and params, and with a
mixture-of-experts model moe_aux_loss, moe_max_violation (the worst layer's max_e load_e / mean load - 1),
moe_dropped_tokens, and per MoE layer moe_violation, moe_dropped_share (dropped assignments / all) and
moe_tokens_per_expert (from MoEMeter in distributed/expert_parallel.py), with metrics.numerics_every numerics (per row:
act_max/_rms/_nonfinite, attn_logit_max, mlp_, grad_, weight_max/_rms/_nonfinite, headroom_bits per format, the
first_nonfinite row) and
numerics_act_max, numerics_grad_max, numerics_headroom_bits (observe/numerics.py), and on a step the numerics watch
diagnosed nonfinite (module, rank, batch). mfu is null without a device peak (observe/flops.py).
The run's last record is {"step", "end": "finished" | "preempted" | "interrupted"} with the save made after the
last step, if any. Every step that ran keeps its record: a step whose update was skipped (non-finite) has
"skipped": true; steps run after a bad streak and undone by its rollback have "rolled_back": true.
A segment record {"step": S, "segment": "start" | "resume" | "rollback", ...} opens each start of the run and follows
each rollback: the records before it for steps after S were abandoned or undone; readers (`in_effect`) keep, for
each step, the record of the latest segment.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

from paratrain.errors import ConfigError, UserError

PIP_HINT = {"prometheus_client": "pip install prometheus_client  (or: pip install 'paratrain[prometheus]')",
            "tensorboard": "pip install tensorboard  (or: pip install 'paratrain[tensorboard]')"}


def check_metrics_config(m) -> None:
    """Config-only checks of the [metrics] sinks, including their optional dependencies. Raises ConfigError."""
    if not 0 <= m.prometheus_port <= 65535:
        raise ConfigError(f"metrics.prometheus_port must be 0 (off) or a TCP port up to 65535, got {m.prometheus_port}")
    if m.prometheus_linger_s < 0:
        raise ConfigError(f"metrics.prometheus_linger_s must be >= 0, got {m.prometheus_linger_s}")
    if m.prometheus_port and not m.prometheus_host:
        raise ConfigError("metrics.prometheus_host must be an address to listen on (e.g. 127.0.0.1)")
    if m.prometheus_port:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(f"metrics.prometheus_port is set but prometheus_client is not installed: "
                              f"{PIP_HINT['prometheus_client']}") from None
    if m.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(f"metrics.tensorboard=true but tensorboard is not installed: {PIP_HINT['tensorboard']}") from None


def build_sinks(m, env, run_name: str, run_dir: Path) -> list:
    """The sinks this rank feeds (`m`: the `[metrics]` section): Prometheus on local rank 0 (or every rank,
    per_rank), TensorBoard on rank 0 (in RUN_DIR/tensorboard)."""
    # lazy: loads torch, which this torch-free module's importers (--help, checks, estimate) do without
    from paratrain.observe.sysmetrics import node_index

    sinks = []
    check_metrics_config(m)
    if m.prometheus_port and (m.prometheus_per_rank or env.local_rank == 0):
        port = m.prometheus_port + (env.local_rank if m.prometheus_per_rank else 0)
        sinks.append(PrometheusSink(m.prometheus_host, port, run=run_name, rank=env.rank,
                                    node=node_index(env.rank), world_size=env.world_size,
                                    per_rank=m.prometheus_per_rank, linger_s=m.prometheus_linger_s))
    if m.tensorboard and env.is_main:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return sinks


class MetricsLog:
    def __init__(self, path: Path | None, total_steps: int, start_step: int, mode: str = "auto", enabled: bool = True,
                 sinks: list | None = None):
        self.enabled = enabled
        self.sinks = list(sinks or [])
        self.file = open(path, "a") if (path is not None and enabled) else None
        self.total, self.start_step = total_steps, start_step
        self.started = time.monotonic()  # the live line's elapsed time: this process's share of the run
        self.shown: dict = {}  # the shown records so far, merged (the live line's step, loss, val loss, tokens/s)
        # the ETA's time per step (StepPace), from the first record shown on: the start-up left out
        self.pace = StepPace()
        # (step, time) of the last shown record that moved the step: the next interval and the ETA's countdown start
        self.last_shown: tuple[int, float] | None = None
        if mode == "auto":  # (a launched rank writes to the launcher's terminal itself: the forkserver's stdout)
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.progress = None
        if self.mode == "bar":
            self.progress = live_display(self.live_text)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()
        for sink in self.sinks:
            if getattr(sink, "description", None):
                self.message(sink.description)

    def log(self, record: dict, show: bool = True) -> None:
        record = {"time": round(time.time(), 3), **record}
        if not record.get("rolled_back") and "segment" not in record:  # sinks show the run's numbers as it stands
            for sink in self.sinks:
                sink.write(record)
        if not self.enabled:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if not show:
            return
        if self.progress is not None:
            self._advance(record)
        elif self.mode == "lines":
            print(format_record(record, self.total), flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None and self.shown.get("step", -1) >= self.total:
            self.progress.stop()  # training is over: the live line stays where it is, above what the run says last
            self.progress = None
        if self.progress is not None:  # as printed: no markup ("[rank 1]") and no colours picked by rich
            self.progress.console.print(text, markup=False, highlight=False)
        elif self.mode != "none":
            print(text, flush=True)

    def _advance(self, record: dict) -> None:
        """The live line takes a shown record: its step, and what it has of loss, val loss and tokens/s."""
        now, step = time.monotonic(), record.get("step", self.start_step)
        self.shown.update({k: v for k, v in record.items() if v is not None})
        if self.last_shown is not None and step > self.last_shown[0]:
            self.pace.add(step - self.last_shown[0], now - self.last_shown[1])
        if self.last_shown is None or step != self.last_shown[0]:  # (a val loss record of the same step: no interval)
            self.last_shown = (step, now)
        self.progress.update(self.task, completed=step)

    def live_text(self) -> str:
        """The live line's text now (drawn about ten times a second: elapsed and ETA tick between log steps)."""
        now, step = time.monotonic(), self.shown.get("step", self.start_step)
        eta = None
        if self.pace.per_step is not None:
            eta = max(0.0, self.pace.per_step * (self.total - step) - (now - self.last_shown[1]))
        return live_line(step, self.total, self.shown.get("loss"), self.shown.get("tokens_per_s"), now - self.started,
                         eta, self.shown.get("val_loss"))

    def close(self, linger: bool = True) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file:
            self.file.close()
        for sink in self.sinks:
            if not linger and hasattr(sink, "linger_s"):
                sink.linger_s = 0
            sink.close()


# The live line's ETA: the steps left at an exponential moving average of the time per step over about the last
# PACE_SPAN_STEPS steps, so it follows a lasting change of pace (a machine that got busier) within a few hundred steps
# instead of averaging it away over the whole run. An interval between two shown records counts at most PACE_MAX_JUMP
# times the average so far (and at least 1 / PACE_MAX_JUMP of it): one stall (a swap storm, a minute of a busy machine)
# moves the ETA by a bounded share: a 10-step interval by at most 3 x (1 - (1 - 1/200)^10) = 15% once the span filled
# (a mean since the start would hide a lasting slow-down; the last interval alone would jump with each stall).
PACE_SPAN_STEPS = 200
PACE_MAX_JUMP = 4.0


class StepPace:
    """Seconds per step: an exponential moving average over the steps shown, an interval of k steps weighing
    1 - (1 - 1/span)^k; bias-corrected (divided by the weights' sum): the first intervals are not pulled towards 0."""

    def __init__(self, span: int = PACE_SPAN_STEPS, max_jump: float = PACE_MAX_JUMP):
        self.span, self.max_jump = span, max_jump
        self.weighted = 0.0  # the weighted sum of the intervals' seconds per step
        self.weights = 0.0

    def add(self, steps: int, seconds: float) -> None:
        """An interval of `steps` steps that took `seconds`."""
        if steps <= 0:
            return
        per_step = seconds / steps
        if self.weights:
            average = self.per_step
            per_step = min(max(per_step, average / self.max_jump), average * self.max_jump)
        keep = (1 - 1 / self.span) ** steps
        self.weighted = keep * self.weighted + (1 - keep) * per_step
        self.weights = keep * self.weights + (1 - keep)

    @property
    def per_step(self) -> float | None:
        return self.weighted / self.weights if self.weights else None


def in_effect(records: list[dict]) -> tuple[list[dict], list[tuple[dict, str]]]:
    """metrics.jsonl's records (in file order) as the run stands: each segment record (see the module's docstring)
    undoes the records before it for later steps. Returns (the records in effect, in order; the undone ones with the
    kind of segment that undid them: "rollback" for a rollback, "start"/"resume" for a later start of the run)."""
    kept: list[dict] = []
    undone: list[tuple[dict, str]] = []
    for r in records:
        kind, at = r.get("segment"), r.get("step")
        if isinstance(kind, str) and isinstance(at, int):
            undone += [(k, kind) for k in kept if isinstance(k.get("step"), int) and k["step"] > at]
            kept = [k for k in kept if not (isinstance(k.get("step"), int) and k["step"] > at)]
        kept.append(r)
    return kept, undone


def format_record(r: dict, total: int | None = None) -> str:
    """A record as one plain line (a pipe or a file: metrics.progress=lines): 'step    10/2000 | loss ... | ...'."""
    of = f"/{total}" if total is not None else ""
    parts = [f"step {r['step']:>5}{of}"] if "step" in r else []
    for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val {:.4f}"), ("lr", "lr {:.2e}"),
                     ("grad_norm", "gnorm {:.2f}"), ("tokens_per_s", "{:,.0f} tok/s"), ("mfu", "mfu {:.1%}")):
        if r.get(key) is not None:
            parts.append(fmt.format(r[key]))
    return " | ".join(parts)


def live_line(step: int, total: int, loss: float | None, tokens_per_s: float | None, elapsed_s: float,
              eta_s: float | None, val_loss: float | None = None) -> str:
    """The live line on a terminal: 'step 120/2000 | loss 3.2100 | 6,294 tok/s | elapsed 1:02 | ETA 16:20'
    (ETA '-' until two steps have been shown: the first one includes the start-up)."""
    parts = [f"step {step}/{total}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if val_loss is not None:
        parts.append(f"val {val_loss:.4f}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    parts.append(f"elapsed {duration(elapsed_s)}")
    parts.append(f"ETA {duration(eta_s) if eta_s is not None else '-'}")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """'0:07', '16:20', '2:03:04' (hours:minutes:seconds)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def live_display(text):
    """rich's display of the live line: a bar, then `text()`, called at each refresh."""
    # optional: rich's progress display (~50 ms to import) is loaded only for a terminal
    from rich.progress import BarColumn, Progress, ProgressColumn
    from rich.text import Text

    class LiveText(ProgressColumn):
        def render(self, task) -> Text:
            return Text(text())

    return Progress(BarColumn(bar_width=20), LiveText())


# -- Prometheus ---------------------------------------------------------------------------------

# record key -> (metric name, help). All gauges: a resumed or restarted run can go back in step.
PROM_SCALARS = {
    "step": ("paratrain_step", "Last completed optimizer step."),
    "tokens": ("paratrain_tokens", "Tokens trained on so far (global)."),
    "loss": ("paratrain_loss", "Training loss of the last step (mean over data-parallel ranks)."),
    "val_loss": ("paratrain_val_loss", "Last validation loss."),
    "lr": ("paratrain_learning_rate", "Learning rate of the last step."),
    "grad_norm": ("paratrain_grad_norm", "Gradient norm of the last step, before clipping."),
    "tokens_per_s": ("paratrain_tokens_per_second", "Training throughput, all devices together."),
    "tokens_per_s_per_device": ("paratrain_tokens_per_second_per_device", "Training throughput per device."),
    "samples_per_s": ("paratrain_samples_per_second", "Training throughput in sequences, all devices together."),
    "mfu": ("paratrain_mfu_ratio", "Model FLOPs utilisation (0..1) against the device peak."),
    "skipped_steps": ("paratrain_skipped_steps", "Optimizer steps skipped for non-finite gradients."),
    "loss_scale": ("paratrain_loss_scale", "fp16: the loss scale the last step ran at (the scaler halves it on an "
                   "overflow)."),
    "restarts": ("paratrain_restarts", "Times this run was relaunched after a failure."),
    "checkpoint_save_s": ("paratrain_checkpoint_save_seconds", "Duration of the last checkpoint save."),
    "mem_fragmentation_mib": ("paratrain_cuda_fragmentation_mib", "CUDA memory the caching allocator reserves "
                              "beyond what tensors use (reserved - allocated), worst rank, MiB."),
    "alloc_retries": ("paratrain_cuda_alloc_retries_total", "CUDA caching-allocator retries so far, all ranks."),
    "moe_aux_loss": ("paratrain_moe_aux_loss", "MoE load-balancing loss, unscaled (1.0 = balanced)."),
    "moe_max_violation": ("paratrain_moe_max_violation", "Max load violation, worst MoE layer: busiest expert's "
                          "tokens over the mean, minus 1 (0 = balanced)."),
    "moe_dropped_tokens": ("paratrain_moe_dropped_tokens", "Expert assignments dropped by the capacity limit, last step."),
    "numerics_headroom_bits": ("paratrain_numerics_min_headroom_bits",
                               "Least headroom of any layer's largest activation to the bf16 (fp16 runs: fp16) "
                               "maximum, in bits, at the last watched step (metrics.numerics_every)."),
}
# per MoE layer (lists in the record): {record key: (Prometheus name, help)}; TensorBoard: moe/<key>/<layer>
MOE_LAYER_SERIES = {
    "moe_violation": ("paratrain_moe_layer_violation", "Per MoE layer: max load violation, busiest expert's tokens "
                      "over the mean, minus 1 (0 = balanced)."),
    "moe_dropped_share": ("paratrain_moe_layer_dropped_share", "Per MoE layer: the share of its expert assignments "
                          "the capacity limit dropped, last step."),
}
NUMERICS_KINDS = {"act": "activation", "attn_logit": "attention_logit", "mlp": "mlp_hidden", "grad": "gradient",
                  "weight": "weight"}
PHASES = {"step_time_s": "total", "compute_time_s": "compute", "data_time_s": "data_wait", "comm_time_s": "comm_wait"}
MEMORY_KINDS = {"rss_bytes": "rss", "rss_peak_bytes": "rss_peak", "cuda_allocated_bytes": "cuda_allocated",
                "cuda_reserved_bytes": "cuda_reserved", "cuda_peak_allocated_bytes": "cuda_peak_allocated"}


class PrometheusSink:
    """Serves the latest values of the run at http://host:port/metrics (text exposition format).

    `per_rank=False`: the node's endpoint (local rank 0) with the memory of every rank on the node, labelled
    `rank`. `per_rank=True`: this rank's own memory. Job-wide values (loss, lr, ...) are on every endpoint.
    Every series carries `run`; `paratrain_run_info` says which rank serves and for which scope.

    `linger_s`: at close, keep serving until one scrape has read the final values, or linger_s seconds.
    """

    def __init__(self, host: str, port: int, run: str, rank: int = 0, node: int = 0, world_size: int = 1,
                 per_rank: bool = False, linger_s: float = 0.0):
        import socket  # lazy: the planner's commands import this module and serve nothing

        from prometheus_client import CollectorRegistry, start_http_server

        self.run, self.rank, self.node, self.world_size, self.per_rank = run, rank, node, world_size, per_rank
        self.linger_s = linger_s
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._scalars: dict[str, float] = {}
        self._phases: dict[str, float] = {}
        self._memory: list[dict] = []
        self._experts: list[list[float]] = []
        self._moe_layers: dict[str, list[float]] = {}  # {moe_violation | moe_dropped_share: per MoE layer}
        self._numerics: dict | None = None
        self._downstream: dict = {}  # {task: {metric: value}} of the last downstream evaluation
        self._last_step_time: float | None = None
        self._closing = threading.Event()
        self._final_scraped = threading.Event()
        self._final_scrape_thread: threading.Thread | None = None

        self.registry = CollectorRegistry()
        self.registry.register(self)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(f"metrics.prometheus_port: cannot serve metrics on {host}:{port} "
                            f"({e.strerror or e}); choose another port") from None
        self.port = self.server.server_address[1]
        scope = "rank" if per_rank else "node"
        self.description = (f"prometheus: http://{host}:{self.port}/metrics ({scope} endpoint, served by rank {rank}"
                            + ("; other ranks on port + local rank)" if per_rank else ")"))

    # -- fed by MetricsLog -----------------------------------------------------------------------
    def write(self, record: dict) -> None:
        with self._lock:  # one record is one update: a scrape never mixes two steps
            for key in PROM_SCALARS:
                if _is_number(record.get(key)):
                    self._scalars[key] = float(record[key])
            for key, phase in PHASES.items():
                if _is_number(record.get(key)):
                    self._phases[phase] = float(record[key])
            if "loss" in record:
                self._last_step_time = record.get("time", time.time())
            if isinstance(record.get("rank_memory"), list):
                rows = record["rank_memory"]
                self._memory = [r for r in rows if (r.get("rank") == self.rank if self.per_rank
                                                    else r.get("node", 0) == self.node)]
            if isinstance(record.get("moe_tokens_per_expert"), list):
                self._experts = record["moe_tokens_per_expert"]
            self._moe_layers.update({k: record[k] for k in MOE_LAYER_SERIES if isinstance(record.get(k), list)})
            if isinstance(record.get("numerics"), dict):
                self._numerics = record["numerics"]
            if isinstance(record.get("downstream"), dict):
                self._downstream = record["downstream"]

    # -- the collector protocol ------------------------------------------------------------------
    def collect(self):
        """Called by the registry on each scrape, in the server thread that answers it."""
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            scalars, phases, memory = dict(self._scalars), dict(self._phases), list(self._memory)
            experts, last, numerics = list(self._experts), self._last_step_time, self._numerics
            moe_layers = dict(self._moe_layers)
            downstream = dict(self._downstream)
        final = self._closing.is_set()  # values are final once close() began: nothing writes after that
        run = [self.run]
        info = GaugeMetricFamily("paratrain_run_info", "Which run this endpoint belongs to and what it covers.",
                                 labels=["run", "world_size", "scope", "exporter_rank", "node", "host"])
        info.add_metric([self.run, str(self.world_size), "rank" if self.per_rank else "node", str(self.rank),
                         str(self.node), self.host], 1.0)
        yield info
        for key, (name, help_text) in PROM_SCALARS.items():
            if key in scalars:
                yield _gauge(name, help_text, ["run"], [(run, scalars[key])])
        if last is not None:
            yield _gauge("paratrain_last_step_timestamp_seconds",
                         "Unix time of the last completed step (alert on time() - this to catch a stalled run).",
                         ["run"], [(run, last)])
        if phases:
            yield _gauge("paratrain_step_time_seconds",
                         "Last step's wall time: total, and its split into compute, data_wait and comm_wait "
                         "(comm_wait: the explicit loss all-reduce; gradient collectives overlap compute and count "
                         "as compute).", ["run", "phase"], [(run + [p], v) for p, v in phases.items()])
        if memory:
            yield _gauge("paratrain_memory_bytes", "Memory per rank: rss (process resident set), rss_peak, and on "
                         "CUDA cuda_allocated, cuda_reserved, cuda_peak_allocated.", ["run", "rank", "node", "kind"],
                         [(run + [str(r["rank"]), str(r.get("node", 0)), kind], float(r[key]))
                          for r in memory for key, kind in MEMORY_KINDS.items() if _is_number(r.get(key))])
            for key, name, help_text in (
                    ("cuda_alloc_retries", "paratrain_cuda_alloc_retries",
                     "CUDA caching-allocator retries (cudaMalloc failed, cache flushed): memory pressure."),
                    ("cuda_ooms", "paratrain_cuda_ooms", "CUDA out-of-memory errors raised by the allocator.")):
                samples = [(run + [str(r["rank"]), str(r.get("node", 0))], float(r[key])) for r in memory if key in r]
                if samples:
                    yield _gauge(name, help_text, ["run", "rank", "node"], samples)
        if experts:
            yield _gauge("paratrain_moe_expert_tokens", "Tokens routed to each expert in the last step (global batch); "
                         "moe_layer counts MoE layers from 0.", ["run", "moe_layer", "expert"],
                         [(run + [str(i), str(e)], float(v)) for i, layer in enumerate(experts)
                          for e, v in enumerate(layer)])
        for key, (name, help_text) in MOE_LAYER_SERIES.items():
            if moe_layers.get(key):
                yield _gauge(name, help_text, ["run", "moe_layer"],
                             [(run + [str(i)], float(v)) for i, v in enumerate(moe_layers[key]) if _is_number(v)])
        if numerics:
            yield from _numerics_gauges(run, numerics)
        samples = [(run + [task, metric], float(v)) for task, values in downstream.items()
                   for metric, v in values.items() if _is_number(v)]
        if samples:
            yield _gauge("paratrain_downstream", "Last downstream evaluation ([eval]): lm-eval's metric per task "
                         "(acc, acc_norm, exact_match, word/byte perplexity, bits_per_byte, ...).",
                         ["run", "task", "metric"], samples)
        if final:
            self._final_scrape_thread = threading.current_thread()
            self._final_scraped.set()

    def close(self) -> None:
        self._closing.set()
        if self.linger_s > 0 and self._final_scraped.wait(self.linger_s):
            self._final_scrape_thread.join(timeout=5)  # the handler ends once that response is written
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _numerics_gauges(run: list[str], n: dict):
    """The last watched step's per-layer statistics (row: embed, the block index, head)."""
    rows = n["rows"]
    stats = (("max", "paratrain_numerics_max_abs", "Largest |x| per layer and kind at the last watched step "
              "(attention_logit: the largest logit before softmax)."),
             ("rms", "paratrain_numerics_rms", "RMS per layer and kind at the last watched step."))
    for stat, name, help_text in stats:
        samples = [(run + [row, label], float(v)) for kind, label in NUMERICS_KINDS.items()
                   for row, v in zip(rows, n.get(f"{kind}_{stat}") or []) if _is_number(v)]
        if samples:
            yield _gauge(name, help_text, ["run", "row", "kind"], samples)
    samples = [(run + [row, fmt], float(v)) for fmt, values in n["headroom_bits"].items()
               for row, v in zip(rows, values) if _is_number(v)]
    if samples:
        yield _gauge("paratrain_numerics_headroom_bits", "Per layer: log2(format max / largest activation), bits "
                     "before the format overflows.", ["run", "row", "format"], samples)


def _gauge(name: str, help_text: str, labels: list[str], samples: list[tuple[list[str], float]]):
    from prometheus_client.core import GaugeMetricFamily

    g = GaugeMetricFamily(name, help_text, labels=labels)
    for label_values, value in samples:
        g.add_metric(label_values, value)
    return g


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- TensorBoard --------------------------------------------------------------------------------

TB_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "throughput/tokens_per_s", "tokens_per_s_per_device": "throughput/tokens_per_s_per_device",
           "samples_per_s": "throughput/samples_per_s",
           "mfu": "throughput/mfu", "step_time_s": "time/step_s", "compute_time_s": "time/compute_s",
           "data_time_s": "time/data_wait_s", "comm_time_s": "time/comm_wait_s", "skipped_steps": "train/skipped_steps",
           "loss_scale": "train/loss_scale", "restarts": "train/restarts", "checkpoint_save_s": "time/checkpoint_save_s",
           "mem_fragmentation_mib": "memory/fragmentation_mib", "alloc_retries": "memory/alloc_retries",
           "moe_aux_loss": "moe/aux_loss",
           "moe_max_violation": "moe/max_violation", "moe_dropped_tokens": "moe/dropped_tokens",
           "numerics_act_max": "numerics/act_max", "numerics_grad_max": "numerics/grad_max",
           "numerics_headroom_bits": "numerics/min_headroom_bits"}


class TensorBoardSink:
    """Scalars for TensorBoard (`tensorboard --logdir runs/<name>/tensorboard`), x axis = step."""

    def __init__(self, logdir: Path):
        # optional: tensorboard is an extra
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(logdir))
        self.description = f"tensorboard: {logdir}"

    def write(self, record: dict) -> None:
        step, wall = record.get("step"), record.get("time")
        if step is None:
            return
        for key, tag in TB_TAGS.items():
            if _is_number(record.get(key)) and math.isfinite(record[key]):
                self.writer.add_scalar(tag, record[key], step, walltime=wall)
        for row in record.get("rank_memory") or []:
            for key in MEMORY_KINDS:
                if _is_number(row.get(key)):
                    self.writer.add_scalar(f"memory/{key}/rank{row['rank']}", row[key], step, walltime=wall)
        for key in MOE_LAYER_SERIES:
            for i, v in enumerate(record.get(key) or []):
                if _is_number(v) and math.isfinite(v):
                    self.writer.add_scalar(f"moe/{key.removeprefix('moe_')}/{i}", v, step, walltime=wall)
        n = record.get("numerics")
        if isinstance(n, dict):
            for kind in NUMERICS_KINDS:
                for stat in ("max", "rms"):
                    for row, v in zip(n["rows"], n.get(f"{kind}_{stat}") or []):
                        if _is_number(v) and math.isfinite(v):
                            self.writer.add_scalar(f"numerics/{kind}_{stat}/{row}", v, step, walltime=wall)
        for task, values in (record.get("downstream") or {}).items():
            for metric, v in values.items():
                if _is_number(v) and math.isfinite(v):
                    self.writer.add_scalar(f"downstream/{task}/{metric}", v, step, walltime=wall)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
