"""Tokenizer identity by content, and files from elsewhere (issue 35): a tokenizer.json is the same tokenizer whatever
a dataset recorded it as (bpe or a file) and wherever the file lies; a tokenizer.json that cannot encode the corpus is
one line; a resume onto an empty data folder with another tokenizer is refused before anything is prepared; a BPE
that runs out of merges says the vocabulary it reached."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers as hf

from conftest import FAST, fast_config
from paratrain.commands import prepare as prepare_command
from paratrain.data import DEFAULT_CORPUS, TokenData, ensure_prepared, prepare_dataset, read_meta
from paratrain.errors import ConfigError, UserError

TEXT = DEFAULT_CORPUS.read_text()[:20_000]


def write_docs(path: Path, text: str, docs: int = 20) -> Path:
    size = len(text) // docs
    path.write_text("".join(json.dumps({"text": text[i * size:(i + 1) * size]}) + "\n" for i in range(docs)))
    return path


def paratrain(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "paratrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def one_error_line(done: subprocess.CompletedProcess, message: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory):
    """A dataset prepared with a freshly trained BPE (recorded as "bpe"), and a copy of its tokenizer.json elsewhere
    under another name."""
    root = tmp_path_factory.mktemp("identity")
    src = write_docs(root / "mycorpus.jsonl", TEXT)
    prepare_dataset(src, root / "data" / "mycorpus", tokenizer="bpe", vocab_size=300)
    (root / "elsewhere").mkdir()
    copy = shutil.copyfile(root / "data" / "mycorpus" / "tokenizer.json", root / "elsewhere" / "shared-tok.json")
    return SimpleNamespace(root=root, src=src, dir=root / "data" / "mycorpus", copy=Path(copy))


# ---------------------------------------------------------------------------- 1. identity by content

def test_mixture_and_options_compare_tokenizers_by_content(bpe_dataset, tmp_path):
    """A dataset prepared from the copied file (recorded as "tokenizer.json") mixes with the "bpe" one, also when a
    meta.json records no hash or an older dataset's file hash; --tokenizer=COPY agrees with the "bpe" dataset; a
    tokenizer with other ids is still refused."""
    code = tmp_path / "code"
    prepare_dataset(write_docs(tmp_path / "code.jsonl", TEXT[::-1]), code, tokenizer=str(bpe_dataset.copy))
    assert read_meta(code)["tokenizer"] == "tokenizer.json" and read_meta(bpe_dataset.dir)["tokenizer"] == "bpe"
    sources = [{"dir": str(bpe_dataset.dir), "weight": 1}, {"dir": str(code), "weight": 1}]
    assert TokenData(sources, "train", 16).mixture.names == ["mycorpus", "code"]
    meta = json.loads((code / "meta.json").read_text())
    for recorded in (None, "0" * 64):  # an older dataset: no hash, or a hash of its files' bytes
        meta["tokenizer_sha256"] = recorded
        (code / "meta.json").write_text(json.dumps(meta))
        TokenData(sources, "train", 16)
    # an option naming the same content (another path, another kind recorded) is no contradiction
    assert ensure_prepared(None, bpe_dataset.dir, tokenizer="tokenizer.json", tokenizer_path=bpe_dataset.copy)
    other = tmp_path / "other"
    prepare_dataset(bpe_dataset.src, other, tokenizer="bpe", vocab_size=290)
    with pytest.raises(UserError, match="uses a different tokenizer") as e:
        TokenData([sources[0], {"dir": str(other), "weight": 1}], "train", 16)
    assert "\n" not in str(e.value)


def test_resume_compares_tokenizers_by_content(bpe_dataset, tmp_path):
    """A checkpoint trained on the "bpe" dataset resumes on a dataset prepared from the copied file."""
    from paratrain.api import train_rank

    code = tmp_path / "code"
    prepare_dataset(write_docs(tmp_path / "code.jsonl", TEXT.upper()), code, tokenizer=str(bpe_dataset.copy))
    first = train_rank(fast_config(bpe_dataset.dir, tmp_path, "bpe", "training.steps=1", "training.eval_every=0"))
    result = train_rank(fast_config(code, tmp_path, "next", "training.steps=2", "training.eval_every=0",
                                    f"checkpoint.resume={first.run_dir / 'checkpoints' / 'step-1'}"))
    assert (result.run_dir / "checkpoints" / "step-2").is_dir()


def test_imported_model_accepts_a_copy_of_its_tokenizer(bpe_dataset, tmp_path):
    """data.tokenizer beside model.init_from may name a copy of the folder's tokenizer.json (same content); the data
    folder is prepared with it and passes the imported model's check. Another tokenizer is still a conflict."""
    from paratrain import hf as hf_package
    from paratrain.spec import DataSource, prepare_data

    folder = tmp_path / "hf-model"  # only its tokenizer is read on this path
    folder.mkdir()
    shutil.copyfile(bpe_dataset.copy, folder / "tokenizer.json")
    model = SimpleNamespace(hf_folder=folder, model=SimpleNamespace(init_from=f"hf:{folder}"))
    cfg = fast_config(tmp_path / "data", tmp_path, "run", f"data.tokenizer={bpe_dataset.copy}",
                      f"data.source={bpe_dataset.src}")
    data = DataSource.read(cfg.data, model)
    assert data.model_tokenizer == folder / "tokenizer.json"
    assert prepare_data(data)["tokenizer"] == "tokenizer.json"
    other = tmp_path / "other.json"
    hf.Tokenizer(hf.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(other))
    with pytest.raises(ConfigError, match="conflicts with model.init_from"):
        hf_package.dataset_tokenizer(folder, str(other))


