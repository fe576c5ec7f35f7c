"""Every bad input ends as exit code 2 and exactly one `error:` line on stderr: no traceback, nothing written."""

from __future__ import annotations

import os
import re
import time

import pytest

from conftest import fast_overrides
from paratrain import cli


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    # A test process must never look like a launched rank (that changes how `train` behaves).
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def run_cli(capsys, argv, code=2):
    """main(argv) must return `code` and print one `error:` line on stderr; returns that line."""
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == code, (rc, out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert err.endswith("\n")
    return lines[0]


def snapshot(folder):
    return sorted(os.listdir(folder))


# ---------------------------------------------------------------------------- prepare

@pytest.mark.parametrize("name, content, match", [
    (None, None, "input not found"),
    ("empty.txt", b"", "is empty"),
    ("blank.txt", b"  \n\n\t\n", "is empty"),
    ("latin1.txt", "caf\u00e9 cr\u00e8me\n".encode("latin-1"), "not valid UTF-8.*0xe9"),
    ("docs.jsonl", b'{"text": "a fine line"}\n{"body": "no text here"}\n', "line 2.*\"text\""),
    ("nontext.jsonl", b'{"text": 5}\n', "line 1.*\"text\""),
    ("broken.jsonl", b'{"text": "ok"}\n{not json\n', "line 2.*not valid JSON"),
])
def test_prepare_bad_input(tmp_path, capsys, name, content, match):
    src = tmp_path / (name or "missing.txt")
    if content is not None:
        src.write_bytes(content)
    before = snapshot(tmp_path)
    line = run_cli(capsys, ["prepare", "--input", str(src), "--out", str(tmp_path / "out")])
    assert re.search(match, line), line
    assert snapshot(tmp_path) == before  # no output folder, no temporary folder left behind


def test_prepare_vocab_too_large_for_uint16(tmp_path, capsys):
    import tokenizers as hf

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    tok = hf.Tokenizer(hf.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("w1 w2 w3 w69999\n" * 50)
    before = snapshot(tmp_path)
    line = run_cli(capsys, ["prepare", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out"),
                            "--tokenizer", str(tmp_path / "big.json"), "--dtype", "uint16"])
    assert "70001" in line and "uint16" in line and "uint32" in line
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------- train: config mistakes

@pytest.mark.parametrize("override, match", [
    ("--model.preset=llama9", "unknown model preset 'llama9'"),
    ("--training.stepz=3", "unknown config key 'training.stepz'.*'training.steps'"),
    ("--trainig.steps=3", "unknown config section 'trainig'.*'training'"),
    ("--training.steps=abc", "training.steps: expected int, got 'abc'"),
    ("--training.steps=0", "training.steps must be positive"),
    ("--optimizer.lr=-1", "optimizer.lr must be positive"),
    ("--optimizer.name=adamx", "optimizer.name: 'adamx' is not one of adamw, sgd.*did you mean 'adamw'"),
    ("--training.precision=fp4", "training.precision: 'fp4' is not one of"),
    ("--float8.recipe=columnwise", "float8.recipe: 'columnwise' is not one of tensorwise, rowwise"),
    ("--training.cuda_graphs=true", "training.cuda_graphs captures the compiled blocks: it needs training.compile"),
    ("--training.z_loss=-1e-4", r"training.z_loss must be >= 0 \(0: off\), got -0.0001"),
    ("--training.z_loss=big", "training.z_loss: expected float, got 'big'"),
    ("--training.z_loss=inf", "training.z_loss must be a finite number"),
    ("--training.zloss=1e-4", "unknown config key 'training.zloss'.*'training.z_loss'"),
    ("--training.seq_len=100000", "training.seq_len=100000 is longer than the model's max_seq_len=256"),
    ("--parallel.pp=2", r"parallel.pp \(2\) does not divide the world size 1"),
    ("--parallel.pp_schedule=1f1c", "parallel.pp_schedule: '1f1c' is not one of.*did you mean '1f1b'"),
    ("--parallel.tp=2", "does not divide the world size 1"),
    ("--moe.balancing=sometimes", "moe.balancing: 'sometimes' is not one of auto, aux_loss, aux_free, none"),
    ("--moe.bias_update_rate=0", r"moe.bias_update_rate must be a number in \(0, 1\], got 0.0"),
    ("--moe.balancing=aux_free", "moe.balancing=aux_free needs the routing bias: set model.moe_expert_bias=true"),
    ("--model.mtp_depth=-1", "model.mtp_depth must be an integer from 0 to 65536, got -1"),
    ("--model.moe_n_group=0", "model.moe_n_group must be an integer from 1 to 65536, got 0"),
])
def test_train_bad_config(char_data, tmp_path, capsys, override, match):
    argv = ["train", *(f"--{o}" for o in fast_overrides(char_data, tmp_path / "runs", "bad")), override]
    line = run_cli(capsys, argv)
    assert re.search(match, line), line
    assert not (tmp_path / "runs").exists()  # no run folder, no config.toml, no metrics


def test_train_bad_layout_fails_before_launch(char_data, tmp_path, capsys, monkeypatch):
    import paratrain.api as api

    def no_launch(*a, **k):
        raise AssertionError("processes were launched for an invalid layout")

    monkeypatch.setattr(api, "launch", no_launch)
    overrides = [f"--{o}" for o in fast_overrides(char_data, tmp_path / "runs", "bad")]
    t0 = time.perf_counter()
    line = run_cli(capsys, ["train", "--nproc", "3", "--parallel.tp=2", *overrides])
    assert "parallel.tp (2)" in line and "world size 3" in line
    line = run_cli(capsys, ["train", "--nproc", "2", "--parallel.pp=2", "--model.n_layers=1", *overrides])
    assert "but the model has only 1 blocks" in line
    assert time.perf_counter() - t0 < 10
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_flag_names_the_one_meant(capsys):
    assert run_cli(capsys, ["train", "--nprocs", "2"]) == "error: unexpected argument '--nprocs' (did you mean '--nproc'?)"
    assert "config overrides look like --section.key=value" in run_cli(capsys, ["train", "--steps=4"])


@pytest.mark.parametrize("extra", [["--model.preset=llama9"], ["--training.seq_len=100000"],
                                   ["--nproc", "3", "--parallel.tp=2"]])
def test_train_config_error_writes_no_data(tmp_path, capsys, extra):
    fresh = tmp_path / "fresh-data"
    overrides = [f"--{o}" for o in fast_overrides(fresh, tmp_path / "runs", "bad")]
    run_cli(capsys, ["train", *overrides, *extra])
    assert snapshot(tmp_path) == []


# ---------------------------------------------------------------------------- generate

def test_generate_from_a_dataset_folder_says_so(char_data, capsys):
    line = run_cli(capsys, ["generate", "--checkpoint", str(char_data)])
    assert line == (f"error: {char_data} is a prepared dataset folder, not a checkpoint: give a run folder "
                    "(runs/NAME) or one of its checkpoints (runs/NAME/checkpoints/step-N)")


def test_generate_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = run_cli(capsys, ["generate", "--checkpoint", str(tmp_path / "empty")])
    assert "not a paratrain checkpoint" in line
    line = run_cli(capsys, ["generate", "--checkpoint", str(tmp_path / "nowhere")])
    assert "checkpoint not found" in line
    assert snapshot(tmp_path) == ["empty"] and snapshot(tmp_path / "empty") == []


def test_generate_prompt_outside_char_vocab(trained_run, capsys):
    line = run_cli(capsys, ["generate", "--checkpoint", str(trained_run), "--prompt", "ROMEO: 5\u20ac",
                            "--max-new-tokens", "5"])
    assert "not in the char-level vocabulary" in line and "'\u20ac'" in line


def test_unknown_command(capsys):
    line = run_cli(capsys, ["trian"])
    assert "did you mean 'train'" in line


# ---------------------------------------------------------------------------- the error path itself

class _NotAnException(BaseException):
    """Like DCP's CheckpointException: a BaseException that `except Exception` misses."""


def test_translated_replaces_lets_bugs_pass_and_never_touches_interrupts():
    import errno

    from paratrain.errors import UserError, environment_error, translated

    cleaned = []
    full = _NotAnException("save failed")
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/run/ckpt")
    with pytest.raises(UserError, match=r"^No space left on device: /run/ckpt$"):
        with translated(environment_error, cleanup=lambda: cleaned.append("full")):
            raise full
    bug = _NotAnException("a bug")
    with pytest.raises(_NotAnException) as caught:  # no rule for it: it goes on as it is, its traceback kept
        with translated(environment_error):
            raise bug
    assert caught.value is bug
    for interrupt in (KeyboardInterrupt(), SystemExit(3)):
        with pytest.raises(type(interrupt)):
            with translated(lambda e: UserError("never"), cleanup=lambda: cleaned.append("interrupt")):
                raise interrupt
    assert cleaned == ["full", "interrupt", "interrupt"]
    already = UserError("a line")
    with pytest.raises(UserError) as caught:
        with translated(environment_error):
            raise already
    assert caught.value is already


def test_a_model_this_machine_cannot_hold_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    """Before the data is prepared and anything allocated: the estimate against this machine's memory, one line
    with both numbers, exit 2, and nothing written (llama3-405b: no machine's RAM holds a CPU run of it)."""
    monkeypatch.chdir(tmp_path)
    line = run_cli(capsys, ["train", "--model.preset=llama3-405b", "--training.device=cpu", "--training.steps=2"])
    assert re.search(r"this run needs about [\d.]+ GiB at its peak \(memory estimate\) and this machine has "
                     r"[\d.]+ GiB of host memory available", line), line
    assert "--force" in line
    assert snapshot(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["scaling", "--nproc", "1,2"], "needs one of --weak"),
    (["scaling", "--weak", "--strong", "--nproc", "1,2"], "needs one of --weak"),
    (["scaling", "--weak"], "needs --nproc N1,N2,... (with --layout) or --layouts"),
    (["scaling", "--weak", "--nproc", "1,2", "--layouts", "ddp2"], "needs --nproc N1,N2,... (with --layout) or"),
    (["scaling", "--weak", "--nproc", "one,2"], "--nproc must be a comma-separated list of world sizes"),
    (["scaling", "--weak", "--layouts", "ddp9"], "unknown layout 'ddp9'"),
    (["scaling", "--weak", "--nproc", "1,2", "--steps", "0"], "--steps must be >= 1"),
    (["scaling", "--weak", "--nproc", "1,2", "--training.global_batch=8"], "leave training.global_batch unset"),
    (["scaling", "--strong", "--nproc", "1,3", "--global-batch", "4", "--training.device=cpu"],
     "the global batch 4 does not split over the 3 data-parallel ranks"),
])
def test_scaling_bad_input_is_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert message in run_cli(capsys, argv)
    assert snapshot(tmp_path) == []


def test_scaling_refuses_a_folder_with_earlier_output(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "scaling.md").write_text("earlier")
    line = run_cli(capsys, ["scaling", "--weak", "--nproc", "1,2", "--out", str(tmp_path / "out")])
    assert "already holds output: give --overwrite" in line and snapshot(tmp_path / "out") == ["scaling.md"]
