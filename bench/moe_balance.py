"""Auxiliary-loss-free balancing against the balance loss: a mixture-of-experts model on tinyshakespeare (the bundled
corpus, characters), 8 experts top-2 in each of the shakespeare-char preset's 4 blocks, trained with the default
recipe's steps twice from the same initial weights on the same batches:

- aux-loss: the sequence-wise balance loss (model.moe_aux_loss_coef=0.01, the default), `moe.balancing=aux_loss`;
- aux-free: DeepSeek-V3's routing bias (model.moe_expert_bias=true, `moe.balancing=aux_free`), moved
  bias_update_rate x sign(mean load - load) after each step, beside a tiny balance loss (DeepSeek-V3's 1e-4).

The table: the final max load violation (`moe_max_violation`: the worst layer's busiest expert over the mean, minus
1; the last step's, and the mean over the last tenth of the steps, which one step's sampling noise moves less), the
final validation loss and tokens/s.

    OMP_NUM_THREADS=1 python bench/moe_balance.py      # ~15 minutes on a (shared) 2-core CPU
    python bench/moe_balance.py --rate 1e-2 --device cuda
    python bench/moe_balance.py --smoke                # 4 steps each (the test suite)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from paratrain.api import train_rank
from paratrain.config import load_config

MODEL = ["model.preset=shakespeare-char", "model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden=176"]
RUNS = {"aux-loss": ["moe.balancing=aux_loss", "model.moe_aux_loss_coef=0.01"],
        "aux-free": ["moe.balancing=aux_free", "model.moe_expert_bias=true", "model.moe_aux_loss_coef=1e-4"]}


def steps_of(run_dir: Path) -> list[dict]:
    """Every step's record, in step order (metrics.jsonl holds each step's)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the default recipe's)")
    p.add_argument("--rate", type=float, default=1e-3, help="aux-free: moe.bias_update_rate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="working folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="4 steps each, 16 validation sequences (the test suite)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="paratrain-moe-balance-") as tmp:
        root = Path(a.out or tmp)
        common = [*MODEL, f"training.device={a.device}", "metrics.progress=none", "metrics.peak_tflops=1",
                  "sample.max_new_tokens=0", "checkpoint.save_final=false", f"run.out_dir={root / 'runs'}",
                  "run.overwrite=true", f"data.dir={root / 'data'}", "data.source=tinyshakespeare",
                  f"moe.bias_update_rate={a.rate}"]
        common += ["training.steps=4", "training.eval_sequences=16"] if a.smoke else []
        common += [f"training.steps={a.steps}"] if a.steps else []
        rows = []
        for name, extra in RUNS.items():
            cfg = load_config(None, [*common, f"run.name={name}", *extra])
            result = train_rank(cfg)
            steps = steps_of(cfg.run_dir)
            v = [r["moe_max_violation"] for r in steps]
            tail = v[-max(1, len(v) // 10):]
            tokens_per_s = statistics.median(r["tokens_per_s"] for r in steps)
            rows.append((name, len(v), v[-1], sum(tail) / len(tail), result.val_loss, tokens_per_s))
        print(f"\nmoe_balance: shakespeare-char, 8 experts top-2 (moe_ffn_hidden 176), aux-free "
              f"bias_update_rate {a.rate:g}, {a.device}\n")
        print("| run | steps | final max violation | mean, last tenth of steps | val loss | tokens/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, steps, last, mean, val, tps in rows:
            print(f"| {name} | {steps} | {last:.3f} | {mean:.3f} | {val:.4f} | {tps:,.0f} |")
        (loss_row, free_row) = rows
        print(f"\naux-free / aux-loss max violation: {free_row[3] / max(loss_row[3], 1e-12):.2f} (last tenth), "
              f"val loss {free_row[4] - loss_row[4]:+.4f}")


if __name__ == "__main__":
    main()
