"""Observability: the Prometheus endpoint and TensorBoard agree with the JSONL log, `paratrain report` plots and
summarises finished runs, `paratrain doctor` checks the environment."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import fast_config, fast_overrides
from paratrain import cli
from paratrain.distributed.launch import free_port
from paratrain.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = ["training.steps=6", "training.log_every=2", "training.eval_every=3", "checkpoint.every=2",
       "metrics.prometheus_linger_s=30"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def scrape(port: int, path: str = "/metrics") -> dict:
    """{(metric name, ((label, value), ...)): value} from one scrape of the endpoint (no proxies involved)."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(metrics: dict, name: str, **labels):
    matches = [v for (n, lab), v in metrics.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items())]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


class Scraper(threading.Thread):
    """Scrapes the endpoint every 20 ms while a run goes on; `scrapes` holds every successful one, in order."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.scrapes, self.stop = port, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                self.scrapes.append(scrape(self.port))
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.02)

    def finish(self) -> list[dict]:
        self.stop.set()
        self.join(10)
        return self.scrapes


def steps_of(records):
    return {r["step"]: r for r in records if "loss" in r}


def check_scrapes_against_log(scrapes: list[dict], records: list[dict], run_name: str) -> dict:
    """Every scrape that shows step k shows the JSONL values of step k; the last one shows the end of the run."""
    by_step = steps_of(records)
    seen = [m for m in scrapes if any(n == "paratrain_step" for n, _ in m)]
    assert seen, "no scrape saw a training step"
    for m in seen:
        r = by_step[int(value(m, "paratrain_step", run=run_name))]
        assert value(m, "paratrain_loss") == r["loss"]  # the exposition format round-trips floats exactly
        assert value(m, "paratrain_learning_rate") == r["lr"]
        assert value(m, "paratrain_grad_norm") == r["grad_norm"]
        assert value(m, "paratrain_step_time_seconds", phase="total") == r["step_time_s"]
    final = seen[-1]
    last = by_step[max(by_step)]
    assert value(final, "paratrain_step") == last["step"] == 6
    assert value(final, "paratrain_tokens") == last["tokens"]
    assert value(final, "paratrain_tokens_per_second") == last["tokens_per_s"]
    assert value(final, "paratrain_tokens_per_second_per_device") == last["tokens_per_s_per_device"]
    assert value(final, "paratrain_samples_per_second") == last["samples_per_s"]
    assert value(final, "paratrain_mfu_ratio") == last["mfu"]
    assert value(final, "paratrain_skipped_steps") == last["skipped_steps"] == 0
    assert value(final, "paratrain_restarts") == last["restarts"] == 0
    for phase, key in (("compute", "compute_time_s"), ("data_wait", "data_time_s"), ("comm_wait", "comm_time_s")):
        assert value(final, "paratrain_step_time_seconds", phase=phase) == last[key]
    assert value(final, "paratrain_val_loss") == records[-2]["val_loss"]  # the end-of-run evaluation
    saves = [r["checkpoint_save_s"] for r in records if "checkpoint_save_s" in r]
    assert saves and value(final, "paratrain_checkpoint_save_seconds") == saves[-1]
    assert time.time() - 120 < value(final, "paratrain_last_step_timestamp_seconds") <= time.time()
    mem = [r for r in records if "rank_memory" in r][-1]["rank_memory"]
    for row in mem:
        assert row["rss_bytes"] > 0
        assert value(final, "paratrain_memory_bytes", rank=str(row["rank"]), kind="rss") == row["rss_bytes"]
    return final


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("observability")


@pytest.fixture(scope="module")
def single_run(char_data, runs_dir):
    """One process, Prometheus and TensorBoard on; scraped over HTTP while it trains and during its linger."""
    from paratrain.api import train_rank as train

    port = free_port()
    cfg = fast_config(char_data, runs_dir, "one", *RUN, f"metrics.prometheus_port={port}", "metrics.tensorboard=true",
                      "metrics.numerics_every=3")
    scraper = Scraper(port)
    scraper.start()
    t0 = time.perf_counter()
    result = train(cfg)
    elapsed = time.perf_counter() - t0
    return cfg, result, scraper.finish(), port, elapsed


@pytest.fixture(scope="module")
def two_rank_run(char_data, runs_dir):
    """Two gloo ranks launched like `paratrain train --nproc 2`; rank 0 serves the node's endpoint."""
    from paratrain.api import run_rank
    from paratrain.distributed.launch import launch

    port = free_port()
    cfg = fast_config(char_data, runs_dir, "two", *RUN, f"metrics.prometheus_port={port}",
                      "parallel.dp_mode=ddp", "training.micro_batch=2")  # the global batch of "one"
    scraper = Scraper(port)
    scraper.start()
    launch(run_rank, (cfg,), 2)
    return cfg, scraper.finish()


