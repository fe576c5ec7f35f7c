"""Nothing a user made is replaced without consent, and the small things a newcomer meets first (help, fast layout
errors, empty prompts). The documented journeys are in tests/test_journeys.py; these are the edge cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paratrain.cli import main
from paratrain.errors import UserError


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_empty_prompt_starts_a_document():
    from paratrain.data.tokenizers import ByteTokenizer, CharTokenizer
    from paratrain.generate import prompt_ids

    char = CharTokenizer(list("ab\n"), eos=True)
    assert prompt_ids(char, "") == [char.eos_id] and prompt_ids(char, "ab") == [0, 1]
    byte = ByteTokenizer(eos=True)
    assert prompt_ids(byte, "") == [256]
    with pytest.raises(UserError, match="neither a BOS nor an EOS"):
        prompt_ids(ByteTokenizer(eos=False), "")


def test_train_help_lists_every_key(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: paratrain train") and "--parallel.cp=1" in out and "--run.overwrite=false" in out
    assert "(none | full | every_k | selective | segments)" in out


def test_layout_error_answers_before_torch_loads():
    code = ("import sys; from paratrain.cli import main; rc = main(['train', '--nproc', '4', '--parallel.tp=3']); "
            "assert rc == 2, rc; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "error: parallel.tp (3) x parallel.pp (1) does not divide the world size 4"


def test_overwrite_never_deletes_the_runs_own_inputs(char_data, tmp_path, capsys):
    import shutil

    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(char_data, run / "data")
    before = files(run)
    argv = ["train", *(f"--{o}" for o in [f"data.dir={run / 'data'}", f"run.out_dir={tmp_path / 'runs'}", "run.name=r",
                                           "run.overwrite=true", "model.preset=tiny", "training.device=cpu"])]
    assert main(argv) == 2
    assert "holds data.dir" in one_error_line(capsys) and files(run) == before


def test_overwrite_says_what_it_deleted(tmp_path):
    """run.overwrite=true names the folder and sums up what it held, however many checkpoints (issue 35)."""
    from paratrain.preflight import RunFolder, start_over

    run = tmp_path / "r"
    for step in range(10, 1010, 10):
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")
    said = []
    start_over(RunFolder(run, overwrite=True), said.append)
    assert said == [f"run.overwrite: deleted {run} (checkpoints step-10, step-20, step-30, ..., step-1000 (100 in all); "
                    "config.toml, metrics.jsonl)"]
    assert run.is_dir() and not any(run.iterdir())
    start_over(RunFolder(run, overwrite=True), said.append)  # an empty folder: nothing deleted, nothing said
    assert len(said) == 1


def test_a_damaged_dataset_is_named_not_replaced(char_data, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    shard = sorted(data.glob("train-*.bin"))[0]
    os.truncate(shard, shard.stat().st_size - 2)
    before = files(data)
    argv = ["train", f"--data.dir={data}", f"--run.out_dir={tmp_path / 'runs'}", "--model.preset=tiny",
            "--training.device=cpu", "--data.source=tinyshakespeare"]
    assert main(argv) == 2
    assert "missing or has the wrong size" in one_error_line(capsys) and files(data) == before
    assert not (tmp_path / "runs").exists()


def test_plan_keeps_an_earlier_plan_unless_told(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100", "--seq", "4096",
            "--global-batch-tokens", "524288", "--top", "1"]
    assert main(plan) == 0
    (tmp_path / "plan" / "config.toml").write_text((tmp_path / "plan" / "config.toml").read_text() + "# my edit\n")
    before = files(tmp_path / "plan")
    capsys.readouterr()
    assert main(plan) == 2
    assert "--overwrite" in one_error_line(capsys) and files(tmp_path / "plan") == before
    assert main([*plan, "--overwrite"]) == 0
    assert "# my edit" not in (tmp_path / "plan" / "config.toml").read_text()


def test_a_runs_config_toml_names_its_world(trained_run):
    from paratrain.config import load_config

    saved = load_config(trained_run / "config.toml")
    assert saved.parallel.dp_shard == 1 and saved.parallel.dp_replicate == 1


def test_replace_dir_puts_the_old_folder_back_when_the_rename_fails(tmp_path, monkeypatch):
    """One replace for datasets, checkpoints and exports: a failure between its two renames restores the old folder,
    and atomic_dir removes its build folder on any failure."""
    import paratrain.files as files_mod

    final, tmp = tmp_path / "final", tmp_path / ".final.tmp"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(files_mod.os, "replace", flaky)
    with pytest.raises(OSError):
        files_mod.replace_dir(tmp, final)
    monkeypatch.setattr(files_mod.os, "replace", real)
    assert files(final) == {"old.txt": b"old"} and sorted(p.name for p in tmp_path.iterdir()) == [".final.tmp", "final"]
    with pytest.raises(KeyboardInterrupt):
        with files_mod.atomic_dir(tmp_path / ".b", final) as folder:
            (folder / "x").write_text("x")
            raise KeyboardInterrupt
    assert not (tmp_path / ".b").exists() and files(final) == {"old.txt": b"old"}
    with files_mod.atomic_dir(tmp_path / ".c", final) as folder:
        (folder / "y").write_text("y")
    assert files(final) == {"y": b"y"} and sorted(p.name for p in tmp_path.iterdir()) == [".final.tmp", "final"]
