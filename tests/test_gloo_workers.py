"""Issue 52 item 5: a tp2 rank aborted under load ("malloc(): unaligned tcache chunk detected") in a gloo
functional-collective wait: torch's two gloo workers per group assign the group's status string at once
(paratrain/distributed/gloo_workers.py). paratrain's groups run one worker; this runs tp2's gathers (the final weights'
full state dict, the loss-parallel logits' full_tensor, bursts of async DTensor all-gathers) many times on 2 gloo ranks
under glibc's heap checks (MALLOC_CHECK_=3 with its debug allocator, freed memory overwritten)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MALLOC_DEBUG = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")  # glibc >= 2.34 reads MALLOC_CHECK_ only here


def _rank(rank: int, port: int, iters: int, burst: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.distributed.env import init_process_group
    from paratrain.distributed.tensor_parallel import apply_tp
    from paratrain.models import build_model
    from paratrain.models.presets import preset_args

    torch.set_num_threads(1)
    init_process_group(torch.device("cpu"), timeout_s=120)
    mesh = init_device_mesh("cpu", (2,))
    cpu = torch.device("cpu")
    for group in (dist.group.WORLD, mesh.get_group(), dist.new_group()):
        assert group._get_backend(cpu).options._threads == 1  # one worker: one writer of the group's status
    torch.manual_seed(0)
    args = preset_args("tiny", vocab_size=65)
    whole = build_model(args)
    model = build_model(args)
    model.load_state_dict(whole.state_dict())
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
    x = torch.randint(0, 65, (2, 32))  # (B, T)
    with torch.no_grad():
        expected = whole(x)  # (B, T, V)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = get_model_state_dict(whole, options=full)
    part = torch.full((2, 3), float(rank))
    for _ in range(iters):
        weights = get_model_state_dict(model, options=full)  # the final weights' gather (training/checkpoint.py)
        assert weights.keys() == reference.keys() and all(torch.equal(weights[k], v) for k, v in reference.items())
        with torch.no_grad():
            logits = model(x).full_tensor()  # (B, T, V), from the vocabulary's shards
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        gathered = [funcol.all_gather_tensor(part, 0, mesh) for _ in range(burst)]  # in flight together
        assert all(torch.equal(g.wait(), torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2)) for g in gathered)
    dist.destroy_process_group()


def test_tp2_gathers_under_heap_checks():
    from paratrain.distributed.launch import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165",
           "PYTHONFAULTHANDLER": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if MALLOC_DEBUG.exists():
        env["LD_PRELOAD"] = str(MALLOC_DEBUG)
    done = subprocess.run([sys.executable, "-W", "ignore", __file__, str(free_port()), "20", "8"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":  # the 2 ranks, in a fresh interpreter that starts under the heap checks
    import torch.multiprocessing as mp

    port, iters, burst = map(int, sys.argv[1:4])
    mp.spawn(_rank, args=(port, iters, burst), nprocs=2)