def test_prometheus_endpoint_matches_jsonl(single_run):
    cfg, result, scrapes, port, elapsed = single_run
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    final = check_scrapes_against_log(scrapes, records, "one")
    last = steps_of(records)[6]
    assert last["tokens_per_s"] / last["samples_per_s"] == pytest.approx(cfg.training.seq_len)  # sequences per second
    assert value(final, "paratrain_run_info", scope="node", exporter_rank="0", world_size="1") == 1
    assert value(final, "paratrain_loss") == result.losses[-1]
    assert elapsed < 25  # the linger ended at the first scrape after the run, not after 30 s
    with pytest.raises(OSError):  # and the endpoint is gone afterwards
        scrape(port)


def test_step_time_split_and_rank_stats_in_jsonl(single_run):
    cfg, *_ = single_run
    by_step = steps_of(read_jsonl(cfg.run_dir / "metrics.jsonl"))
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    for step, r in by_step.items():
        parts = [r["data_time_s"], r["compute_time_s"], r["comm_time_s"]]
        assert all(math.isfinite(p) and p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(r["step_time_s"], rel=1e-6, abs=1e-9)
        # memory is gathered on log steps only (first step, every log_every, evals): one collective each
        assert ("rank_memory" in r) == (step in (1, 2, 3, 4, 6)), step
    assert [row["rank"] for row in by_step[6]["rank_memory"]] == [0]


def test_tensorboard_scalars_match_jsonl(single_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, *_ = single_run
    by_step = steps_of(read_jsonl(cfg.run_dir / "metrics.jsonl"))
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == sorted(by_step)
    for step, v in loss.items():
        assert v == pytest.approx(by_step[step]["loss"], rel=1e-6)  # TensorBoard stores float32
    assert {e.step for e in acc.Scalars("memory/rss_bytes/rank0")} == {1, 2, 3, 4, 6}
    assert [e.step for e in acc.Scalars("val/loss")] == [3, 6]


def test_numerics_watch_reaches_every_sink(single_run):
    """metrics.numerics_every=3: steps 3 and 6 carry per-row statistics in the log; Prometheus and TensorBoard show
    the same numbers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, scrapes, _, _ = single_run
    by_step = steps_of(read_jsonl(cfg.run_dir / "metrics.jsonl"))
    assert [s for s, r in by_step.items() if "numerics" in r] == [3, 6]
    n = by_step[6]["numerics"]
    assert n["rows"] == ["embed", "0", "1", "head"]
    for kind in ("act", "grad", "weight"):
        assert all(0 < v < 100 for v in n[f"{kind}_max"]) and all(0 < v <= m for v, m in zip(n[f"{kind}_rms"],
                                                                                       n[f"{kind}_max"]))
    assert n["attn_logit_max"][0] is None and n["attn_logit_max"][3] is None  # blocks only
    assert all(v is not None for v in n["attn_logit_max"][1:3] + n["mlp_max"][1:3])
    assert all(100 < b < 140 for b in n["headroom_bits"]["bf16"]) and all(b > 10 for b in n["headroom_bits"]["fp16"])
    assert by_step[6]["numerics_headroom_bits"] == min(n["headroom_bits"]["bf16"])
    final = [m for m in scrapes if any(name == "paratrain_step" for name, _ in m)][-1]
    assert value(final, "paratrain_numerics_max_abs", row="1", kind="activation") == n["act_max"][2]
    assert value(final, "paratrain_numerics_rms", row="head", kind="gradient") == n["grad_rms"][3]
    assert value(final, "paratrain_numerics_headroom_bits", row="0", format="fp16") == n["headroom_bits"]["fp16"][1]
    assert value(final, "paratrain_numerics_min_headroom_bits") == by_step[6]["numerics_headroom_bits"]
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("numerics/act_max/1")] == [
        (s, pytest.approx(by_step[s]["numerics"]["act_max"][2], rel=1e-6)) for s in (3, 6)]


def test_prometheus_two_ranks_labelled_by_rank(two_rank_run):
    cfg, scrapes = two_rank_run
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    final = check_scrapes_against_log(scrapes, records, "two")
    assert value(final, "paratrain_run_info", world_size="2", scope="node") == 1
    ranks = {dict(lab)["rank"] for (n, lab) in final if n == "paratrain_memory_bytes"}
    assert ranks == {"0", "1"}
    last = steps_of(records)[6]
    assert last["tokens_per_s"] == pytest.approx(2 * last["tokens_per_s_per_device"])


def test_per_rank_endpoints():
    """per_rank: each rank's endpoint shows its own memory (and the job-wide values)."""
    from paratrain.observe.metrics import PrometheusSink

    rows = [{"rank": r, "node": 0, "rss_bytes": 100 + r} for r in range(2)]
    record = {"time": time.time(), "step": 3, "loss": 1.5, "rank_memory": rows}
    sinks = [PrometheusSink("127.0.0.1", 0, run="r", rank=r, per_rank=True) for r in range(2)]
    try:
        for s in sinks:
            s.write(record)
        for r, s in enumerate(sinks):
            m = scrape(s.port)
            assert value(m, "paratrain_memory_bytes", kind="rss") == 100 + r
            assert value(m, "paratrain_memory_bytes", rank=str(r)) == 100 + r
            assert value(m, "paratrain_run_info", scope="rank", exporter_rank=str(r)) == 1
            assert value(m, "paratrain_loss") == 1.5
    finally:
        for s in sinks:
            s.close()


def test_moe_expert_load_reaches_prometheus_and_report(char_data, runs_dir, tmp_path):
    """A mixture-of-experts run: the trainer's per-step expert load goes to the endpoint and the report."""
    from paratrain.observe.report import write_report
    from paratrain.api import train_rank as train

    port = free_port()
    cfg = fast_config(char_data, runs_dir, "moe", "training.steps=3", "model.moe_experts=4", "model.moe_top_k=2",
                      f"metrics.prometheus_port={port}", "metrics.prometheus_linger_s=30")
    scraper = Scraper(port)
    scraper.start()
    train(cfg)
    final = scraper.finish()[-1]
    last = steps_of(read_jsonl(cfg.run_dir / "metrics.jsonl"))[3]
    tokens = last["moe_tokens_per_expert"]
    assert len(tokens) >= 1 and all(len(layer) == 4 for layer in tokens)
    assert value(final, "paratrain_moe_max_violation") == last["moe_max_violation"]
    assert value(final, "paratrain_moe_aux_loss") == last["moe_aux_loss"]
    for i, layer in enumerate(tokens):
        for e, v in enumerate(layer):
            assert value(final, "paratrain_moe_expert_tokens", moe_layer=str(i), expert=str(e)) == v
        assert value(final, "paratrain_moe_layer_violation", moe_layer=str(i)) == pytest.approx(
            max(layer) / (sum(layer) / len(layer)) - 1)
        assert value(final, "paratrain_moe_layer_dropped_share", moe_layer=str(i)) == 0  # (no capacity limit)
    write_report([cfg.run_dir], tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Expert load" in md and f"| {last['moe_max_violation']:.2f} |" in md
    assert (tmp_path / "expert_load.png").stat().st_size > 0


def test_rank_stats_and_phase_timer():
    from paratrain.observe.sysmetrics import PhaseTimer, gather_rank_stats

    out = gather_rank_stats(torch.device("cpu"))
    assert [row["rank"] for row in out["rank_memory"]] == [0] and out["rank_memory"][0]["rss_bytes"] > 0
    timer = PhaseTimer()
    t0 = timer.start()
    with timer("data_time_s"):
        time.sleep(0.01)
    split = timer.split(time.perf_counter() - t0)
    assert split["data_time_s"] >= 0.01 and split["comm_time_s"] == 0 and split["compute_time_s"] >= 0


def test_missing_optional_dependency_is_one_line(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    code = cli.main(["train", *[f"--{o}" for o in fast_overrides(char_data, tmp_path, "nodep",
                                                                 "metrics.prometheus_port=9400")]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: metrics.prometheus_port is set but prometheus_client is not installed: "
                          "pip install prometheus_client") and err.count("\n") == 1
    assert not (tmp_path / "nodep").exists()  # nothing written, nothing trained
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        from paratrain.api import train_rank as train

        train(fast_config(char_data, tmp_path, "nodep", "metrics.tensorboard=true"))
    with pytest.raises(ConfigError, match="prometheus_port must be 0"):
        train(fast_config(char_data, tmp_path, "nodep", "metrics.prometheus_port=70000"))


# -- paratrain report --------------------------------------------------------------------------------

def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_report_plots_and_summary(single_run, two_rank_run, tmp_path):
    from PIL import Image

    from paratrain.observe.report import load_run, plot_loss, plot_memory

    one, two = single_run[0].run_dir, two_rank_run[0].run_dir
    out = tmp_path / "report"
    assert cli.main(["report", str(one), str(two), "--out", str(out)]) == 0
    for name in ("loss.png", "throughput.png", "memory.png", "numerics-one.png"):
        w, h = png_size(out / name)
        assert w >= 400 and h >= 300
        with Image.open(out / name) as im:
            im.verify()

    # the plotted data is the log's
    records = read_jsonl(one / "metrics.jsonl")
    by_step = steps_of(records)
    fig = plot_loss([load_run(one)])
    train_line, val_line = fig.axes[0].lines[:2]
    assert list(train_line.get_xdata()) == sorted(by_step)
    assert list(train_line.get_ydata()) == [by_step[s]["loss"] for s in sorted(by_step)]
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert list(zip(val_line.get_xdata(), val_line.get_ydata())) == vals
    tokens_line = fig.axes[1].lines[0]
    assert list(tokens_line.get_xdata()) == [by_step[s]["tokens"] for s in sorted(by_step)]
    mem = plot_memory([load_run(two)])
    assert len(mem.axes[0].lines) == 2  # one line per rank

    # the summary's numbers are the log's
    summary = json.loads((out / "summary.json").read_text())
    s1, s2 = summary["runs"]
    best = min(vals, key=lambda v: v[1])
    assert (s1["name"], s1["world_size"], s2["name"], s2["world_size"]) == ("one", 1, "two", 2)
    assert s1["final_loss"] == by_step[6]["loss"] and s1["steps"] == 6
    assert (s1["best_val_step"], s1["best_val_loss"]) == best and s1["final_val_loss"] == records[-2]["val_loss"]
    assert summary["scaling"] == [] and summary["scaling_note"].startswith("No scaling curve")  # not a sweep's runs
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| one |"))
    assert f"| {by_step[6]['loss']:.4f} |" in row and f"| {best[1]:.4f} ({best[0]}) |" in row
    assert "## Scaling" not in md and not (out / "scaling.png").exists()

    # one run: default output folder inside the run, no scaling plot
    assert cli.main(["report", str(one)]) == 0
    assert (one / "report" / "loss.png").is_file() and not (one / "report" / "scaling.png").exists()


def test_report_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1, "val_loss": 2.0}\n{"step": 2, "lo')
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "no training steps logged" in capsys.readouterr().err


# -- paratrain doctor --------------------------------------------------------------------------------

def test_doctor_runs_cleanly_on_cpu(tmp_path, monkeypatch, capsys):
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"):
        monkeypatch.delenv(var, raising=False)
    code = cli.main(["doctor", "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAIL" not in out.replace("0 FAIL", "")
    if not torch.cuda.is_available():
        assert "CPU-only machine" in out
        line = next(line for line in out.splitlines() if line.split()[1:2] == ["all-reduce"])
        assert line.startswith("OK") and "2 gloo ranks" in line and "bus bandwidth" in line


def test_doctor_bad_nccl_socket_ifname(monkeypatch, capsys):
    from paratrain.observe.doctor import interfaces

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif7")
    code = cli.main(["doctor", "--nproc", "0"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert "NCCL_SOCKET_IFNAME='nosuchif7' matches no network interface" in line
    assert all(name in line for name in interfaces())  # and names the ones that exist


def test_ifname_syntax_and_topology():
    from paratrain.observe.doctor import describe_topology, ifname_matches, parse_topology

    have = ["docker0", "eth0", "eth1", "ib0", "lo"]
    assert ifname_matches("eth", have) == ["eth0", "eth1"]
    assert ifname_matches("=eth", have) == []
    assert ifname_matches("=eth1,ib", have) == ["eth1", "ib0"]
    assert ifname_matches("^docker,lo", have) == ["eth0", "eth1", "ib0"]

    nvlink = """\
\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\tPXB\t0-47\t0
GPU1\tNV18\t X \tNV18\tPXB\t0-47\t0
GPU2\tNV18\tNV18\t X \tSYS\t48-95\t1
NIC0\tPXB\tPXB\tSYS\t X
"""
    links = parse_topology(nvlink)
    assert links[("GPU0", "GPU1")] == "NV18" and ("GPU0", "NIC0") not in links
    assert describe_topology(links).status == "OK"
    pcie = nvlink.replace("NV18\tNV18\t X", "SYS\tPHB\t X").replace("GPU0\t X \tNV18\tNV18", "GPU0\t X \tNV18\tSYS")
    result = describe_topology(parse_topology(pcie))
    assert result.status == "WARN" and "SYS" in result.message and "NVLink" in result.message


# -- what a person sees: the start-up banner, the live line or plain lines, no third-party noise -----------------------

BANNER_MAX_LINES = 8
# What paratrain/quiet.py filters (torchao with optimizer.name=adamw8bit; DTensor under fp16 FSDP), and any warning
THIRD_PARTY_NOISE = ("Failed to load", "is an Enum subclass", "Found a non-scalar tensor", "Warning:")


def cli_train(char_data, tmp_path, *overrides: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`paratrain train --nproc 2` at tiny size, as a person runs it (its stdout: a pipe unless given)."""
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "run", *overrides)]
    return subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--nproc", "2", *args], stdout=stdout,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})


def test_default_train_starts_with_a_short_banner_and_no_third_party_warnings(char_data, tmp_path):
    """In a pipe: at most 8 lines before the first step (model, layout, memory in one line each; no rank lines, no
    table: that is in the run folder), plain lines that say step N/M, and nothing on stderr from torchao or DTensor
    (adamw8bit and fp16 FSDP bring both)."""
    proc = cli_train(char_data, tmp_path, "metrics.progress=auto", "optimizer.name=adamw8bit",
                     "training.precision=fp16")
    out, err = (s.decode() for s in proc.communicate(timeout=300))
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    banner = lines[:first_step]
    assert len(banner) <= BANNER_MAX_LINES, "\n".join(banner)
    assert [line.split()[0] for line in banner] == ["model", "layout", "memory:"], "\n".join(banner)
    assert out.count("model tiny:") == 1 and not any(line.startswith("[rank") for line in lines)
    assert re.match(r"step +1/4 \| loss \d", lines[first_step]), lines[first_step]
    table = (tmp_path / "run" / "memory-estimate.txt").read_text()
    assert "at peak" in table and "at peak" not in out and str(tmp_path / "run" / "memory-estimate.txt") in banner[2]
    assert not [text for text in THIRD_PARTY_NOISE if text in err], err


def test_verbose_adds_the_memory_table_below_the_one_model_line(char_data, tmp_path, capsys):
    from paratrain.api import train_rank as train

    for verbose in ("false", "true"):
        cfg = fast_config(char_data, tmp_path, f"verbose-{verbose}", "metrics.progress=lines", "training.steps=1",
                          f"metrics.verbose={verbose}")
        train(cfg)
        out = capsys.readouterr().out
        assert ("at peak" in out) == (verbose == "true"), out
        assert out.count("model tiny:") == 1, out  # the table's own model line is not repeated
        assert "at peak" in (cfg.run_dir / "memory-estimate.txt").read_text()


def test_two_ranks_on_a_terminal_draw_one_live_line(char_data, tmp_path):
    """`--nproc 2` at a terminal: rank 0 writes to it (the ranks inherit the launcher's stdout) and draws the live
    line, not the plain lines."""
    import pty

    master, terminal = pty.openpty()
    proc = cli_train(char_data, tmp_path, "metrics.progress=auto", "training.log_every=1", stdout=terminal)
    os.close(terminal)
    chunks: list[bytes] = []

    def read() -> None:
        try:
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        except OSError:  # EIO: every process holding the terminal has ended
            pass

    reader = threading.Thread(target=read)
    reader.start()
    err = proc.communicate(timeout=300)[1].decode()
    reader.join(timeout=30)
    os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, shown + err
    live = r"step 4/4 \| loss \d\.\d{4} \| val \d\.\d{4} \| [\d,]+ tok/s \| elapsed \d+:\d\d \| ETA"
    assert re.search(live, shown), shown
    assert not re.search(r"^step +\d+/4 \|", shown, re.M), shown  # the plain lines are for pipes and files


def test_live_line_says_step_of_total_loss_throughput_elapsed_and_eta():
    from paratrain.observe.metrics import duration, format_record, live_line

    assert live_line(120, 2000, 3.21, 6294.4, 62, 980) == \
        "step 120/2000 | loss 3.2100 | 6,294 tok/s | elapsed 1:02 | ETA 16:20"
    assert live_line(0, 10, None, None, 3, None) == "step 0/10 | elapsed 0:03 | ETA -"  # before the first step
    assert duration(3723.9) == "1:02:03"
    assert format_record({"step": 10, "loss": 4.5, "tokens_per_s": 6294.0}, 2000) == \
        "step    10/2000 | loss 4.5000 | 6,294 tok/s"


def test_live_line_of_a_resumed_run_counts_from_its_start(monkeypatch):
    """Resumed at step 50 of 100: the line starts at 50/100, and the ETA follows the pace since the first step shown
    (the first step's time includes the start-up), counting down between log steps."""
    from paratrain.observe import metrics

    now = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    log = metrics.MetricsLog(None, total_steps=100, start_step=50, mode="bar")
    try:
        assert log.live_text() == "step 50/100 | elapsed 0:00 | ETA -"
        now[0] = 110.0
        log.log({"step": 51, "loss": 2.5, "tokens_per_s": 1000.0})
        now[0] = 120.0
        log.log({"step": 61, "loss": 2.0, "tokens_per_s": 2000.0})  # 10 steps in 10 s: 39 left
        assert log.live_text() == "step 61/100 | loss 2.0000 | 2,000 tok/s | elapsed 0:20 | ETA 0:39"
        now[0] = 130.0
        assert log.live_text().endswith("elapsed 0:30 | ETA 0:29")
    finally:
        log.close()


def test_memory_fit_line_is_one_line_with_the_verdict():
    from paratrain.training.loop import memory_fit_line

    gib = 2**30
    est = SimpleNamespace(total_bytes=int(1.2 * gib), gpu_bytes=80 * gib, fits=True, host={}, host_bytes=0,
                          suggestion=None)
    assert memory_fit_line(est, "runs/x/memory-estimate.txt") == \
        "memory: 1.20 GiB of 80.00 GiB per rank (estimate) fits; table: runs/x/memory-estimate.txt"
    est.fits, est.suggestion = False, {"change": "--parallel.dp_shard=8"}
    assert "(estimate) DOES NOT FIT (would fit: --parallel.dp_shard=8);" in memory_fit_line(est, "t")
    cpu = SimpleNamespace(total_bytes=2 * gib, gpu_bytes=None, fits=None, host={"optimizer": gib}, host_bytes=gib)
    assert memory_fit_line(cpu, "t") == "memory: 2.00 GiB per rank (estimate); host 1.00 GiB per rank; table: t"
