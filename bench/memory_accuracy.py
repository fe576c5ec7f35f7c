"""Memory estimator vs measurement: predicted and measured per-rank peak, by category, on CPU ranks (gloo).

Each configuration builds the model exactly as `paratrain train` does (parallelize + build_optimizer), runs
training steps that mirror the trainer's (forward, loss, backward, clip, AdamW step, zero_grad), and tracks
every tensor storage on every rank (bench/memory_measure.py: a TorchDispatchMode with weak references
and UntypedStorage.resize_ tracking). The peak of the last step and its breakdown by category are compared
with `paratrain.estimate.estimate` for the same configuration (tensors only: no runtime overhead on CPU;
the foreach AdamW the trainer uses on CPU). The worst rank is compared.

    python bench/memory_accuracy.py              # every configuration, 1, 2 and 4 ranks (~4 min on 2 cores)
    python bench/memory_accuracy.py --quick      # 8 of them
    python bench/memory_accuracy.py --smoke      # 2 one-rank ones: the same code in seconds (the test suite; the
                                                 # estimator's tests measure on 2 and 4 ranks)
    python bench/memory_accuracy.py --only "1rank qwen3 fp32,cp2 qwen3 bf16"   # the named ones
    python bench/memory_accuracy.py --json out.json

On a CUDA machine, --cuda also runs each 1-rank configuration on the GPU and compares the estimate with
torch.cuda.max_memory_allocated (the trainer's step, no tracker).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_measure (bench/)

from paratrain.config import ParallelConfig
from memory_measure import CATEGORIES, MeasureSpec, inputs_for_spec, measure, recipe_keys  # bench/memory_measure.py

# A small Llama (GQA, SwiGLU) whose activations, parameters and logits are all a visible share of the peak.
MODEL = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, max_seq_len=512)
# Odd sizes: no GQA, an FFN width that FSDP over 4 ranks must pad, a vocabulary of 200.
ODD = dict(vocab_size=200, dim=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn_hidden=250, max_seq_len=512)

# Mixture of experts (paratrain/models/moe.py): a dense first layer, then 4 experts (top-2) + 1 shared expert.
MOE = dict(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256,
           moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=64, moe_first_dense_layers=1)

# Qwen3-shaped (models/qwen.py, family qwen3-bias): per-head q/k norms, q/k/v/o biases, head_dim 64 != 128 / 4.
QWEN3 = dict(MODEL, head_dim=64, family="qwen3-bias")

# name, world, layout, precision, checkpointing, micro_batch, seq_len, accum, model
CONFIGS = [
    ("1rank fp32", 1, {}, "fp32", "none", 4, 128, 1, MODEL),
    ("1rank fp32 full", 1, {}, "fp32", "full", 4, 128, 1, MODEL),
    ("1rank fp32 every_k", 1, {}, "fp32", "every_k", 4, 128, 1, MODEL),
    ("1rank fp32 selective", 1, {}, "fp32", "selective", 4, 128, 1, MODEL),
    ("1rank bf16", 1, {}, "bf16", "none", 2, 256, 1, MODEL),
    ("1rank bf16 selective", 1, {}, "bf16", "selective", 2, 256, 1, MODEL),
    ("1rank fp32 accum2", 1, {}, "fp32", "none", 8, 64, 2, MODEL),
    ("1rank bf16 odd", 1, {}, "bf16", "full", 1, 16, 1, ODD),
    ("1rank moe fp32", 1, {}, "fp32", "none", 4, 128, 1, MOE),
    ("1rank moe fp32 selective", 1, {}, "fp32", "selective", 4, 128, 1, MOE),
    ("1rank moe bf16 full", 1, {}, "bf16", "full", 4, 128, 1, MOE),
    ("ddp2 fp32", 2, dict(dp_mode="ddp"), "fp32", "none", 4, 128, 1, MODEL),
    ("ddp2 bf16 full", 2, dict(dp_mode="ddp"), "bf16", "full", 4, 128, 1, MODEL),
    ("zero1x2 fp32 selective", 2, dict(dp_mode="zero1"), "fp32", "selective", 4, 128, 1, MODEL),
    ("zero2x2 bf16", 2, dict(dp_mode="zero2"), "bf16", "none", 4, 128, 1, MODEL),
    ("zero2x2 fp32 full", 2, dict(dp_mode="zero2"), "fp32", "full", 2, 256, 1, MODEL),
    ("fsdp2 fp32", 2, dict(dp_mode="fsdp"), "fp32", "none", 4, 128, 1, MODEL),
    ("fsdp2 bf16 every_k", 2, dict(dp_mode="fsdp"), "bf16", "every_k", 4, 128, 1, MODEL),
    ("fsdp2 bf16 selective", 2, dict(dp_mode="fsdp"), "bf16", "selective", 1, 256, 1, MODEL),
    ("fsdp2 fp32 tiny batch", 2, dict(dp_mode="fsdp"), "fp32", "none", 1, 32, 1, MODEL),
    ("fsdp2 bf16 full accum3", 2, dict(dp_mode="fsdp"), "bf16", "full", 2, 64, 3, MODEL),
    ("tp2 fp32", 2, dict(dp_mode="fsdp", tp=2, sequence_parallel=False), "fp32", "none", 4, 128, 1, MODEL),
    ("tp2+sp bf16 selective", 2, dict(dp_mode="fsdp", tp=2), "bf16", "selective", 4, 128, 1, MODEL),
    ("tp2+sp fp32 full", 2, dict(dp_mode="fsdp", tp=2), "fp32", "full", 4, 128, 1, MODEL),
    ("fsdp2 ep2 moe bf16", 2, dict(dp_mode="fsdp", ep=2), "bf16", "none", 4, 128, 1, MOE),
    ("fsdp4 bf16 odd", 4, dict(dp_mode="fsdp"), "bf16", "none", 2, 96, 1, ODD),
    ("fsdp4 fp32 selective odd", 4, dict(dp_mode="fsdp"), "fp32", "selective", 2, 96, 1, ODD),
    ("hsdp2x2 fp32 full", 4, dict(dp_mode="hsdp", dp_replicate=2), "fp32", "full", 4, 128, 1, MODEL),
    ("fsdp2xtp2 bf16", 4, dict(dp_mode="fsdp", tp=2), "bf16", "none", 4, 128, 1, MODEL),
    ("fsdp2xtp2 fp32 selective", 4, dict(dp_mode="fsdp", tp=2), "fp32", "selective", 2, 256, 1, MODEL),
    # Context parallelism: each sequence split over cp ranks (ring attention), FSDP over dp_shard x cp.
    ("cp2 fp32", 2, dict(cp=2), "fp32", "none", 4, 128, 1, MODEL),
    ("cp2 bf16", 2, dict(cp=2), "bf16", "none", 2, 256, 1, MODEL),
    ("cp2 fp32 full", 2, dict(cp=2), "fp32", "full", 4, 128, 1, MODEL),
    ("cp2 bf16 selective", 2, dict(cp=2), "bf16", "selective", 2, 256, 1, MODEL),
    ("cp2 fp32 odd", 2, dict(cp=2), "fp32", "none", 2, 96, 1, ODD),
    ("cp4 fp32 seq512", 4, dict(cp=4), "fp32", "none", 1, 512, 1, MODEL),
    ("cp4 bf16 full seq512", 4, dict(cp=4), "bf16", "full", 1, 512, 1, MODEL),
    ("cp2xfsdp2 bf16", 4, dict(dp_mode="fsdp", cp=2), "bf16", "none", 2, 256, 1, MODEL),
    ("cp2xtp2 fp32", 4, dict(dp_mode="fsdp", cp=2, tp=2), "fp32", "none", 4, 128, 1, MODEL),
    ("cp2xhsdp2 fp32 selective", 4, dict(dp_mode="hsdp", dp_replicate=2, cp=2), "fp32", "selective", 2, 128, 1,
     MODEL),
    ("1rank qwen3 fp32", 1, {}, "fp32", "none", 4, 128, 1, QWEN3),
    ("1rank qwen3 bf16 selective", 1, {}, "bf16", "selective", 2, 256, 1, QWEN3),
    ("fsdp2 qwen3 bf16", 2, dict(dp_mode="fsdp"), "bf16", "none", 4, 128, 1, QWEN3),
    ("tp2+sp qwen3 fp32 full", 2, dict(dp_mode="fsdp", tp=2), "fp32", "full", 4, 128, 1, QWEN3),
    ("cp2 qwen3 bf16", 2, dict(cp=2), "bf16", "none", 2, 256, 1, QWEN3),
]
# Memory tiers (paratrain/memory.py). A vocabulary of 4096 makes the logits a large share of the peak: the chunked
# loss (8 pieces, what loss_chunks=0 picks in fp32 for logits of AUTO_LOSS_MIN_BYTES and more; these are smaller, so
# the rows set it) against the whole logits; the default recipe's model (shakespeare-char) both ways.
VOCAB4K = dict(MODEL, vocab_size=4096, n_layers=2)
RECIPE = dict(vocab_size=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=352, max_seq_len=256)
CONFIGS += [
    ("1rank fp32 vocab4k whole logits", 1, dict(loss_chunks=1), "fp32", "none", 4, 128, 1, VOCAB4K),
    ("1rank fp32 vocab4k chunked loss", 1, dict(loss_chunks=8), "fp32", "none", 4, 128, 1, VOCAB4K),
    ("1rank bf16 vocab4k chunked loss", 1, dict(loss_chunks=8), "bf16", "none", 4, 128, 1, VOCAB4K),
    ("fsdp2 bf16 vocab4k chunked loss", 2, dict(dp_mode="fsdp", loss_chunks=8), "bf16", "none", 4, 128, 1, VOCAB4K),
    ("tp2+sp fp32 vocab4k chunked loss", 2, dict(tp=2, loss_chunks=5), "fp32", "selective", 4, 128, 1, VOCAB4K),
    ("default recipe whole logits", 1, dict(loss_chunks=1), "fp32", "none", 12, 64, 1, RECIPE),
    ("default recipe chunked loss", 1, dict(loss_chunks=8), "fp32", "none", 12, 64, 1, RECIPE),
    # activation offloading: what the hooks copy is host memory (measured as the host tensors they hold)
    ("1rank fp32 offload", 1, dict(activation_offload="all"), "fp32", "none", 4, 128, 1, MODEL),
    ("1rank bf16 offload every_k", 1, dict(activation_offload="every_k"), "bf16", "none", 2, 256, 1, MODEL),
    ("1rank fp32 offload full", 1, dict(activation_offload="all"), "fp32", "full", 4, 128, 1, MODEL),
    ("1rank bf16 offload selective", 1, dict(activation_offload="all"), "bf16", "selective", 2, 256, 1, MODEL),
    ("fsdp2 bf16 offload", 2, dict(dp_mode="fsdp", activation_offload="all"), "bf16", "none", 4, 128, 1, MODEL),
    ("tp2+sp fp32 offload", 2, dict(tp=2, activation_offload="all"), "fp32", "none", 4, 128, 1, MODEL),
    ("cp2 fp32 offload", 2, dict(cp=2, activation_offload="all"), "fp32", "none", 4, 128, 1, MODEL),
    # segment checkpointing: each segment's input kept, the segment recomputed at its last block's backward (MODEL:
    # round(sqrt(4)) = 2 blocks per segment; segment_blocks=3: one of 3 and one of 1; 8 blocks: 3 + 3 + 2)
    ("1rank fp32 segments", 1, {}, "fp32", "segments", 4, 128, 1, MODEL),
    ("1rank bf16 segments3", 1, dict(segment_blocks=3), "bf16", "segments", 2, 256, 1, MODEL),
    ("1rank fp32 segments 8 blocks", 1, {}, "fp32", "segments", 2, 128, 1, dict(MODEL, n_layers=8)),
    ("fsdp2 bf16 segments", 2, dict(dp_mode="fsdp"), "bf16", "segments", 4, 128, 1, MODEL),
    ("fsdp2 fp32 segments3", 2, dict(dp_mode="fsdp", segment_blocks=3), "fp32", "segments", 4, 128, 1, MODEL),
    ("tp2+sp fp32 segments", 2, dict(dp_mode="fsdp", tp=2), "fp32", "segments", 4, 128, 1, MODEL),
    # low-memory optimizer states (bf16 moments; 8-bit needs torchao: `--only` it where installed)
    ("1rank fp32 adamw-bf16", 1, dict(optimizer="adamw-bf16"), "fp32", "none", 4, 128, 1, MODEL),
    ("fsdp2 bf16 adamw-bf16", 2, dict(dp_mode="fsdp", optimizer="adamw-bf16"), "bf16", "selective", 4, 128, 1, MODEL),
    # Muon: a momentum per hidden matrix (AdamW's two moments for the rest), the step's stacks of whole matrices
    ("1rank fp32 muon", 1, dict(optimizer="muon"), "fp32", "none", 4, 128, 1, MODEL),
    ("ddp2 fp32 muon", 2, dict(dp_mode="ddp", optimizer="muon"), "fp32", "none", 4, 128, 1, MODEL),
    ("fsdp2 bf16 muon", 2, dict(dp_mode="fsdp", optimizer="muon"), "bf16", "none", 4, 128, 1, MODEL),
    ("fsdp2xtp2 fp32 muon", 4, dict(dp_mode="fsdp", tp=2, optimizer="muon"), "fp32", "selective", 2, 256, 1, MODEL),
]
# Pipeline rows: every schedule, 2-4 stages, several micro-batch counts (the trainer's own stages and schedule,
# distributed/pipeline.build_pipeline); the 8-block model gives pp4 with 2 stages per rank a block per stage.
MODEL8 = dict(MODEL, n_layers=8)


def _pp(name, world, pp, schedule, m, precision="fp32", ckpt="none", mb=2, seq=128, model=MODEL, **layout):
    return (name, world, dict(pp=pp, pp_schedule=schedule, pp_microbatches=m, **layout), precision, ckpt, mb, seq, 1,
            model)


PP_CONFIGS = [
    _pp("pp2 gpipe m4 fp32", 2, 2, "gpipe", 4),
    _pp("pp2 gpipe m8 bf16", 2, 2, "gpipe", 8, "bf16", mb=1),
    _pp("pp2 1f1b m2 fp32", 2, 2, "1f1b", 2, mb=4, seq=64),
    _pp("pp2 1f1b m4 fp32", 2, 2, "1f1b", 4),
    _pp("pp2 1f1b m8 bf16 full", 2, 2, "1f1b", 8, "bf16", "full", seq=64),
    _pp("pp2 interleaved_1f1b m4 fp32", 2, 2, "interleaved_1f1b", 4),
    _pp("pp2 interleaved_1f1b m8 bf16 selective", 2, 2, "interleaved_1f1b", 8, "bf16", "selective", mb=1),
    _pp("pp2 interleaved_zero_bubble m4 fp32", 2, 2, "interleaved_zero_bubble", 4),
    _pp("pp2 zbv m4 fp32", 2, 2, "zbv", 4),
    _pp("pp2 zbv m6 bf16", 2, 2, "zbv", 6, "bf16", mb=1),
    _pp("pp3 1f1b m6 fp32", 3, 3, "1f1b", 6, mb=1, model=dict(MODEL, n_layers=6)),
    _pp("pp3 gpipe m3 bf16 every_k", 3, 3, "gpipe", 3, "bf16", "every_k", model=dict(MODEL, n_layers=6)),
    _pp("pp4 1f1b m8 fp32", 4, 4, "1f1b", 8, mb=1),
    _pp("pp4 1f1b m4 bf16", 4, 4, "1f1b", 4, "bf16"),
    _pp("pp4 gpipe m4 fp32", 4, 4, "gpipe", 4, mb=1),
    _pp("pp4 interleaved_1f1b m8 fp32", 4, 4, "interleaved_1f1b", 8, mb=1, model=MODEL8),
    _pp("pp4 interleaved_zero_bubble m8 fp32", 4, 4, "interleaved_zero_bubble", 8, mb=1, model=MODEL8),
    _pp("pp4 zbv m8 bf16", 4, 4, "zbv", 8, "bf16", mb=1, model=MODEL8),
    _pp("pp2xfsdp2 1f1b m4 fp32", 4, 2, "1f1b", 4, dp_mode="fsdp"),
    _pp("pp2xfsdp2 gpipe m4 bf16", 4, 2, "gpipe", 4, "bf16", dp_mode="fsdp"),
    _pp("pp2xfsdp2 interleaved_1f1b m4 bf16", 4, 2, "interleaved_1f1b", 4, "bf16", dp_mode="fsdp"),
    _pp("pp2xtp2 1f1b m4 fp32", 4, 2, "1f1b", 4, tp=2),
    _pp("pp2 1f1b m4 fp32 offload", 2, 2, "1f1b", 4, activation_offload="all"),
    _pp("pp2 1f1b m4 fp32 segments", 2, 2, "1f1b", 4, ckpt="segments", model=MODEL8),  # 3 + 1 blocks a stage
]
CONFIGS += PP_CONFIGS

SMOKE = {"1rank bf16 odd", "1rank fp32 vocab4k chunked loss"}
QUICK = {"1rank fp32", "1rank bf16 selective", "ddp2 bf16 full", "zero2x2 bf16", "fsdp2 fp32", "tp2+sp fp32 full",
         "fsdp4 bf16 odd", "fsdp2xtp2 bf16"}
# Estimator rows that the measurement reports under another name.
MERGE = {"master": "parameters", "pipeline": "activations", "overhead": None}
TOLERANCE = 0.05  # every configuration's predicted total peak within 5% of the measured one
SMALL = 0.02  # categories under 2% of the peak are compared in % of the peak (relative errors of tiny numbers mean little)


# A row's settings: its [parallel] section, and beside it the other sections' settings as the Recipe names them
# ([memory]: loss_chunks, activation_offload, ...; [optimizer]: optimizer; memory_measure.recipe_keys).
OWN_FIELDS = set(recipe_keys())


def spec_of(row) -> MeasureSpec:
    name, _, settings, precision, ckpt, mb, seq, accum, model = row
    own = {k: v for k, v in settings.items() if k in OWN_FIELDS}
    layout = {k: v for k, v in settings.items() if k not in OWN_FIELDS}
    return MeasureSpec.of(model, ParallelConfig(**layout), precision=precision, checkpointing=ckpt, micro_batch=mb,
                          seq_len=seq, accum_steps=accum, name=name, **own)


def predicted(spec: MeasureSpec, world: int):
    from paratrain.estimate import estimate

    est = estimate(inputs_for_spec(spec, world), suggest=False)
    cats = dict.fromkeys(CATEGORIES, 0)
    for key, value in est.at_peak.items():
        target = MERGE.get(key, key)
        if target:
            cats[target] += value
    # Activations and logits/loss stored at the end of the forward (what checkpointing decides).
    from paratrain.estimate.core import forward_end_bytes

    fwd = forward_end_bytes(est.inputs)
    fwd_acts, fwd_head = fwd["activations"], fwd["logits_loss"]
    return est, cats, fwd_acts, fwd_head


def compare(rows_measured: list[dict], spec: MeasureSpec, world: int) -> dict:
    worst = max(rows_measured, key=lambda r: r["peak"])
    est, cats, fwd_acts, fwd_head = predicted(spec, world)
    peak = worst["peak"]
    out = {"config": spec.name, "world": world, "measured_peak": peak, "predicted_peak": est.peak_bytes,
           "total_err": (est.peak_bytes - peak) / peak, "measured_phase": worst["peak_phase"],
           "predicted_phase": est.phase, "categories": {}}
    for c in CATEGORIES:
        m, e = worst["at_peak"].get(c, 0), cats.get(c, 0)
        if not m and not e:
            continue
        small = max(m, e) < SMALL * peak
        err = (e - m) / peak if small else (e - m) / max(m, 1)
        out["categories"][c] = {"measured": m, "predicted": e, "err": err, "of_peak": small}
    host = max(r.get("host_peak", 0) for r in rows_measured)
    if host or est.host_bytes:  # activation offloading's host copies (the worst rank's)
        out["host"] = {"measured": host, "predicted": est.host_bytes}
    fe = worst["forward_end"]
    if spec.config.parallel.pp == 1:  # (a pipeline's schedule interleaves forwards and backwards: no "end of forward")
        out["fwd_activations"] = {"measured": fe.get("activations", 0), "predicted": fwd_acts}
        out["fwd_logits_loss"] = {"measured": fe.get("logits_loss", 0), "predicted": fwd_head}
    # FSDP parameter all-gathers per step: measured in the trainer's step against the rule the cost model uses
    lay = spec.layout(world).validate(est.inputs.model_args, world, spec.batch(world))
    micro = lay.pp_microbatches if lay.pipelined else spec.training.accum_steps
    from paratrain.estimate.model_states import rank_layers

    pp_rank = worst["rank"] // (world // lay.pp)  # pp is the outermost mesh axis
    blocks = rank_layers(lay, est.inputs.model_args)[pp_rank]
    groups = lay.fsdp_groups(len(blocks), sum(map(est.inputs.model_args.is_moe_layer, blocks)), pp_rank)
    out["fsdp_gathers"] = {"measured": worst.get("fsdp_all_gathers", 0), "groups": worst.get("fsdp_groups", 0),
                           "rule": lay.fsdp_all_gathers(micro, groups)}
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:7.2f}"


def report(results: list[dict]) -> str:
    lines = []
    short = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "autocast_copies": "autocast",
             "activations": "acts", "logits_loss": "logits", "comm_buffers": "comm", "temporaries": "temps",
             "other": "other"}
    lines.append("| config | ranks | measured peak MiB | predicted MiB | total err | peak at (predicted) | "
                 "worst category (err) | fwd activations err |")
    lines.append("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in results:
        cats = r["categories"]
        wc = max(cats, key=lambda c: abs(cats[c]["err"])) if cats else "-"
        wtxt = f"{short.get(wc, wc)} {100 * cats[wc]['err']:+.1f}%{' of peak' if cats[wc]['of_peak'] else ''}" if cats else "-"
        fa = r.get("fwd_activations")
        fa_txt = f"{100 * (fa['predicted'] - fa['measured']) / max(fa['measured'], 1):+.2f}%" if fa else "-"
        lines.append(f"| {r['config']} | {r['world']} | {mib(r['measured_peak'])} | {mib(r['predicted_peak'])} | "
                     f"{100 * r['total_err']:+.2f}% | {r['predicted_phase']} | {wtxt} | {fa_txt} |")
    lines.append("")
    lines.append("| category | configs | worst error | where |")
    lines.append("| --- | ---: | ---: | --- |")
    for scope, subset in (("", results), (" (dense models)", [r for r in results if "moe" not in r["config"]]),
                          (" (pipeline rows)", [r for r in results if r["config"].startswith("pp")])):
        if not subset or (scope and len(subset) == len(results)):
            continue
        worst_total = max(subset, key=lambda r: abs(r["total_err"]))
        lines.append(f"| **total peak{scope}** | {len(subset)} | {100 * worst_total['total_err']:+.2f}% | "
                     f"{worst_total['config']} |")
        for c in CATEGORIES:
            entries = [(r["config"], r["categories"][c]) for r in subset if c in r["categories"]]
            if not entries:
                continue
            name, e = max(entries, key=lambda x: abs(x[1]["err"]))
            unit = "% of peak" if e["of_peak"] else "%"
            lines.append(f"| {c}{scope} | {len(entries)} | {100 * e['err']:+.2f}{unit} | {name} |")
        with_fwd = [r for r in subset if "fwd_activations" in r]
        if with_fwd:
            fwd = max(with_fwd, key=lambda r: abs(r["fwd_activations"]["predicted"] - r["fwd_activations"]["measured"])
                      / max(r["fwd_activations"]["measured"], 1))
            fa = fwd["fwd_activations"]
            lines.append(f"| activations stored at end of forward{scope} | {len(with_fwd)} | "
                         f"{100 * (fa['predicted'] - fa['measured']) / max(fa['measured'], 1):+.2f}% | {fwd['config']} |")
    gathered = [r for r in results if r["fsdp_gathers"]["groups"]]
    if gathered:
        lines.append("")
        lines.append("| config | FSDP groups on the worst rank | all-gathers in the step, measured | "
                     "Layout.fsdp_all_gathers (estimator and cost model) | agree |")
        lines.append("| --- | ---: | ---: | ---: | --- |")
        for r in gathered:
            g = r["fsdp_gathers"]
            lines.append(f"| {r['config']} | {g['groups']} | {g['measured']} | {g['rule']} | "
                         f"{'yes' if g['measured'] == g['rule'] else 'NO'} |")
    return "\n".join(lines)


def run_cuda(rows) -> list[dict]:
    """1-rank configurations on the GPU: estimate vs torch.cuda.max_memory_allocated (no tracker), measured
    through the trainer's own TrainStep (memory_measure.device_step_peaks)."""
    from paratrain.estimate import estimate
    from memory_measure import device_step_peaks

    out = []
    for row in rows:
        spec = spec_of(row)
        if row[1] != 1:
            continue
        measured = device_step_peaks(spec, "cuda")["allocated"]
        inputs = inputs_for_spec(spec, 1).with_recipe(optimizer_impl="fused").with_target(device="cuda", overhead_bytes=0)
        est = estimate(inputs, suggest=False)
        out.append({"config": spec.name, "measured_peak": measured, "predicted_peak": est.peak_bytes,
                    "total_err": (est.peak_bytes - measured) / measured, "predicted_phase": est.phase})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 configurations instead of all")
    parser.add_argument("--smoke", action="store_true", help="2 small one-rank configurations, in seconds")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--cuda", action="store_true", help="also compare 1-rank configs with max_memory_allocated")
    parser.add_argument("--only", help="comma-separated config names")
    args = parser.parse_args()
    rows = [r for r in CONFIGS if (not args.quick or r[0] in QUICK) and (not args.smoke or r[0] in SMOKE)]
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r[0] in wanted]
    start = time.perf_counter()
    results = []
    for world in sorted({r[1] for r in rows}):
        group = [r for r in rows if r[1] == world]
        specs = [spec_of(r) for r in group]
        t0 = time.perf_counter()
        measured = measure(specs, world)
        print(f"[{world} rank{'s' if world > 1 else ''}: {len(specs)} configurations in {time.perf_counter() - t0:.0f} s]",
              file=sys.stderr, flush=True)
        results += [compare(m, s, world) for m, s in zip(measured, specs)]
    order = {r[0]: i for i, r in enumerate(CONFIGS)}
    results.sort(key=lambda r: order[r["config"]])
    print(report(results))
    print(f"\n{len(results)} configurations in {time.perf_counter() - start:.0f} s; units MiB (2^20 bytes); "
          f"category errors are relative, except categories under {SMALL:.0%} of the peak (in % of the peak)")
    outside = [r["config"] for r in results if abs(r["total_err"]) > TOLERANCE]
    print(f"total peak within {TOLERANCE:.0%} of the measurement: {len(results) - len(outside)} of {len(results)} "
          f"configurations{'; outside: ' + ', '.join(outside) if outside else ''}")
    cuda = []
    if args.cuda:
        cuda = run_cuda(rows)
        print("\n| config (CUDA, 1 rank) | max_memory_allocated MiB | predicted MiB | err | peak at |")
        print("| --- | ---: | ---: | ---: | --- |")
        for r in cuda:
            print(f"| {r['config']} | {mib(r['measured_peak'])} | {mib(r['predicted_peak'])} | "
                  f"{100 * r['total_err']:+.2f}% | {r['predicted_phase']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": results, "cuda": cuda}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
