"""Generation speed with and without the KV cache (paratrain/generate.py): `generate.sample`, greedy, on one process.

The model is the default preset (shakespeare-char: width 128, 4 layers, 4 heads, a 65-character vocabulary), random
weights, its context raised to the prompt plus the most new tokens (1,088) so that a 64-token prompt and 1,024 new
tokens stay in the window (past it, both paths slide a window and run whole forwards, and a row would measure the
window). Tokens/s is new tokens over the wall time of `sample`; the cached and uncached tokens must be equal.

Without the cache, token i is a forward over 64 + i tokens: 1,024 new tokens are 1,024 forwards over 64 to 1,087
tokens, ~12x the work of the 256-token row (~45 minutes on a loaded 2-core machine). A row longer than
`--plain-tokens` therefore times the uncached path in `--spans` spans spread evenly over the row (span s: a real
`sample` call from the prompt plus the cached run's tokens before its start, its tokens compared with the cached
run's there): the uncached tokens/s is the spans' tokens over their summed wall time, the contexts the whole row
would see sampled evenly. The cached column always generates the whole row in one call.

The threads are OMP_NUM_THREADS (2 unless set) for both paths; the cached path runs its one-token forwards of this
small model on one of them (paratrain/generate.py `ONE_THREAD_WORK`).

    python bench/generate_speed.py                 # 64, 256 and 1,024 new tokens
    python bench/generate_speed.py --plain-tokens 1024   # the uncached path over all 1,024 tokens (slow)
    python bench/generate_speed.py --tokens 256 --device cuda
    python bench/generate_speed.py --smoke         # a tiny model, 8 new tokens (the test suite)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = 64


def timed(model, prompt, tokens, context, device, use_cache) -> tuple[list[int], float]:
    import torch

    from paratrain.generate import sample

    start = time.perf_counter()
    out = sample(model, prompt, tokens, context, temperature=0.0, device=device, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def uncached(model, prompt, cached, context, device, most, spans) -> tuple[int, float, bool]:
    """(tokens, seconds, equal to the cached run's) of the uncached path over the cached run's row: one call over
    the whole row up to `most` tokens, else `spans` calls of most // spans tokens starting evenly over the row."""
    n = len(cached)
    starts, length = ([0], n) if n <= most else (range(0, n, n // spans), most // spans)
    total, seconds, same = 0, 0.0, True
    for start in starts:
        out, s = timed(model, prompt + cached[:start], length, context, device, False)
        same &= out == cached[start:start + length]
        total, seconds = total + length, seconds + s
    return total, seconds, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,256,1024", help="new tokens of each row")
    parser.add_argument("--preset", default="shakespeare-char")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plain-tokens", type=int, default=256,
                        help="rows longer than this time the uncached path in spans (see above)")
    parser.add_argument("--spans", type=int, default=8, help="the uncached spans of such a row")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from paratrain.distributed.initialize import init_weights
    from paratrain.models import build_model, preset_args

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    counts = [8] if args.smoke else [int(n) for n in args.tokens.split(",")]
    if args.smoke:  # the spans too
        args.plain_tokens, args.spans = 4, 2
    preset = "tiny" if args.smoke else args.preset
    context = PROMPT + max(counts)
    device = torch.device(args.device)
    model_args = preset_args(preset, vocab_size=65, max_seq_len=max(context, preset_args(preset, 65).max_seq_len))
    model = build_model(model_args).to(device)
    init_weights(model, 0)
    prompt = torch.randint(0, 65, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    timed(model, prompt, 4, context, device, True)  # warm-up (allocator, kernels)
    print(f"`generate.sample`, greedy, {preset} (context {model_args.max_seq_len}), {PROMPT}-token prompt, "
          f"{args.device}, {torch.get_num_threads()} threads")
    print("| new tokens | no cache tokens/s | no cache tokens timed | KV cache tokens/s | speed-up | same tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for n in counts:
        cached, cached_s = timed(model, prompt, n, context, device, True)
        plain_n, plain_s, same = uncached(model, prompt, cached, context, device, args.plain_tokens, args.spans)
        ok &= same
        timed_text = f"{plain_n:,}" if plain_n == n else f"{plain_n:,} ({args.spans} spans)"
        print(f"| {n:,} | {plain_n / plain_s:,.1f} | {timed_text} | {n / cached_s:,.1f} | "
              f"{(n / cached_s) / (plain_n / plain_s):.1f}x | {'yes' if same else 'NO'} |")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
