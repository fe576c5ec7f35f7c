"""`paratrain prepare` at scale: throughput, worker scaling and peak memory on a synthetic corpus.

Generates (once, deterministically, no download) a corpus of `.jsonl.gz` shards of about 50 MB of text
each: documents of Zipf-distributed pseudo-words in sentences and paragraphs, a few KB each. Trains a
byte-level BPE on a sample, then runs `paratrain prepare --tokenizer FILE.json` in a fresh process for
each (corpus size, workers) pair and prints a table: input MB, documents, tokens, wall seconds, MB/s,
tokens/s and the peak RSS of the whole process tree (sampled every 0.1 s from /proc). Beside it, the
raw rate of the same tokenizer's batch encoding in one process on the same text (the practical limit).

    python bench/prepare.py --corpus-dir /tmp/paratrain-bench --sizes-gb 1,3 --workers 1,2
    python bench/prepare.py --sizes-gb 0.1 --workers 1,2      # a quick look
    python bench/prepare.py --smoke      # one 1 MB shard, 1 worker, a 512-token BPE, in a fresh folder (the test suite)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

SHARD_TEXT_MB = 50
LEXICON, SENTENCES = 40_000, 200_000


def _lexicon(rng) -> list:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1.0 / np.arange(1, 27) ** 0.9
    lengths = np.clip(rng.poisson(5.0, LEXICON), 1, 14)
    words = ["".join(rng.choice(letters, n, p=p / p.sum())) for n in lengths]
    for i in range(0, LEXICON, 7):
        words[i] = words[i].capitalize()
    return words


def _sentence_pool(seed: int = 0, sentences: int = SENTENCES) -> list:
    """`sentences` (200k) sentences of Zipf-distributed words (the same on every call)."""
    rng = np.random.default_rng(seed)
    words = np.array(_lexicon(rng), dtype=object)
    rank = np.arange(1, LEXICON + 1)
    cdf = np.cumsum(1.0 / rank ** 1.05)
    cdf /= cdf[-1]
    lengths = np.clip(rng.poisson(14, sentences), 3, 40)
    idx = np.searchsorted(cdf, rng.random(int(lengths.sum())))
    ends = np.cumsum(lengths)
    punct = np.array([".", ".", ".", "?", "!", ";", ":"], dtype=object)
    out, start = [], 0
    for i, end in enumerate(ends.tolist()):
        s = " ".join(words[idx[start:end]])
        out.append(s[0].upper() + s[1:] + punct[i % len(punct)] + (f" {i % 1000}" if i % 11 == 0 else ""))
        start = end
    return out


_POOL = None


def _write_shard(args) -> tuple:
    path, index, shard_mb, sentences = args
    global _POOL
    if _POOL is None or len(_POOL) != sentences:
        _POOL = _sentence_pool(sentences=sentences)
    rng = np.random.default_rng(1000 + index)
    target, size, docs = int(shard_mb * 10**6), 0, 0
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        while size < target:
            n = int(np.clip(rng.lognormal(3.3, 0.8), 2, 2000))  # sentences in the document
            picks = rng.integers(0, len(_POOL), n)
            breaks = rng.random(n) < 0.15
            text = "".join(_POOL[p] + ("\n\n" if b else " ") for p, b in zip(picks.tolist(), breaks.tolist())).strip()
            f.write(json.dumps({"id": f"{index}-{docs}", "text": text}) + "\n")
            size += len(text.encode())
            docs += 1
    os.rename(tmp, path)
    return size, docs


def make_corpus(folder: Path, shards: int, shard_mb: float = SHARD_TEXT_MB, sentences: int = SENTENCES) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"shard-{i:05d}.jsonl.gz" for i in range(shards)]
    todo = [(p, i, shard_mb, sentences) for i, p in enumerate(paths) if not p.exists()]
    if todo:
        start = time.perf_counter()
        if len(todo) == 1:  # (the smoke run's one shard: no pool to start)
            _write_shard(todo[0])
        else:  # spawn: workers start clean, not as forks of a process whose other threads may hold locks
            with get_context("spawn").Pool(min(os.cpu_count() or 1, len(todo))) as pool:
                pool.map(_write_shard, todo)
        print(f"generated {len(todo)} shards in {time.perf_counter() - start:.0f}s", flush=True)
    return paths


def read_texts(paths, limit_bytes=None) -> list:
    texts, size = [], 0
    for p in paths:
        with gzip.open(p, "rt", encoding="utf-8") as f:
            for line in f:
                t = json.loads(line)["text"]
                texts.append(t)
                size += len(t.encode())
                if limit_bytes and size >= limit_bytes:
                    return texts
    return texts


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack += children.get(pid, [])
    return total


def run_prepare(inputs, out: Path, tokenizer: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "paratrain", "prepare", "--input", str(inputs), "--out", str(out), "--tokenizer",
           str(tokenizer), "--workers", str(workers), "--overwrite", "--quiet", "--val-fraction", "0.01"]
    start, peak, load = time.perf_counter(), 0, os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # rusage: the process and its reaped workers
            if pid:
                break
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out_f.seek(0), err_f.seek(0)
        out_text, err = out_f.read(), err_f.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed: {err.strip()}")
    meta = json.loads((out / "meta.json").read_text())
    compressed = sum(s["bytes"] for s in meta["sources"])  # bytes read from disk
    return {"wall": wall, "peak": peak, "meta": meta, "compressed": compressed, "line": out_text.strip(),
            "cpu": usage.ru_utime + usage.ru_stime, "load": (load + os.getloadavg()[0]) / 2}


def raw_rate(tokenizer: Path, texts: list, parallel: bool, fast: bool) -> tuple:
    """(MB/s, tokens/s) of encode_batch on texts in this process; parallel: the library's own threads."""
    code = f"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = {"'true'" if parallel else "'false'"}
