"""More than one machine, on this one: two torchrun agents (`--nnodes 2 --nproc-per-node 2`, a c10d rendezvous on
127.0.0.1), each a node of two gloo ranks, as a cluster scheduler starts them.

- the 2 x 2 run trains to one process's losses (fp32, the same global batch) within 1e-5, and the checkpoint both
  nodes wrote resumes on one node;
- with a rank killed under `--max-restarts 1`, both nodes restart and resume from the newest checkpoint (and under
  one agent too);
- `paratrain doctor` across the two agents all-reduces over every node;
- the sbatch script `paratrain plan` writes for 2 nodes runs to the end, its `srun` and `scontrol` replaced by
  stubs that start one agent per node here.

Every process is started by these tests, in its own session, and only those are ended.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fast_overrides
from paratrain.api import train_rank
from paratrain.config import load_config
from paratrain.distributed.launch import free_port
from paratrain.observe.metrics import in_effect
from paratrain.training.checkpoint import complete_checkpoints

STEPS = 6
# a constant learning rate: a run of fewer steps is the start of a longer one (the same losses step by step)
SAME = ["training.global_batch=8", "training.micro_batch=2", "optimizer.lr=0.001", "optimizer.min_lr=0.001",
        "optimizer.warmup_steps=0", "training.eval_every=0", "metrics.progress=lines"]


def env() -> dict:
    e = {**os.environ, "OMP_NUM_THREADS": "1"}
    e.pop("PARATRAIN_FAULTS", None)
    return e


def agents(args: list[str], extra_env: dict | None = None, restarts: int = 0, timeout: float = 300,
           command: list[str] | None = None, per_node: int = 2) -> list[str]:
    """Two torchrun agents of one job (node ranks from the rendezvous), `per_node` ranks each, running
    `paratrain train ARGS` (or `paratrain COMMAND`); returns their outputs, both exit 0."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
           "--max-restarts", str(restarts), "-m", "paratrain", *(command or ["train", *args])]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env(), **(extra_env or {})}, start_new_session=True) for _ in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in in_effect(records)[0] if "loss" in r}


@pytest.fixture(scope="module")
def one_process(char_data, tmp_path_factory):
    """The reference: one process, STEPS steps."""
    out = tmp_path_factory.mktemp("one")
    return train_rank(load_config(None, fast_overrides(char_data, out, "one", f"training.steps={STEPS}", *SAME))).losses


def close(got: dict[int, float], reference: list[float], steps) -> None:
    assert sorted(got) == list(steps)
    assert max(abs(got[s] - reference[s - 1]) for s in steps) <= 1e-5, (got, reference)


def test_two_nodes_match_one_process_through_a_restart_and_their_checkpoint_resumes_on_one(char_data, tmp_path,
                                                                                          one_process):
    """Two agents, `--max-restarts 1`, rank 1 (the first node's) SIGKILLed before step 4 of the first attempt: its
    agent restarts its ranks and the other node's agent restarts its healthy ones (a membership change, with an
    elastic restart count of 0 there). Every rank agrees on attempt 1 from the agents' store, so all resume from
    the step-2 checkpoint both nodes wrote and the run ends with one process's losses; then one node of two ranks
    continues it."""
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "two", "training.steps=4", "checkpoint.every=2",
                                             "training.log_every=1", *SAME)]
    outs = agents(args, extra_env={"PARATRAIN_FAULTS": "kill@3:1"}, restarts=1)
    assert "[rank" not in "".join(outs)  # rank lines only with --verbose
    run = tmp_path / "two"
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in "".join(outs)
    close(losses(run), one_process, range(1, 5))
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [(r["step"], r["restarts"]) for r in records if r.get("segment")] == [(0, 0), (2, 1)]
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step-2", "step-4"]
    # the same run continued by one node of two ranks (paratrain's own launcher)
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", "--nproc", "2", *args,
                           f"--training.steps={STEPS}", "--checkpoint.resume=auto"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-4'} at step 4" in done.stdout
    close(losses(run), one_process, range(1, STEPS + 1))


