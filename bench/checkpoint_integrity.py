"""What checkpoint checksums cost: a save with and without hashing, and a full verification, by checkpoint size.

One process (no process group): a stack of Linear layers with AdamW state (12 bytes per parameter, as a training
checkpoint), saved by paratrain's CheckpointWriter (DCP write + trainer.pt + SHA-256 of every file + CHECKSUMS +
COMPLETE + rename), then verified as `resume=auto` and `paratrain checkpoint verify` do. With N ranks each rank hashes
1/N of the files at save and at resume. Prints a table; the hashing reads the files back, from the page cache right
after a save and from disk (or cache) when verifying.

    python bench/checkpoint_integrity.py [--sizes-mib 64,256,1024] [--repeat 3]
    python bench/checkpoint_integrity.py --smoke     # one 12 MiB checkpoint, once (the test suite)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from paratrain.training import integrity
from paratrain.training.checkpoint import CheckpointWriter, checkpoint_problem


def model_of(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    params = mib * 2**20 // 12  # fp32 weights + two fp32 moments
    width = 1024
    layers = max(1, params // (width * width))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="64,256,1024")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="one small checkpoint, saved once (seconds; the test suite)")
    a = p.parse_args()
    if a.smoke:
        a.sizes_mib, a.repeat = "12", 1
    h = hashlib.sha256()
    blob_mib = 16 if a.smoke else 256
    blob = bytes(blob_mib * 2**20)
    t = time.perf_counter()
    h.update(blob)
    print(f"sha256 in memory: {blob_mib / (time.perf_counter() - t):.0f} MiB/s (hashlib, one thread)")
    print("| checkpoint | files | DCP write | + hashing at save | save total | hashing share | verify (resume/generate) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mib in map(int, a.sizes_mib.split(",")):
        model, opt = model_of(mib)
        writes, hashes, totals, verifies = [], [], [], []
        size = files = 0
        with tempfile.TemporaryDirectory() as root:
            writer = CheckpointWriter(Path(root), keep=2, is_main=True)
            for i in range(a.repeat):
                t0 = time.perf_counter()
                final = writer.save(i + 1, model, opt, {"step": i + 1})
                totals.append(time.perf_counter() - t0)
                names = integrity.listed_files(final)
                t1 = time.perf_counter()
                integrity.hash_files(final, names)  # what the save spent on hashing (the files are still cached)
                hashes.append(time.perf_counter() - t1)
                writes.append(totals[-1] - hashes[-1])
                t2 = time.perf_counter()
                assert checkpoint_problem(final) is None
                verifies.append(time.perf_counter() - t2)
                size = sum((final / n).stat().st_size for n in names)
                files = len(names)
        w, hs, tot, v = (statistics.median(x) for x in (writes, hashes, totals, verifies))
        print(f"| {size / 2**20:.0f} MiB | {files} | {w:.2f} s | {hs:.2f} s | {tot:.2f} s | {hs / tot:.0%} | "
              f"{v:.2f} s ({size / 2**20 / v:.0f} MiB/s) |")


if __name__ == "__main__":
    main()