import tokenizers
tok = tokenizers.Tokenizer.from_file({str(tokenizer)!r})
texts = json.load(open(sys.argv[1]))
encode = tok.encode_batch_fast if {fast} else tok.encode_batch
n, size = 0, sum(len(t.encode()) for t in texts)
start, cpu = time.perf_counter(), time.process_time()
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) for e in encode(texts[i:i + 256], add_special_tokens=False))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps([size / 1e6 / wall, n / wall, size / 1e6 / cpu]))
"""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    try:
        out = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return tuple(json.loads(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", default=os.path.join(tempfile.gettempdir(), "paratrain-bench-prepare"))
    parser.add_argument("--sizes-gb", default="1,3", help="corpus sizes (GB of text), comma-separated")
    parser.add_argument("--workers", default=f"1,{os.cpu_count()}", help="worker counts, comma-separated")
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--raw-mb", type=float, default=200, help="text for the raw encode_batch rate")
    parser.add_argument("--runs", default="", help="only these size:workers pairs, e.g. 1:1,1:2,3:2 ('none': raw rate only)")
    parser.add_argument("--shard-mb", type=float, default=SHARD_TEXT_MB, help="MB of text per generated shard")
    parser.add_argument("--smoke", action="store_true", help="one 1 MB shard (a pool of 5,000 sentences), 1 worker, a "
                        "512-token BPE, 1 MB for the raw rate, in a fresh temporary folder (seconds; the test suite)")
    args = parser.parse_args()
    if not args.smoke:
        return bench(args, SENTENCES)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-prepare-smoke-") as folder:
        args.corpus_dir = folder
        args.sizes_gb, args.workers, args.vocab_size, args.raw_mb, args.shard_mb = "0.001", "1", 512, 1, 1
        bench(args, sentences=5000)


def bench(args, sentences: int) -> None:
    root = Path(args.corpus_dir)
    sizes = [float(s) for s in args.sizes_gb.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    shards = {s: max(1, round(s * 1000 / args.shard_mb)) for s in sizes}
    paths = make_corpus(root / "corpus", max(shards.values()), args.shard_mb, sentences)

    tok_dir = root / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"""
from paratrain.data.prepare import sample_texts
from paratrain.data.sources import resolve_inputs
from paratrain.data.tokenizers import HFTokenizer
HFTokenizer.train_bpe(sample_texts(resolve_inputs({str(paths[0])!r}), 'text', 32_000_000), {args.vocab_size}).save({str(tok_dir)!r})
"""], check=True)
        print(f"trained BPE {args.vocab_size} on 32 MB in {time.perf_counter() - start:.0f}s", flush=True)
    tokenizer = tok_dir / "tokenizer.json"

    texts = read_texts(paths, int(args.raw_mb * 1e6))
    raw = {(p, f): raw_rate(tokenizer, texts, p, f) for p in (False, True) for f in (False, True)}
    del texts
    print(f"raw tokenizer rate on {args.raw_mb:.0f} MB of the same text, one process:")
    for (p, f), (mbs, toks, per_cpu) in raw.items():
        print(f"  {'encode_batch_fast' if f else 'encode_batch':<18} {'library threads (all cores)' if p else '1 thread':<28}"
              f" {mbs:6.2f} MB/s {toks:12,.0f} tokens/s {per_cpu:6.2f} MB per CPU s")

    pairs = [(s, w) for s in sizes for w in workers]
    if args.runs == "none":
        return
    if args.runs:
        pairs = [(float(a), int(b)) for a, b in (r.split(":") for r in args.runs.split(","))]
    rows = []
    for size, w in pairs:
        links = root / f"input-{size:g}gb"
        links.mkdir(exist_ok=True)
        for p in paths[:shards[size]]:
            if not (links / p.name).exists():
                os.symlink(p, links / p.name)
        r = run_prepare(str(links / "*.jsonl.gz"), root / "out", tokenizer, w)
        meta = r["meta"]
        tokens = meta["train_tokens"] + meta["val_tokens"]
        docs = meta["train_documents"] + meta["val_documents"]
        rows.append((size, w, r, tokens, docs))
        print(f"{size:g} GB, {w} worker(s): {r['wall']:.0f}s, peak RSS {r['peak'] / 2**20:.0f} MiB ({r['line']})", flush=True)
    print()
    print("| input | text MB | .gz MB | shards | documents | tokens | workers | wall s | MB/s | tokens/s | peak RSS (tree) "
          "| CPU s (tree) | MB per CPU s | load avg |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, w, r, tokens, docs in rows:
        meta = r["meta"]
        text_mb = meta["text_characters"] / 1e6  # the synthetic corpus is ASCII: characters = bytes
        print(f"| {size:g} GB | {text_mb:,.0f} | {r['compressed'] / 1e6:,.0f} | {len(meta['sources'])} | {docs:,} | "
              f"{tokens:,} | {w} | {r['wall']:.0f} | {text_mb / r['wall']:.2f} | {tokens / r['wall']:,.0f} | "
              f"{r['peak'] / 2**20:,.0f} MiB | {r['cpu']:,.0f} | {text_mb / r['cpu']:.2f} | {r['load']:.1f} |")
    one = raw[(False, True)]
    print(f"| raw encode_batch_fast, 1 thread, {args.raw_mb:.0f} MB | | | | | | 1 | | {one[0]:.2f} | {one[1]:,.0f} | | "
          f"| {one[2]:.2f} | |")


if __name__ == "__main__":
    main()
