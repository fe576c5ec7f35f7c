"""Generation speed with and without the KV cache (paratrain/generate.py): `generate.sample`, greedy, on one process.

The model is the default preset (shakespeare-char: width 128, 4 layers, 4 heads, a 65-character vocabulary), random
weights, its context raised to 1,152 tokens so that a 64-token prompt and 1,024 new tokens stay in the window (past
it, both paths slide a window and run whole forwards). Tokens/s is new tokens over the wall time of `sample`; the
cached and uncached tokens must be equal.

    python bench/generate_speed.py                 # 64, 256 and 1,024 new tokens
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,256,1024", help="new tokens of each row")
    parser.add_argument("--preset", default="shakespeare-char")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from paratrain.distributed.initialize import init_weights
    from paratrain.models import build_model, preset_args

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    counts = [8] if args.smoke else [int(n) for n in args.tokens.split(",")]
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
    print("| new tokens | no cache tokens/s | KV cache tokens/s | speed-up | same tokens |")
    print("| ---: | ---: | ---: | ---: | --- |")
    ok = True
    for n in counts:
        plain, plain_s = timed(model, prompt, n, context, device, False)
        cached, cached_s = timed(model, prompt, n, context, device, True)
        ok &= plain == cached
        print(f"| {n:,} | {n / plain_s:,.1f} | {n / cached_s:,.1f} | {plain_s / cached_s:.1f}x | "
              f"{'yes' if plain == cached else 'NO'} |")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
