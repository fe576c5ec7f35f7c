"""Hostile input to every command, as an operator would type it.

Each case asserts the exit code, exactly one `error:` line on stderr and no traceback, and that every file that
existed before is byte-identical afterwards with nothing added (the working directory included: `--run.name=..`
once overwrote a config.toml there). The world the cases run in holds a previous run (its files must survive a
failed start under the same name, even with --run.overwrite=true: nothing is deleted before every check passed), a checkpoint with one shard corrupted at the same size, a read-only folder, a
busy port, a file where folders are expected, and a metrics file that is not UTF-8.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import fast_overrides
from mounts import read_only_folder
from paratrain import cli


@dataclass
class World:
    root: Path
    data: Path
    prev: Path  # a finished run (runs/prev) whose files must stay as they are
    ckpt: Path  # its checkpoint
    corrupt: Path  # a copy of that checkpoint with a shard changed in place
    afile: Path
    empty: Path
    garbled: Path  # a run folder whose metrics.jsonl is not UTF-8
    hf_bad: Path  # a "Hugging Face folder" whose config.json is not JSON
    ro: Path
    inf_toml: Path  # a config file with lr = inf (TOML has infinity)
    port: int

    def train(self, *extra: str) -> list[str]:
        return ["train", *(f"--{o}" for o in fast_overrides(self.data, self.root / "runs", "prev", "run.overwrite=true")),
                *extra]


@pytest.fixture(scope="module")
def world(char_data, trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    prev = root / "runs" / "prev"
    shutil.copytree(trained_run, prev)
    ckpt = prev / "checkpoints" / "step-3"
    corrupt = root / "step-3"
    shutil.copytree(ckpt, corrupt)
    shard = next(corrupt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 8])
    shard.write_bytes(bytes(data))
    (root / "afile.txt").write_text("just some text\n")
    (root / "empty").mkdir()
    (root / "garbled").mkdir()
    (root / "garbled" / "metrics.jsonl").write_bytes(b"\xff\xfe{\"step\": 1, \"loss\": 2.0}\n\x80\x81\x82\n")
    (root / "hf-bad").mkdir()
    (root / "hf-bad" / "config.json").write_text("{not json")
    (root / "cwd").mkdir()
    (root / "inf.toml").write_text("[optimizer]\nlr = inf\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    with read_only_folder(root / "ro") as ro:
        yield World(root, char_data, prev, ckpt, corrupt, root / "afile.txt", root / "empty", root / "garbled",
                    root / "hf-bad", ro, root / "inf.toml",
                    busy.getsockname()[1])
    busy.close()


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root: path -> sha256 of the content ('dir' for folders)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            found[os.path.relpath(os.path.join(folder, d), root)] = "dir"
        for f in files:
            path = os.path.join(folder, f)
            found[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


CASES = [
    # -- train: config values
    ("lr-inf", lambda w: w.train("--optimizer.lr=inf"), "optimizer.lr must be a finite number"),
    ("lr-nan", lambda w: w.train("--optimizer.lr=nan"), "optimizer.lr must be a finite number"),
    ("grad-clip-inf", lambda w: w.train("--training.grad_clip=inf"), "training.grad_clip must be a finite number"),
    ("timeout-inf", lambda w: w.train("--resilience.collective_timeout_s=inf"), "collective_timeout_s must be a finite"),
    ("timeout-huge", lambda w: w.train("--resilience.collective_timeout_s=1e300"), "collective_timeout_s must be at most"),
    ("grace-inf", lambda w: w.train("--resilience.preempt_grace_s=inf"), "preempt_grace_s must be a finite"),
    ("temperature-nan", lambda w: w.train("--sample.temperature=nan"), "sample.temperature must be a finite"),
    ("toml-inf", lambda w: w.train("--config", str(w.inf_toml)), "optimizer.lr must be a finite"),
    ("config-not-utf8", lambda w: w.train("--config", str(w.garbled / "metrics.jsonl")), "not valid TOML"),
    # -- train: run names and folders
    ("name-dotdot", lambda w: w.train("--run.name=.."), r"run.name must be a single folder name .* '\.\.'"),
    ("name-dot", lambda w: w.train("--run.name=."), r"run.name must be a single folder name .* '\.'"),
    ("name-path", lambda w: w.train("--run.name=a/b"), "run.name must be a single folder name"),
    ("name-long", lambda w: w.train("--run.name=" + "n" * 300), "run.name is 300 characters long; at most 100"),
    ("name-control", lambda w: w.train("--run.name=a\tb"), "run.name must not contain control characters"),
    ("out-dir-file", lambda w: w.train(f"--run.out_dir={w.afile}"), "run.out_dir: .*afile.txt is a file"),
    ("out-dir-read-only", lambda w: w.train(f"--run.out_dir={w.ro}/runs"), "run.out_dir: .*ro is on a read-only"),
    ("checkpoints-is-file", lambda w: w.train(f"--run.out_dir={w.root}", "--run.name=afile.txt"), "is a file"),
    ("port-busy", lambda w: w.train(f"--metrics.prometheus_port={w.port}"), "cannot serve metrics on 127.0.0.1"),
    ("port-range", lambda w: w.train("--metrics.prometheus_port=70000"), "prometheus_port must be 0"),
    ("nproc-cores", lambda w: w.train("--nproc", "1000"), "--nproc 1000 is more than this machine"),
    ("nproc-negative", lambda w: w.train("--nproc", "-2"), "--nproc must be >= 0"),
    # -- train: checkpoints to resume from
    ("resume-file", lambda w: w.train(f"--checkpoint.resume={w.afile}"), "is not a usable paratrain checkpoint: not a"),
    ("resume-missing", lambda w: w.train(f"--checkpoint.resume={w.root}/nowhere"), "no such folder"),
    ("resume-empty", lambda w: w.train(f"--checkpoint.resume={w.empty}"), "no COMPLETE marker"),
    ("resume-corrupt", lambda w: w.train(f"--checkpoint.resume={w.corrupt}"), "checksum mismatch in __0_0.distcp"),
    ("resume-other-model", lambda w: w.train(f"--checkpoint.resume={w.ckpt}", "--model.dim=128"),
     r"cannot resume from .*step-3: it holds another model: dim 64 \(this run: 128\)"),
    ("resume-other-model-nproc2", lambda w: w.train("--nproc", "2", f"--checkpoint.resume={w.ckpt}",
                                                    "--model.n_layers=3"), "it holds another model: n_layers 2"),
    ("resume-auto-other-model", lambda w: w.train("--checkpoint.resume=auto", "--model.ffn_hidden=96"),
     "it holds another model: ffn_hidden"),
    # -- train: data and imports
    ("data-source-missing", lambda w: w.train(f"--data.source={w.root}/nothing.txt", f"--data.dir={w.root}/newdata"),
     "not found"),
    ("data-dir-file", lambda w: w.train(f"--data.dir={w.afile}"), "afile.txt"),
    ("import-not-json", lambda w: w.train(f"--model.init_from=hf:{w.hf_bad}"), "config.json"),
    ("import-no-config", lambda w: w.train(f"--model.init_from=hf:{w.empty}"), "config.json"),
    # -- prepare
    ("prepare-missing", lambda w: ["prepare", "--input", f"{w.root}/nothing.txt", "--out", f"{w.root}/d"], "not found"),
    ("prepare-out-file", lambda w: ["prepare", "--input", str(w.afile), "--out", str(w.afile)], "not a folder"),
    ("prepare-out-read-only", lambda w: ["prepare", "--input", str(w.afile), "--out", f"{w.ro}/d"], "ead-only"),
    ("prepare-val-nan", lambda w: ["prepare", "--input", str(w.afile), "--out", f"{w.root}/d", "--val-fraction", "nan"],
     "must be a finite number"),
    ("prepare-not-utf8", lambda w: ["prepare", "--input", str(w.garbled / "metrics.jsonl"), "--out", f"{w.root}/d"],
     "not valid UTF-8"),
    # -- checkpoint verify
    ("verify-missing", lambda w: ["checkpoint", "verify", f"{w.root}/nowhere"], "no such folder"),
    ("verify-file", lambda w: ["checkpoint", "verify", str(w.afile)], "is a file, not a checkpoint folder"),
    ("verify-empty", lambda w: ["checkpoint", "verify", str(w.empty)], "holds no paratrain checkpoint"),
    ("verify-no-path", lambda w: ["checkpoint", "verify"], "the following arguments are required"),
    ("checkpoint-action", lambda w: ["checkpoint", "repair", str(w.ckpt)], "invalid choice: 'repair'"),
    # -- generate
    ("generate-corrupt", lambda w: ["generate", "--checkpoint", str(w.corrupt)], "checksum mismatch in __0_0.distcp"),
    ("generate-temperature-nan", lambda w: ["generate", "--checkpoint", str(w.prev), "--temperature", "nan"],
     "--temperature: must be a finite number, got nan"),
    ("generate-temperature-inf", lambda w: ["generate", "--checkpoint", str(w.prev), "--temperature", "inf"],
     "must be a finite number, got inf"),
    ("generate-temperature-negative", lambda w: ["generate", "--checkpoint", str(w.prev), "--temperature", "-1"],
     "--temperature must be >= 0"),
    ("generate-file", lambda w: ["generate", "--checkpoint", str(w.afile)], "not a paratrain checkpoint"),
    ("generate-bad-int", lambda w: ["generate", "--checkpoint", str(w.prev), "--max-new-tokens", "ten"],
     "invalid int value: 'ten'"),
    # -- export / import
    ("export-corrupt", lambda w: ["export", str(w.corrupt), "--format", "hf", "--out", f"{w.root}/x"],
     "checksum mismatch"),
    ("export-out-read-only", lambda w: ["export", str(w.prev), "--format", "hf", "--out", f"{w.ro}/x"], "read-only"),
    ("export-out-not-empty", lambda w: ["export", str(w.prev), "--format", "hf", "--out", str(w.prev)],
     "would delete the checkpoint it reads"),  # not "pass --overwrite": that would delete the checkpoint
    ("export-out-not-empty-other", lambda w: ["export", str(w.prev), "--format", "hf", "--out", str(w.empty.parent / "garbled")],
     "exists and is not empty"),
    ("export-format", lambda w: ["export", str(w.prev), "--format", "gguf", "--out", f"{w.root}/x"],
     "invalid choice: 'gguf'"),
    ("export-shard-size", lambda w: ["export", str(w.prev), "--format", "hf", "--out", f"{w.root}/x",
                                     "--max-shard-size", "0"], "--max-shard-size must be positive"),
    # -- estimate
    ("estimate-preset", lambda w: ["estimate", "--model", "llama9"], "unknown model preset 'llama9'"),
    ("estimate-overhead-inf", lambda w: ["estimate", "--model", "llama3-8b", "--gpu", "H100", "--overhead-gib", "inf"],
     "must be a finite number"),
    ("estimate-memory", lambda w: ["estimate", "--model", "llama3-8b", "--gpu-memory", "nanGiB"], "cannot read memory"),
    ("estimate-not-toml", lambda w: ["estimate", "--model", str(w.garbled / "metrics.jsonl")], "not valid TOML"),
    # -- plan
    ("plan-gpus", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "0"], "--gpus and --gpus-per-node must be >= 1"),
    ("plan-headroom", lambda w: ["plan", "--gpus", "8", "--headroom", "nan", "--no-write"], "must be a finite number"),
    ("plan-nodes", lambda w: ["plan", "--gpus", "8", "--gpus-per-node", "3", "--no-write"], "not divisible"),
    ("plan-calibrate-nproc", lambda w: ["plan", "--calibrate", "--nproc", "5000"], "--nproc 5000 is more than"),
    ("plan-calibrate-seconds", lambda w: ["plan", "--calibrate", "--nproc", "1", "--calibrate-seconds", "0"],
     r"--calibrate-seconds must be in \(0, 60\]"),
    ("train-overwrite-not-bool", lambda w: w.train("--run.overwrite=maybe"), "run.overwrite: expected true or false"),
    ("plan-compression", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8", "--grad-compression", "zip",
                                    "--no-write"], "--grad-compression 'zip' is not one of none, bf16"),
    ("plan-powersgd-rank", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8", "--powersgd-rank", "0",
                                      "--no-write"], "--powersgd-rank must be >= 1"),
    ("plan-gpu-groups", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8xH100,xA100", "--no-write"],
     "each group is COUNTxGPU"),
    ("plan-gpu-group-unknown", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8xB999", "--no-write"],
     "unknown GPU 'B999'"),
    ("plan-cluster-missing", lambda w: ["plan", "--model", "llama3-8b", "--cluster", f"{w.root}/none.toml",
                                        "--no-write"], "no such file"),
    ("plan-gpus-and-cluster", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8", "--cluster", str(w.afile),
                                         "--no-write"], "give --gpus or --cluster, not both"),
    ("estimate-compression-fsdp", lambda w: ["estimate", "--model", "llama3-8b", "--dp-shard", "8",
                                             "--grad-compression", "sign_ef"], "only bf16 applies"),
    # -- profile
    ("profile-steps", lambda w: ["profile", "--steps", "0"], "--steps must be >= 1"),
    ("profile-steps-text", lambda w: ["profile", "--steps", "two"], "--steps must be an integer, got 'two'"),
    ("profile-compression-fsdp", lambda w: ["profile", "--nproc", "2", "--parallel.dp_mode=fsdp",
                                            "--parallel.grad_compression=sign_ef"], "only bf16 applies"),
    ("train-sign-ef-warmup", lambda w: ["train", "--parallel.sign_ef_warmup_steps=-1"],
     "parallel.sign_ef_warmup_steps must be >= 0"),
    # -- report
    ("report-not-utf8", lambda w: ["report", str(w.garbled)], "no training steps logged .*not UTF-8"),
    ("report-file", lambda w: ["report", str(w.afile)], "no such run folder"),
    ("report-out-read-only", lambda w: ["report", str(w.prev), "--out", f"{w.ro}/report"], "Read-only file system"),
    ("report-no-run", lambda w: ["report"], "the following arguments are required"),
    # -- doctor
    ("doctor-nproc", lambda w: ["doctor", "--nproc", "100000"], "--nproc 100000 is more than"),
    ("doctor-nproc-text", lambda w: ["doctor", "--nproc", "two"], "invalid int value: 'two'"),
    ("doctor-checkpoint-dir-file", lambda w: ["doctor", "--checkpoint-dir", str(w.afile)], "is a file, not a folder"),
    ("doctor-hang-none", lambda w: ["doctor", "--hang", str(w.prev)], "no hang records"),
    ("doctor-hang-missing", lambda w: ["doctor", "--hang", f"{w.root}/nowhere"], "no such run folder"),
    # -- troubleshooting: replay, dry run, numerics watch
    ("replay-missing", lambda w: ["replay", f"{w.root}/nowhere", "step-2"], "no such run folder"),
    ("replay-not-a-run", lambda w: ["replay", str(w.empty), "step-1"], "no config.toml"),
    ("replay-step-text", lambda w: ["replay", str(w.prev), "step-two"], "'step-two' is not a step"),
    ("replay-step-beyond", lambda w: ["replay", str(w.prev), "step-99"], "trains 3 steps: there is no step 99"),
    ("replay-nproc", lambda w: ["replay", str(w.prev), "step-2", "--nproc", "0"], "--nproc must be >= 1"),
    ("train-world-without-dry-run", lambda w: w.train("--world", "8"), "--world is the world size of --dry-run"),
    ("train-dry-run-world", lambda w: ["train", "--dry-run", "--world", "100000"], "--world must be between 1 and"),
    ("train-dry-run-layout", lambda w: ["train", "--dry-run", "--world", "3", "--parallel.tp=2"],
     r"parallel.tp \(2\) x parallel.pp \(1\) does not divide the world size 3"),
    ("train-numerics-every", lambda w: w.train("--metrics.numerics_every=-1"), "metrics.numerics_every must be >= 0"),
    # -- memory tiers, low-memory and 1-bit optimizers, LoRA
    ("estimate-activation-offload", lambda w: ["estimate", "--model", "llama3-8b", "--activation-offload", "some"],
     "--activation-offload 'some' is not one of none, all, every_k"),
    ("estimate-loss-chunks", lambda w: ["estimate", "--model", "llama3-8b", "--loss-chunks", "-1"],
     "--loss-chunks must be >= 0"),
    ("estimate-offload-every-k", lambda w: ["estimate", "--model", "llama3-8b", "--offload-every-k", "0"],
     "--offload-every-k must be >= 1"),
    ("estimate-host-memory", lambda w: ["estimate", "--model", "llama3-8b", "--host-memory", "lots"],
     "cannot read memory size 'lots'"),
    ("estimate-cpu-offload-ddp", lambda w: ["estimate", "--model", "llama3-8b", "--dp-mode", "ddp", "--dp-replicate",
                                            "2", "--cpu-offload"], "memory.cpu_offload needs FSDP"),
    ("estimate-8bit-zero1", lambda w: ["estimate", "--model", "llama3-8b", "--dp-mode", "zero1", "--dp-replicate", "2",
                                       "--optimizer", "adamw8bit"], "ZeRO-1's fp32 partitions cannot hold"),
    ("plan-host-memory", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100",
                                    "--host-memory=-5GiB", "--no-write"], "cannot read memory size '-5GiB'"),
    ("plan-explain-tier", lambda w: ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100", "--no-write",
                                     "--explain", "fsdp,loss=0"], "loss must be an integer >= 1"),
    ("train-loss-chunks", lambda w: w.train("--memory.loss_chunks=-1"), "memory.loss_chunks must be >= 0"),
    ("train-activation-offload", lambda w: w.train("--memory.activation_offload=some"),
     "memory.activation_offload: 'some' is not one of none, all, every_k"),
    ("train-cpu-offload-ddp", lambda w: w.train("--nproc", "2", "--parallel.dp_mode=ddp", "--memory.cpu_offload=true"),
     "memory.cpu_offload needs FSDP"),
    ("train-onebit-one-process", lambda w: w.train("--optimizer.name=onebit_adam"),
     "optimizer.name=onebit_adam averages momenta over data-parallel ranks"),
    ("train-lora-rank", lambda w: w.train("--lora.rank=-2"), "lora.rank must be from 0 \\(off\\) to 65536, got -2"),
    # -- segment checkpointing
    ("train-segment-blocks", lambda w: w.train("--activation_checkpoint.segment_blocks=-1"),
     "activation_checkpoint.segment_blocks must be >= 0"),
    ("train-segments-offload", lambda w: w.train("--activation_checkpoint.mode=segments",
                                                 "--memory.activation_offload=all"),
     "memory.activation_offload=all does not work with activation_checkpoint.mode=segments"),
    ("estimate-segment-blocks", lambda w: ["estimate", "--model", "llama3-8b", "--segment-blocks", "-1"],
     "--segment-blocks must be >= 0"),
    ("estimate-segments-offload", lambda w: ["estimate", "--model", "llama3-8b", "--checkpointing", "segments",
                                             "--activation-offload", "all"],
     "memory.activation_offload=all does not work with activation_checkpoint.mode=segments"),
    # -- verify (numerics)
    ("verify-layout", lambda w: ["verify", "--layouts", "fsdp3"], "unknown layout 'fsdp3'"),
    ("verify-steps", lambda w: ["verify", "--steps", "0"], "--steps must be >= 1"),
]


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def test_enough_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    commands = {c[1](World(*[Path("/x")] * 11, 1))[0] for c in CASES}
    assert commands >= {"train", "profile", "prepare", "generate", "checkpoint", "export", "estimate", "plan", "report",
                        "doctor", "verify", "replay"}


@pytest.mark.parametrize("name, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(world, capsys, monkeypatch, name, argv, pattern):
    args = argv(world)
    monkeypatch.chdir(world.root / "cwd")
    before = snapshot(world.root)
    rc = cli.main(args)
    out, err = capsys.readouterr()
    assert_refused(rc, out, err, pattern)
    assert snapshot(world.root) == before, "files changed"


def assert_refused(rc: int, out: str, err: str, pattern: str) -> None:
    """Exit code 2, no traceback, exactly one line on stderr: `error: ...` matching pattern."""
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(pattern, lines[0]), lines[0]
