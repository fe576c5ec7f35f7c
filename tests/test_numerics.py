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
from paratrain.distributed.initialize import init_weights
from paratrain.models import Transformer, preset_args
from paratrain.observe import numerics
from paratrain.observe.numerics import Finding, NumericsWatch, headroom_bits, max_logit, row_names
from paratrain.observe.replay import format_numerics
from paratrain.observe.report import load_run, plot_numerics

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
    assert headroom_bits(fp16 * 2, fp16) == 0.0  # a finite value past fp16's max (an fp32 run): it would overflow
    assert math.isnan(headroom_bits(math.inf, bf16)) and math.isnan(headroom_bits(math.nan, bf16))  # no bits to give
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


def test_a_nonfinite_step_is_named_and_measured_with_the_watch_off(char_data, tmp_path, monkeypatch, capsys):
    """numerics_every=0: no step is watched, but the step a weight overflowed in is replayed: its line names the
    module, and its record holds the replay's rows (activations and weights; no gradients, no backward ran)."""
    from paratrain.api import train_rank

    monkeypatch.setenv("PARATRAIN_FAULTS", "overflow@1")
    run = train_rank(fast_config(char_data, tmp_path, "nan", "training.steps=2", "training.log_every=1",
                                 "resilience.max_bad_steps=5", "checkpoint.save_final=false"))
    out = capsys.readouterr().out
    assert "step 2: non-finite loss or gradient norm, update skipped (1 skipped so far); first non-finite output: " \
           f"layers.1.attention.wo (rank 0, step 2, batch 1); replay: paratrain replay {run.run_dir} step-2" in out
    records = [r for r in map(json.loads, (run.run_dir / "metrics.jsonl").open()) if "loss" in r]
    assert "numerics" not in records[0] and records[1]["nonfinite"] == {"module": "layers.1.attention.wo", "rank": 0,
                                                                          "batch": 1}
    n = records[1]["numerics"]
    assert math.isfinite(n["act_max"][1]) and not math.isfinite(n["act_max"][2])  # block 0 fine, block 1 overflowed
    assert n["grad_max"] == [None] * 4 and n["weight_max"][2] >= 1e37  # the scaled weight, in block 1's row


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


class _Step:
    """What the numerics watch asks of a TrainStep: one model on the CPU, no pipeline, forward-only losses."""

    pipeline, device = None, torch.device("cpu")

    def __init__(self, model):
        self.model = model

    def eval_loss_sum(self, batch, rows: int) -> torch.Tensor:
        x, y = batch
        return self.model(x, targets=y, reduction="sum")


class _Ranks:
    """torch.distributed as rank 0 of two sees it, the other rank's tensors given in call order (None: record them
    instead): MAX as NCCL's (fmax: a NaN beside a number is dropped), SUM."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, theirs=None):
        self.theirs, self.seen = theirs, []

    def is_initialized(self):
        return True

    def get_world_size(self):
        return 2

    def all_reduce(self, t, op=torch.distributed.ReduceOp.SUM):
        if self.theirs is None:
            self.seen.append(t.clone())
            return
        other = self.theirs.pop(0)
        t.copy_(torch.fmax(t, other) if op == torch.distributed.ReduceOp.MAX else t + other)


def test_a_nan_born_in_block_2_is_named_block_2_everywhere(tmp_path, monkeypatch):
    """Block 2 of 4 puts a NaN into one position of one sequence on rank 0; rank 1's batch stays finite. The ranks'
    MAX (NCCL's fmax) drops rank 0's NaN, so block 2's max alone would look fine (issue 35: act max 0.154 beside rms
    nan, 130.7 bits of headroom); its non-finite count says otherwise. The watch's record, the replay's line and
    record, the replay table and numerics.png all name block 2."""
    model = Transformer(preset_args("tiny", vocab_size=65, n_layers=4))
    init_weights(model, 0)
    poison = [False]

    def nan_in_block_2(module, args, out):
        if poison[0]:
            out = out.clone()
            out[0, 5, 0] = math.nan
            return out

    model.layers["2"].register_forward_hook(nan_in_block_2)  # before the watch's hooks: they see its output
    watch = NumericsWatch(_Step(model), n_layers=4, every=1, precision="bf16")
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = (x, x.roll(-1, 1))

    def watched_step(ranks):
        with monkeypatch.context() as m:
            m.setattr(numerics, "dist", ranks)
            watch.begin(0)
            model(batch[0], targets=batch[1]).backward()
            watch.after_backward()
            model.zero_grad()
            return watch.end()()

    other = _Ranks()
    watched_step(other)  # rank 1's statistics: a finite batch
    poison[0] = True
    record = watched_step(_Ranks(other.seen))
    n, block2 = record["numerics"], 3  # rows: embed, 0, 1, 2, 3, head
    assert n["rows"][block2] == "2" and n["first_nonfinite"] == "2"
    assert all(math.isfinite(v) for v in n["act_max"][:block2]) and n["act_nonfinite"][:block2] == [0, 0, 0]
    assert math.isnan(n["act_max"][block2]) and math.isnan(n["act_rms"][block2]) and n["act_nonfinite"][block2] == 1
    assert all(math.isnan(n["headroom_bits"][f][block2]) for f in ("bf16", "fp16"))  # not a number of bits
    assert math.isnan(n["attn_logit_max"][block2 + 1])  # block 3 attends to the NaN: rank 1's logit dropped it too
    assert math.isnan(n["grad_max"][block2]) and n["grad_nonfinite"][block2] > 0
    assert math.isnan(record["numerics_act_max"]) and math.isnan(record["numerics_headroom_bits"])

    found = watch.first_nonfinite([batch])  # the replay of the bad step (this rank alone)
    finding = Finding(step=5, batch=5, module=found["module"], rank=found.get("rank"), run_dir="runs/x",
                      numerics=found["numerics"])
    assert finding.text().startswith("first non-finite output: layers.2 (rank 0, step 6, batch 5)")
    replayed = finding.record()
    assert replayed["nonfinite"]["module"] == "layers.2" and replayed["numerics"]["first_nonfinite"] == "2"
    table = format_numerics(n).splitlines()
    assert [line.split()[0] for line in table if line.endswith("<- first non-finite")] == ["2"]
    assert "non-finite" in table[1 + block2] and "bits" not in table[1 + block2]

    run = tmp_path / "watched"
    run.mkdir()
    # the step's record as the loop writes it: a watched step keeps its own numerics beside the replay's finding
    (run / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": math.nan, **replayed, **record}) + "\n")
    fig = plot_numerics(load_run(run))
    import matplotlib.pyplot as plt  # (plot_numerics chose the Agg backend)

    act, _, room = fig.axes[:3]  # (then the colour bars)
    for panel in (act, room):
        assert {round(t.get_position()[1]) for t in panel.texts if t.get_text() == "x"} == {block2, block2 + 1,
                                                                                           block2 + 2}
        assert [round(b.get_xy()[1] + 0.5) for b in panel.patches] == [block2]  # boxed: block 2, not 3 or the head
    plt.close(fig)
