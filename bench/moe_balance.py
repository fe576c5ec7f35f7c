"""Auxiliary-loss-free balancing against the balance loss: a mixture-of-experts model on tinyshakespeare (the bundled
corpus, characters), 8 experts top-2 in each of the shakespeare-char preset's 4 blocks, trained with the default
recipe's steps twice from the same initial weights on the same batches:

- aux-loss: the sequence-wise balance loss (model.moe_aux_loss_coef=0.01, the default), `moe.balancing=aux_loss`;
- aux-free: DeepSeek-V3's routing bias (model.moe_expert_bias=true, `moe.balancing=aux_free`), moved
  bias_update_rate x sign(mean load - load) after each step, beside a tiny balance loss (DeepSeek-V3's 1e-4).

"At the end" is the final model's max load violation over the whole validation split (Wang et al. 2024's MaxVio on
the validation set, which DeepSeek-V3 reports): the final checkpoint, loaded as `paratrain generate` loads it, routes
every window of the val split once, each MoE layer's top-k assignments are counted over all of them, and the
violation is max_e load_e / mean load - 1 of the worst layer (the training metric's formula, distributed/
expert_parallel.py's MoEMeter). Beside it the training metric `moe_max_violation` (one step's batch: 1,536
assignments, so a floor of ~0.13 from sampling alone) averaged over the last tenth of the steps, the final validation
loss and tokens/s.

An aux-free run per `--rate` (default: paratrain's default 1e-3, and 3e-4: one step's loads are 1,536 assignments,
whose sampling noise makes every step's sign partly random, so a smaller step leaves the bias less jitter).

    OMP_NUM_THREADS=1 python bench/moe_balance.py      # ~15-20 minutes on a (shared) 2-core CPU
    python bench/moe_balance.py --rate 1e-2 --steps 300
    python bench/moe_balance.py --smoke                # 4 steps each, 16 val windows (the test suite)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from paratrain.api import train_rank
from paratrain.config import load_config
from paratrain.data import open_split
from paratrain.distributed.expert_parallel import MoEMeter
from paratrain.inference import load_for_generation

MODEL = ["model.preset=shakespeare-char", "model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden=176"]
AUX_LOSS = ["moe.balancing=aux_loss", "model.moe_aux_loss_coef=0.01"]
AUX_FREE = ["moe.balancing=aux_free", "model.moe_expert_bias=true", "model.moe_aux_loss_coef=1e-4"]
CHUNK = 256  # val windows per forward


def steps_of(run_dir: Path) -> list[dict]:
    """Every step's record, in step order (metrics.jsonl holds each step's)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


@torch.no_grad()
def val_split_loads(cfg, windows: int | None = None) -> dict:
    """The final checkpoint's expert loads over the val split: every window of it once (its first `windows` in the
    split's seeded order, if given), counted per layer by the same meter the training metrics use. Returns the
    meter's numbers (moe_max_violation, moe_violation per layer, moe_tokens_per_expert) and the tokens routed."""
    model, _, _, _ = load_for_generation(cfg.run_dir)  # the run folder's newest checkpoint: the final one
    model.eval()
    # sequential mode: a seeded permutation of the split's non-overlapping windows, each once per epoch
    val = open_split(dataclasses.replace(cfg.data, mode="sequential"), "val", cfg.training.seq_len)
    count = val.windows[0] if windows is None else min(windows, val.windows[0])
    x, _ = val.global_batch(0, count, cfg.training.seed)  # (count, T)
    meter = MoEMeter(model, x.device)
    meter.recording = True  # each MoE layer's forward adds its loads
    for rows in x.split(CHUNK):
        model(rows)  # logits unused
    return {**meter.step_metrics(), "tokens": x.numel()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the default recipe's)")
    p.add_argument("--rate", type=float, nargs="+", default=[1e-3, 3e-4],
                   help="aux-free: moe.bias_update_rate, an aux-free run for each")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="working folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="4 steps each, 16 validation sequences (the test suite)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="paratrain-moe-balance-") as tmp:
        root = Path(a.out or tmp)
        common = [*MODEL, f"training.device={a.device}", "metrics.progress=none", "metrics.peak_tflops=1",
                  "sample.max_new_tokens=0", "checkpoint.save_final=true", f"run.out_dir={root / 'runs'}",
                  "run.overwrite=true", f"data.dir={root / 'data'}", "data.source=tinyshakespeare"]
        common += ["training.steps=4", "training.eval_sequences=16"] if a.smoke else []
        common += [f"training.steps={a.steps}"] if a.steps else []
        rows = []
        runs = {"aux-loss": AUX_LOSS, **{f"aux-free {rate:g}": [*AUX_FREE, f"moe.bias_update_rate={rate}"]
                                        for rate in a.rate}}
        for name, extra in runs.items():
            cfg = load_config(None, [*common, f"run.name={name.replace(' ', '-')}", *extra])
            result = train_rank(cfg)
            steps = steps_of(cfg.run_dir)
            v = [r["moe_max_violation"] for r in steps]
            tail = v[-max(1, len(v) // 10):]
            final = val_split_loads(cfg, 16 if a.smoke else None)
            tokens_per_s = statistics.median(r["tokens_per_s"] for r in steps)
            rows.append((name, len(v), final, sum(tail) / len(tail), result.val_loss, tokens_per_s))
        print(f"\nmoe_balance: shakespeare-char, 8 experts top-2 (moe_ffn_hidden 176), aux-free rows: "
              f"moe.bias_update_rate, {a.device}; final max violation: the final weights over "
              f"{rows[0][2]['tokens']:,} val tokens\n")
        print("| run | steps | final max violation (val split) | per layer | training metric, mean of last tenth "
              "| val loss | tokens/s |")
        print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
        for name, steps, final, mean, val, tps in rows:
            layers = " ".join(f"{x:.3f}" for x in final["moe_violation"])
            print(f"| {name} | {steps} | {final['moe_max_violation']:.3f} | {layers} | {mean:.3f} | {val:.4f} "
                  f"| {tps:,.0f} |")
        loss_row = rows[0]
        print()
        for free_row in rows[1:]:
            ratio = free_row[2]["moe_max_violation"] / max(loss_row[2]["moe_max_violation"], 1e-12)
            print(f"{free_row[0]} / aux-loss final max violation: {ratio:.2f} (training metric, last tenth: "
                  f"{free_row[3] / max(loss_row[3], 1e-12):.2f}), val loss {free_row[4] - loss_row[4]:+.4f}")
        print("loads per expert, worst layer:")
        for name, _, final, _, _, _ in rows:
            worst = max(range(len(final["moe_violation"])), key=lambda i: final["moe_violation"][i])
            print(f"  {name} (layer {worst}): {final['moe_tokens_per_expert'][worst]}")


if __name__ == "__main__":
    main()