# ---------------------------------------------------------------------------- 2. a tokenizer that cannot encode

def test_tokenizer_that_cannot_encode_the_corpus_is_one_line(bpe_dataset, tmp_path):
    """A WordLevel tokenizer.json without an unknown token: one error line, exit 2, nothing written (in this process
    and through worker processes)."""
    tok = hf.Tokenizer(hf.models.WordLevel({"First": 0, "Citizen": 1, "<|endoftext|>": 2}))
    tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    shutil.copyfile(bpe_dataset.src, tmp_path / "corpus.jsonl")
    (tmp_path / "data").mkdir()
    before = snapshot(tmp_path)
    done = paratrain(tmp_path, "prepare", "--input", "corpus.jsonl", "--out", "data/words", "--tokenizer", "words.json")
    one_error_line(done, "cannot encode this text: WordLevel error: Missing [UNK] token")
    with pytest.raises(UserError, match="cannot encode"):
        prepare_dataset(tmp_path / "corpus.jsonl", tmp_path / "data" / "words", tokenizer=str(tmp_path / "words.json"),
                        workers=1)
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------- 3. resume onto an empty data folder

@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    """A checkpoint of a tiny model trained on a char dataset of TEXT."""
    from paratrain.api import train_rank

    root = tmp_path_factory.mktemp("resume")
    (root / "corpus.txt").write_text(TEXT)
    result = train_rank(fast_config(root / "data" / "char", root / "runs", "first", f"data.source={root / 'corpus.txt'}",
                                    "training.steps=2", "training.eval_every=0"))
    return SimpleNamespace(root=root, ckpt=result.run_dir / "checkpoints" / "step-2")


def test_resume_with_another_tokenizer_is_refused_before_preparing(char_checkpoint):
    """The refusal is the only line, and the data folder, the run folder and everything else stay as they were."""
    root = char_checkpoint.root
    before = snapshot(root)
    done = paratrain(root, "train", *[f"--{o}" for o in FAST], "--data.dir=data/new", "--data.source=corpus.txt",
                     "--data.tokenizer=byte", f"--checkpoint.resume={char_checkpoint.ckpt}", "--run.out_dir=runs",
                     "--run.name=next")
    one_error_line(done, "it was trained with another tokenizer (char, vocab")
    assert "nothing was prepared" in done.stderr and snapshot(root) == before


def test_resume_onto_an_empty_folder(char_checkpoint, tmp_path):
    """Another vocabulary (BPE) is refused with nothing written; the same tokenizer (char of the same corpus)
    prepares the folder and continues."""
    from paratrain.api import train_rank

    root, resume = char_checkpoint.root, f"checkpoint.resume={char_checkpoint.ckpt}"
    with pytest.raises(UserError, match="another tokenizer"):
        train_rank(fast_config(tmp_path / "bpe", tmp_path, "bpe", f"data.source={root / 'corpus.txt'}",
                               "data.tokenizer=bpe", "data.vocab_size=300", resume))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    result = train_rank(fast_config(tmp_path / "char", tmp_path, "same", f"data.source={root / 'corpus.txt'}",
                                    resume, "training.steps=3", "training.eval_every=0"))
    assert read_meta(tmp_path / "char")["tokenizer"] == "char" and (result.run_dir / "checkpoints/step-3").is_dir()


# ---------------------------------------------------------------------------- 4. the vocabulary BPE reached

def test_bpe_says_the_vocabulary_it_reached(bpe_dataset, tmp_path, capsys):
    assert prepare_command.main(["--input", str(bpe_dataset.src), "--out", str(tmp_path / "big"), "--tokenizer", "bpe",
                                 "--vocab-size", "8000"]) == 0
    reached = read_meta(tmp_path / "big")["vocab_size"]
    assert reached < 8000
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vocabulary:")]
    assert lines == [f"vocabulary: {reached:,} ids (asked 8,000: the corpus has no more merges)"]
    assert prepare_command.main(["--input", str(bpe_dataset.src), "--out", str(tmp_path / "small"), "--tokenizer",
                                 "bpe", "--vocab-size", "300"]) == 0
    assert "vocabulary:" not in capsys.readouterr().err  # reached what was asked: nothing to say


# ---------------------------------------------------------------------------- journey: a mixture, one tokenizer.json

def test_journey_mixture_of_one_tokenizer_json(tmp_path):
    """prepare with bpe, prepare another corpus with that tokenizer.json copied elsewhere, train on the mixture."""
    write_docs(tmp_path / "mycorpus.jsonl", TEXT)
    write_docs(tmp_path / "code.jsonl", TEXT.upper())
    assert paratrain(tmp_path, "prepare", "--input", "mycorpus.jsonl", "--out", "data/mycorpus", "--tokenizer", "bpe",
                     "--vocab-size", "300").returncode == 0
    shutil.copyfile(tmp_path / "data/mycorpus/tokenizer.json", tmp_path / "tok.json")
    assert paratrain(tmp_path, "prepare", "--input", "code.jsonl", "--out", "data/code", "--tokenizer",
                     "tok.json").returncode == 0
    done = paratrain(tmp_path, "train", *[f"--{o}" for o in FAST], "--training.steps=2", "--run.name=mix",
                     '--data.sources=[{dir = "data/mycorpus", weight = 1}, {dir = "data/code", weight = 1}]')
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs/mix/metrics.jsonl").open() if '"data_tokens"' in line]
    assert set(records[-1]["data_tokens"]) == {"mycorpus", "code"}
