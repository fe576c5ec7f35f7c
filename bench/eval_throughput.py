"""Downstream evaluation throughput: `paratrain eval` (lm-eval's tasks on paratrain's model, 1 process and 2 CPU
ranks sharing the requests) against lm-eval's own Hugging Face backend on the same model, same machine.

The model is a random Llama in Hugging Face format (hidden 256, 4 layers, 8 heads / 4 KV heads, a 1,024-token BPE of
the bundled corpus, 256-token context), so both read the same folder: paratrain as hf:DIR, lm-eval as
`HFLM(pretrained=DIR)`. The tasks are the bundled `shakespeare` group (40 multiple-choice documents = 160
log-likelihood requests, 40 rolling perplexity documents, 40 greedy generations of up to 24 tokens). Requests/s is
lm-eval's requests over the wall time of the evaluation alone (the model loaded, lm-eval's evaluator imported, the
tasks indexed: each row's clock starts there); the metrics of every row must agree (acc / acc_norm / exact_match
equal, perplexities within 1e-4). The last line is the first paratrain row's requests/s over HFLM's:
`ratio paratrain/hf = R`.

    python bench/eval_throughput.py                      # the three rows, threads: 2 (1 process) and 1 per rank
    python bench/eval_throughput.py --hf-batch-size 1
    python bench/eval_throughput.py --tasks shakespeare_choice,shakespeare_perplexity   # scoring only
    python bench/eval_throughput.py --smoke              # a tiny model, 4 documents per task, 1 process (the test suite)
    python bench/eval_throughput.py --nproc 1 --hf-first # HFLM's row first (on a loaded machine, alternate the order)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = dict(vocab=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256)
SMOKE = dict(vocab=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=128)


def make_model(folder: Path, sizes: dict) -> Path:
    import tokenizers as tk
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paratrain.data import DEFAULT_CORPUS

    sizes = dict(sizes)
    vocab = sizes.pop("vocab")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([DEFAULT_CORPUS.read_text()[:200_000]], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), eos_token_id=0, **sizes)).save_pretrained(folder)
    return folder


def paratrain_row(folder: Path, tasks: list[str], limit, batch: int, nproc: int) -> dict:
    from paratrain.downstream import EvalJob, eval_rank
    from paratrain.harness.tasks import HarnessSettings, task_manager

    job = EvalJob(f"hf:{folder}", HarnessSettings(tasks=tasks, limit=limit, batch_size=batch))
    # as hf_row before its clock: lm-eval's evaluator imported (datasets, pandas: ~3 s) and the tasks indexed; the
    # first row would pay them inside its clock and HFLM's row, which runs after it in this process, would not
    task_manager(job.settings)
    if nproc == 1:
        out = eval_rank(job)
    else:
        from paratrain.api import launch_ranks

        out = launch_ranks(eval_rank, (job,), nproc)
    return {"row": f"paratrain eval, {nproc} rank{'s' if nproc > 1 else ''}", "requests": out["requests"],
            "seconds": out["seconds"], "metrics": out["metrics"]}


def hf_row(folder: Path, tasks: list[str], limit, batch: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from paratrain.harness.tasks import HarnessSettings, downstream_metrics, kept_random_state, task_manager

    manager = task_manager(HarnessSettings(tasks=tasks))
    lm = HFLM(pretrained=str(folder), batch_size=batch, dtype="float32", device="cpu")
    calls = {"n": 0}
    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        method = getattr(lm, name)

        def counted(requests, *a, _method=method, **k):
            calls["n"] += len(requests)
            return _method(requests, *a, **k)

        setattr(lm, name, counted)
    start = time.perf_counter()
    with kept_random_state():
        results = simple_evaluate(model=lm, tasks=tasks, limit=limit, bootstrap_iters=0, task_manager=manager,
                                  verbosity="WARNING")
    return {"row": f"lm-eval HFLM, batch {batch}", "requests": calls["n"], "seconds": time.perf_counter() - start,
            "metrics": downstream_metrics(results)}


def agree(a: dict, b: dict) -> bool:
    for task, metrics in a.items():
        for name, value in metrics.items():
            other = b.get(task, {}).get(name)
            if other is None:
                return False
            close = math.isclose(value, other, rel_tol=1e-4) if ("perplexity" in name or name == "bits_per_byte") \
                else value == other
            if not close:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="paratrain's requests per forward")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="lm-eval HFLM's batch size")
    parser.add_argument("--nproc", default="1,2", help="paratrain rows: ranks of each")
    parser.add_argument("--tasks", default="shakespeare", help="lm-eval tasks (bundled: shakespeare, shakespeare_*)")
    parser.add_argument("--hf-first", action="store_true", help="HFLM's row before paratrain's (the table's order "
                        "stays): on a machine whose load changes, alternate the order between runs")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    tasks, limit = args.tasks.split(","), (4 if args.smoke else None)
    ranks = [1] if args.smoke else [int(n) for n in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-eval-") as scratch:
        folder = make_model(Path(scratch) / "model", SMOKE if args.smoke else FULL)
        hf = hf_row(folder, tasks, limit, args.hf_batch_size) if args.hf_first else None
        rows = []
        for n in ranks:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            rows.append(paratrain_row(folder, tasks, limit, args.batch_size, n))
        rows.append(hf or hf_row(folder, tasks, limit, args.hf_batch_size))
    reference = rows[-1]["metrics"]
    print(f"| evaluator | requests | seconds | requests/s | metrics equal lm-eval HFLM's |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['row']} | {r['requests']:,} | {r['seconds']:.1f} | {r['requests'] / r['seconds']:,.1f} | "
              f"{'yes' if agree(r['metrics'], reference) else 'NO'} |")
    rate = [r["requests"] / r["seconds"] for r in rows]
    print(f"ratio paratrain/hf = {rate[0] / rate[-1]:.2f}")  # the first paratrain row's requests/s over HFLM's
    if not all(agree(r["metrics"], reference) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
