"""The numerics watch's pieces: the attention-logit maximum, the headroom, the report's heat map from a log, the
one-line finding, and the out-of-memory evidence. The whole path (a weight made to overflow on rank 1 of 2, named in
the run's message, replayed, drawn) runs in tests/test_journeys.py (troubleshooting); the sinks in
tests/test_observability.py; the hot path with the watch on in tests/test_hot_path.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import fast_config
from paratrain.observe.numerics import Finding, headroom_bits, max_logit, row_names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_max_logit_is_the_largest_causal_score():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8)  # grouped-query: 2 KV heads serve 4 query heads
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    assert max_logit(q, k).item() == pytest.approx(scores.masked_fill(~causal, -math.inf).amax().item(), rel=1e-6)
    # queries chunked (a long sequence): the same maximum
    import paratrain.observe.numerics as numerics

    chunk, numerics.LOGIT_CHUNK = numerics.LOGIT_CHUNK, 2 * 4 * 7 * 2
    try:
        assert max_logit(q, k).item() == pytest.approx(scores.masked_fill(~causal, -math.inf).amax().item(), rel=1e-6)
    finally:
        numerics.LOGIT_CHUNK = chunk


def test_headroom_and_finding_text():
    bf16, fp16 = torch.finfo(torch.bfloat16).max, torch.finfo(torch.float16).max
    assert headroom_bits(fp16 / 8, fp16) == pytest.approx(3.0)
    assert headroom_bits(math.inf, bf16) == 0.0 and headroom_bits(math.nan, bf16) == 0.0
    assert headroom_bits(None, bf16) is None and headroom_bits(0.0, bf16) is None
    found = Finding(step=5, batch=5, module="layers.1.attention.wo", rank=1, run_dir="runs/x")
    assert found.text() == ("first non-finite output: layers.1.attention.wo (rank 1, step 6, batch 5); replay: "
                            "paratrain replay runs/x step-6")
    assert found.record() == {"nonfinite": {"module": "layers.1.attention.wo", "rank": 1, "batch": 5}}
    backward = Finding(step=2, batch=9, module=None, rank=None, run_dir="runs/x").text()
    assert "every module's output was finite" in backward and "in backward" in backward and "\n" not in backward


def _record(step: int, act: list, grad: list, room: list) -> dict:
    rows = row_names(2)
    none = [None] * len(rows)
    return {"step": step, "loss": 1.0, "numerics": {
        "rows": rows, "act_max": act, "act_rms": act, "attn_logit_max": none, "mlp_max": none, "mlp_rms": none,
        "grad_max": grad, "grad_rms": grad, "weight_max": grad, "weight_rms": grad,
        "headroom_bits": {"bf16": room, "fp16": room}}}


def test_heat_map_and_table_from_a_log(tmp_path):
    """`paratrain report` of a run whose log holds watched steps, one of them overflowed in block 1, a step logged
    twice (rolled back) and a malformed numerics record (left out)."""
    from paratrain import cli

    run = tmp_path / "watched"
    run.mkdir()
    records = [_record(2, [0.1, 0.2, 0.3, 2.0], [0.01, 0.02, 0.03, 0.1], [120.0, 119.0, 118.0, 115.0]),
               {**_record(4, [0.1, 0.5, math.inf, math.nan], [0.01] * 4, [120.0, 118.0, 0.0, 0.0]),
                "nonfinite": {"module": "layers.1.attention.wo", "rank": 1, "batch": 3}},
               _record(4, [0.1, 0.2, 0.3, 2.0], [0.01] * 4, [120.0, 119.0, 118.0, 115.0]),  # after the rollback
               {"step": 6, "loss": 1.0, "numerics": {"rows": ["embed"], "act_max": [1.0, 2.0]}},  # malformed
               {"step": 6, "end": "finished"}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert cli.main(["report", str(run)]) == 0
    png = run / "report" / "numerics.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    md = (run / "report" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| watched | 3 |"))  # the malformed one left out
    assert "step 4: layers.1.attention.wo on rank 1" in row and "0.0 bits of bf16 (1, step 4)" in row
    summary = json.loads((run / "report" / "summary.json").read_text())["runs"][0]["numerics"]
    assert summary["watched_steps"] == 3 and summary["nonfinite"] == [
        {"step": 4, "module": "layers.1.attention.wo", "rank": 1, "batch": 3}]


def test_out_of_memory_writes_the_snapshot_beside_the_estimate(char_data, tmp_path, monkeypatch, capsys):
    """An out-of-memory error (faked on CPU) writes the estimate and the allocator's state into the run folder,
    names the folder in its line, and the run goes on at half the micro-batch."""
    from paratrain.api import train_rank

    monkeypatch.setenv("PARATRAIN_FAULTS", "oom@1")
    run = train_rank(fast_config(char_data, tmp_path, "oom", "training.steps=2", "checkpoint.save_final=false"))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("out of memory"))
    folder = run.run_dir / "oom" / "step-2"
    assert line.endswith(f"; memory snapshot and estimate: {folder}") and "-> 2 x 2" in line
    record = json.loads((folder / "rank0.json").read_text())
    assert record["step"] == 2 and record["micro_batch"] == 4 and "injected out-of-memory" in record["error"]
    assert record["estimate"]["total_bytes"] > 0 and record["allocator"]["rss_bytes"] > 0
    text = (folder / "rank0.txt").read_text()
    assert "the memory estimator for this layout at micro-batch 4" in text and "total" in text
    assert not list(folder.glob("*.pickle"))  # a CPU has no allocator snapshot

    # with an allocator snapshot (what CUDA gives): written for memory_viz, its totals in the JSON
    from paratrain.observe.oom import write_evidence
    from paratrain.spec import resolve_run

    cfg = fast_config(char_data, tmp_path, "oom2")
    snapshot = {"segments": [{"total_size": 2 << 20, "allocated_size": 1 << 20, "blocks": []}], "device_traces": []}
    out = write_evidence(tmp_path / "oom2", 3, 6, resolve_run(cfg, 1), torch.device("cpu"), 2, 2,
                         RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), snapshot=lambda d: snapshot)
    assert (out / "rank3-snapshot.pickle").stat().st_size > 0
    assert json.loads((out / "rank3.json").read_text())["snapshot"] == {
        "segments": 1, "reserved_bytes": 2 << 20, "allocated_bytes": 1 << 20}
    assert "https://pytorch.org/memory_viz" in (out / "rank3.txt").read_text()
