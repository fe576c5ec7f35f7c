"""Pipeline step time against the microbatch count on CPU ranks, beside the bubble formula.

Each row trains the same model on the same global batch for a few steps on `pp` local gloo ranks
(one stage per rank, `--schedules` by name) and reports the mean step time after warm-up, the
measured idle fraction per stage (1 - the stage's forward/backward compute time / step time) and
the predicted bubble (p-1)/(m+p-1). A one-process row gives the step time without pipelining.

    python bench/pipeline.py [--pp 2] [--microbatches 2,4,8,16] [--schedules gpipe,1f1b] [--steps 6]
    python bench/pipeline.py --smoke     # one row: pp 2, 1f1b, 2 microbatches, 3 steps of a 2-block model
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from paratrain.models.llama import cross_entropy
from paratrain.modes import Schedule


def _data(args, steps):
    g = torch.Generator().manual_seed(0)
    shape = (steps, args["batch"], args["seq_len"])
    return torch.randint(0, 128, shape, generator=g), torch.randint(0, 128, shape, generator=g)


def _model_args(a):
    from paratrain.models.presets import preset_args

    return preset_args("shakespeare-char", vocab_size=128, n_layers=a["layers"], max_seq_len=a["seq_len"])


def single(a) -> float:
    from paratrain.distributed.initialize import init_weights
    from paratrain.models.llama import Transformer

    model = Transformer(_model_args(a))
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    X, Y = _data(a, a["steps"])
    times = []
    for i in range(a["steps"]):
        start = time.perf_counter()
        cross_entropy(model(X[i]), Y[i]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return sum(times[2:]) / len(times[2:])


def ranked(a, pp: int, schedule: str, m: int):
    import torch.distributed as dist

    from paratrain.config import ActivationCheckpointConfig
    from paratrain.distributed.env import init_process_group
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.distributed.pipeline import build_pipeline
    from paratrain.layout import Batch, Layout
    from paratrain.models.llama import Transformer

    init_process_group(torch.device("cpu"), timeout_s=1800)  # gloo with torch's default timeout
    margs = _model_args(a)
    layout = Layout.resolve(pp, pp=pp, pp_schedule=schedule, pp_microbatches=m).validate(
        margs, pp, Batch(a["batch"], a["batch"], a["seq_len"]))
    dims = ParallelDims.build(layout, "cpu")
    with torch.device("meta"):
        model = Transformer(margs)
    pipe = build_pipeline(dims, model, ActivationCheckpointConfig(), "fp32", False, torch.device("cpu"), 0,
                          cross_entropy)
    opt = torch.optim.AdamW(pipe.model.parameters(), lr=1e-3)
    X, Y = _data(a, a["steps"])
    times, bubbles = [], []
    for i in range(a["steps"]):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(X[i], Y[i])
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        bubbles.append(pipe.measured_bubble())
    dist.destroy_process_group()
    steady = bubbles[2:]
    return (sum(times[2:]) / len(times[2:]), [sum(b[s] for b in steady) / len(steady) for s in range(pp)],
            layout.predicted_bubble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2", help="comma-separated pipeline degrees (ranks)")
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="one small row (seconds; the test suite)")
    args = parser.parse_args()
    if args.smoke:
        args.pp, args.microbatches, args.schedules = "2", "2", "1f1b"
        args.batch, args.seq_len, args.layers, args.steps = 4, 32, 2, 3
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from paratrain.distributed.launch import launch

    a = {"batch": args.batch, "seq_len": args.seq_len, "layers": args.layers, "steps": args.steps}
    print(f"model shakespeare-char width, {args.layers} layers; global batch {args.batch} x {args.seq_len} tokens; "
          f"mean of steps 3..{args.steps}")
    print(f"1 process: step {single(a) * 1e3:.1f} ms")
    print("| pp | schedule | microbatches | step ms | predicted bubble | measured idle per stage |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for pp in [int(x) for x in args.pp.split(",")]:
        for schedule in args.schedules.split(","):
            for m in [int(x) for x in args.microbatches.split(",")]:
                if not Schedule(schedule).all_forwards_first and m < pp:  # (Layout's rule)
                    continue
                step, measured, predicted = launch(ranked, (a, pp, schedule, m), pp,
                                                   preload=("paratrain.distributed.pipeline",))
                idle = ", ".join(f"{v:.0%}" for v in measured)
                print(f"| {pp} | {schedule} | {m} | {step * 1e3:.1f} | {predicted:.0%} | {idle} |", flush=True)


if __name__ == "__main__":
    main()
