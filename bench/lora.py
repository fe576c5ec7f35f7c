"""LoRA on a small chat set: an adapter trained on a frozen base reaches a lower validation loss (on the assistant
tokens) than the base itself, with a few percent of its parameters trainable; a full fine-tune beside it.

The LoRA commands of docs/fine-tuning.md, in this process, on something small enough for a CPU:

  1. a base model: a small Llama pretrained on tinyshakespeare (byte-level BPE with chat special tokens), exported
     as a Hugging Face folder (`paratrain export --format hf`);
  2. a chat set: each conversation asks for the next line of the play and gets it ("user: <line i>", "assistant:
     <line i+1>"), rendered with a Llama-3-like template (`paratrain prepare --chat --chat-template`), the last tenth
     of the conversations the validation split;
  3. the base's validation loss on the assistant tokens (the trainer's own evaluation, after one LoRA step at lr 1e-30:
     B moves by about 1e-30 from zero, so the logits are the base's to the last bit); LoRA (rank 8 on every
     projection) and a full fine-tune from the same folder, on the same batches, and their final validation loss on
     the same sequences.

    OMP_NUM_THREADS=1 python bench/lora.py    # ~15 minutes on a (shared) 2-core CPU
    python bench/lora.py --steps 400 --device cuda
    python bench/lora.py --smoke            # every step above, 2 steps each, 16 validation sequences (the test suite)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from paratrain.api import train_rank
from paratrain.cli import main
from paratrain.config import load_config
from paratrain.data import DEFAULT_CORPUS

SPECIAL = ["<|endoftext|>", "<|begin|>", "<|start|>", "<|sep|>", "<|eot|>"]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "<|start|>assistant<|sep|>{% generation %}{{ message['content'] }}<|eot|>{% endgeneration %}"
            "{% else %}<|start|>{{ message['role'] }}<|sep|>{{ message['content'] }}<|eot|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}")
BASE = ["model.preset=tiny", "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=384", "model.max_seq_len=128"]


def tokenizer(folder: Path, vocab: int, corpus: Path = DEFAULT_CORPUS) -> Path:
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus.read_text()], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin|>", "eos_token": "<|eot|>"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder / "tokenizer.json"


def chat_set(path: Path, limit: int = 0) -> int:
    """Conversations of consecutive lines of the play: the user says one, the assistant answers with the next (the
    first `limit` + 1 lines only, if given)."""
    lines = [line.strip() for line in DEFAULT_CORPUS.read_text().splitlines() if len(line.strip()) > 20]
    lines = lines[:limit + 1] if limit else lines
    with open(path, "w") as f:
        for a, b in zip(lines, lines[1:]):
            f.write(json.dumps({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]})
                    + "\n")
    return len(lines) - 1


def run(common: list[str], name: str, *extra: str):
    start = time.perf_counter()
    result = train_rank(load_config(None, [*common, f"run.name={name}", *extra]))
    return result, time.perf_counter() - start


def base_val_loss(common: list[str]) -> float:
    """The trainer's evaluation of the base on the chat validation sequences (one LoRA step at lr 1e-30: B stays
    within 1e-30 of zero, the adapted model's logits are the base's)."""
    cfg = load_config(None, [*common, "run.name=base-eval", "lora.rank=1", "training.steps=1",
                             "optimizer.lr=1e-30", "optimizer.min_lr=0"])
    return train_rank(cfg).val_loss


def main_bench(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps")
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="working folder (default: a temporary one)")
    p.add_argument("--eval-sequences", type=int, default=256, help="validation sequences of the chat set")
    p.add_argument("--conversations", type=int, default=0, help="the chat set's size (0: every line of the play)")
    p.add_argument("--smoke", action="store_true", help="the same steps at 2 training steps each, 1,000 "
                   "conversations, 16 validation sequences (seconds; the test suite)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.pretrain_steps, a.eval_sequences, a.conversations = 2, 2, 16, 1000
    with tempfile.TemporaryDirectory(prefix="paratrain-lora-") as tmp:
        root = Path(a.out or tmp)
        corpus = DEFAULT_CORPUS
        if a.smoke:  # the first 200 KB of the play: the tokenizer's training and the data preparation in a second
            corpus = root / "corpus.txt"
            corpus.write_text(DEFAULT_CORPUS.read_text()[:200_000])
        tok = tokenizer(root / "tok", 512, corpus)
        shared = [f"training.device={a.device}", "metrics.progress=none", "metrics.peak_tflops=1",
                  "sample.max_new_tokens=0", f"run.out_dir={root / 'runs'}", "run.overwrite=true"]
        t0 = time.perf_counter()
        train_rank(load_config(None, [*BASE, *shared, "run.name=base", f"data.source={corpus}",
                                      f"data.dir={root / 'shakespeare'}", f"data.tokenizer={tok}",
                                      "training.seq_len=128", "training.micro_batch=16",
                                      f"training.steps={a.pretrain_steps}", "training.eval_every=0",
                                      *(["training.eval_sequences=16"] if a.smoke else []),
                                      "optimizer.lr=3e-3", "optimizer.warmup_steps=50"]))
        main(["export", str(root / "runs" / "base"), "--format", "hf", "--out", str(root / "base-hf"), "--dtype",
              "fp32", "--overwrite"])
        pretrain_s = time.perf_counter() - t0
        n = chat_set(root / "chat.jsonl", a.conversations)
        main(["prepare", "--input", str(root / "chat.jsonl"), "--out", str(root / "chat"), "--tokenizer",
              str(root / "base-hf" / "tokenizer.json"), "--chat", "--overwrite", "--quiet",
              "--chat-template", str(root / "tok" / "chat_template.jinja")])
        common = [*shared, f"model.init_from=hf:{root / 'base-hf'}", f"data.dir={root / 'chat'}",
                  "training.seq_len=96", "training.micro_batch=16", "training.eval_every=0",
                  f"training.eval_sequences={a.eval_sequences}", "optimizer.warmup_steps=20"]
        base = base_val_loss(common)
        lora, lora_s = run(common, "lora", f"lora.rank={a.rank}", f"training.steps={a.steps}", "optimizer.lr=3e-3")
        full, full_s = run(common, "full", f"training.steps={a.steps}", "optimizer.lr=3e-4")
    from paratrain.capabilities.lora import LoRA
    from paratrain.models.lora_params import adapted_params
    from paratrain.models.registry import parameters
    from paratrain.spec import model_args_from

    args = model_args_from(load_config(None, [*BASE, "model.vocab_size=512"]))
    table = adapted_params(parameters(args), LoRA(a.rank))
    trainable = sum(p.numel for p in table if p.trainable)
    total = sum(p.numel for p in parameters(args))
    print(f"base: {total:,} parameters pretrained {a.pretrain_steps} steps on tinyshakespeare ({pretrain_s:.0f}s); "
          f"chat set: {n:,} conversations (next line of the play), val = the assistant tokens of {a.eval_sequences} "
          "sequences")
    print("| model | trainable parameters | val loss (assistant tokens) | train loss, last step | time |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| base (no fine-tuning) | - | {base:.4f} | - | - |")
    print(f"| LoRA rank {a.rank}, {a.steps} steps, lr 3e-3 | {trainable:,} ({trainable / total:.1%}) | "
          f"{lora.val_loss:.4f} | {lora.losses[-1]:.4f} | {lora_s:.0f}s |")
    print(f"| full fine-tune, {a.steps} steps, lr 3e-4 | {total:,} (100%) | {full.val_loss:.4f} | "
          f"{full.losses[-1]:.4f} | {full_s:.0f}s |")
    print("LoRA below the base:", "yes" if lora.val_loss < base else "NO")


if __name__ == "__main__":
    main_bench()