def test_doctor_across_two_agents_all_reduces_over_every_node(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 -m paratrain doctor`: one all-reduce over the job's 4 ranks; each
    node's first rank prints its node's report."""
    outs = agents([], command=["doctor", "--checkpoint-dir", str(tmp_path)])
    for out in outs:
        assert out.count("paratrain doctor") == 1, out
        assert "4 gloo ranks" in out and "on 2 nodes, 2 per node" in out, out
        assert "0 FAIL" in out, out


def test_torchrun_restart_resumes_from_the_newest_checkpoint(char_data, tmp_path, one_process):
    """`torchrun --max-restarts 1`, rank 1 SIGKILLed before step 4 on the first attempt: the restarted ranks (a store
    prefix of their own, distributed/env.py `restart_store`) resume from step-2 and end with the uninterrupted
    losses."""
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "restarted", f"training.steps={STEPS}",
                                             "checkpoint.every=2", "training.log_every=1", *SAME)]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", "-m", "paratrain", "train", *args], capture_output=True, text=True,
                          env={**env(), "PARATRAIN_FAULTS": "kill@3:1"}, timeout=240, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "restarted"
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in done.stdout
    close(losses(run), one_process, range(1, STEPS + 1))
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [(r["step"], r["restarts"]) for r in records if r.get("segment")] == [(0, 0), (2, 1)]


def test_the_plan_sbatch_script_runs_with_stub_srun(char_data, tmp_path):
    """`paratrain plan` for 2 nodes of 2 GPUs writes plan.sbatch; run as Slurm would (one task per node), with
    `scontrol` answering 127.0.0.1 and `srun` starting the task once per node here, it trains to the end."""
    plan = tmp_path / "plan"
    done = subprocess.run([sys.executable, "-m", "paratrain", "plan", "--model", "tiny", "--gpus", "4",
                           "--gpus-per-node", "2", "--gpu", "H100", "--seq", "32", "--global-batch-tokens", "256",
                           "--out", str(plan)], capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    script = (plan / "plan.sbatch").read_text()
    assert "srun torchrun --nnodes 2 --nproc-per-node 2" in script
    stubs = tmp_path / "bin"
    stubs.mkdir()
    port = free_port()
    overrides = " ".join(f"--{o}" for o in fast_overrides(char_data, tmp_path, "slurm", "training.steps=2",
                                                          "training.eval_every=0", "training.device=cpu",
                                                          "training.micro_batch=2"))  # the plan's 8 over 4 ranks
    # srun: one task per node, here; the fixed rendezvous port of the script made free, and the test's sizes
    # appended to the training command (a cluster would train the planned 2000 steps)
    (stubs / "srun").write_text(f"""#!/bin/bash
args=("${{@/:29500/:{port}}}")
"${{args[@]}}" {overrides} & first=$!
"${{args[@]}}" {overrides} & second=$!
wait $first && wait $second
""")
    (stubs / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for stub in ("srun", "scontrol"):
        (stubs / stub).chmod((stubs / stub).stat().st_mode | stat.S_IXUSR)
    slurm = {"PATH": f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]",
             "SLURM_JOB_ID": "42"}
    done = subprocess.run(["bash", str(plan / "plan.sbatch")], cwd=tmp_path, capture_output=True, text=True,
                          env={**env(), **slurm}, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "slurm" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert next(r for r in records if "world_size" in r)["world_size"] == 4


def test_diloco_across_two_nodes_resumes_mid_round_after_a_kill(char_data, tmp_path):
    """DiLoCo with one replica per node (two agents of one rank each: ddp over 2 ranks, `parallel.dp_sync=diloco`,
    H = 4 in 2 fragments, so one fragment syncs after steps 2, 4, 6): rank 1 (the second node's only rank) SIGKILLed
    before step 5 under `--max-restarts 1`; both agents restart their ranks, which resume from step-3, in the middle
    of a round (the replicas' own weights and AdamW moments, the fragments' starts and outer momenta: per-rank
    checkpoint state), and steps 4-6 have the uninterrupted DiLoCo run's losses bit for bit."""
    from paratrain.api import train

    diloco = ["parallel.dp_sync=diloco", "parallel.dp_mode=ddp", "diloco.inner_steps=4", "diloco.fragments=2",
              f"training.steps={STEPS}", "checkpoint.every=3", "training.log_every=1", *SAME]
    straight = train(load_config(None, fast_overrides(char_data, tmp_path, "straight", *diloco)), nproc=2)
    args = [f"--{o}" for o in fast_overrides(char_data, tmp_path, "two", *diloco)]
    outs = agents(args, extra_env={"PARATRAIN_FAULTS": "kill@4:1"}, restarts=1, per_node=1)
    run = tmp_path / "two"
    assert f"resumed from {run / 'checkpoints' / 'step-3'} at step 3" in "".join(outs)
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == straight.losses  # ==: bitwise, the resumed steps 4-6 included
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [(r["step"], r["restarts"]) for r in records if r.get("segment")] == [(0, 0), (3, 1)]
    synced = sorted({r["step"] for r in in_effect(records)[0] if r.get("diloco_bytes", 0) > 0})
    assert synced == [2, 4, 6]
