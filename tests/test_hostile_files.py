"""Hostile files: what users hand to paratrain from elsewhere (a downloaded Hugging Face folder, a checkpoint copied
from a colleague, a corpus cut short by a failed transfer, a hand-written cluster file, a prepared dataset edited by
hand), as an attacker and as a tired user would make them.

Seven principles, each with its own cases (issue 27): (1) every field of every file is checked, with one `error:`
line naming the file and the field; (2) no number from a user makes paratrain loop, allocate or spawn without bound;
(3) loading a checkpoint runs no code from it; (4) no command destroys its own inputs; (5) a truncated or corrupt
compressed input is an error naming the file and the offset; (6) a resumed run is the same run (tokenizer identity);
(7) hints are true. Each case asserts exit code 2, exactly one `error:` line, no traceback, every file that existed
before byte-identical and nothing added (the working directory, HOME and TMPDIR lie inside the world, so nothing is
written outside it). A pickle that creates a marker file when unpickled never creates it, through every command that
reads checkpoints.
"""

from __future__ import annotations

import gzip
import json
import pickle
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import fast_overrides
from paratrain import cli

transformers = pytest.importorskip("transformers")

from test_hf import make_llama  # noqa: E402
from test_hostile import assert_refused, snapshot  # noqa: E402


# ---------------------------------------------------------------------------- making hostile files

class Marker:
    """Unpickled, it creates the marker file (any code could run in its place)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def rehash(ckpt: Path) -> None:
    """CHECKSUMS rewritten to match the folder, as whoever altered it would: checksums prove nothing about safety."""
    from paratrain.training import integrity

    integrity.write_checksums(ckpt, integrity.hash_files(ckpt, integrity.listed_files(ckpt)))


def plain_metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # our own checkpoint, made by the fixture: trusted


def evil_metadata(src: Path, dst: Path, marker: Path) -> Path:
    """A real checkpoint whose .metadata also holds a Marker (it would load fine with plain pickle)."""
    shutil.copytree(src, dst)
    md = plain_metadata(dst)
    md.planner_data = {**(md.planner_data or {}), "x": Marker(marker)}
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    rehash(dst)
    return dst


def evil_shard_entry(src: Path, dst: Path, marker: Path) -> Path:
    """A real checkpoint whose optimizer param-group entry (a pickle inside the shard) is a Marker."""
    import io

    shutil.copytree(src, dst)
    md = plain_metadata(dst)
    shard = dst / "__0_0.distcp"
    buf = io.BytesIO()
    torch.save(Marker(marker), buf)
    start = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    key = next(k for k in md.storage_data if k.fqn == "optim.param_groups.0.lr")
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(info.relative_path, start, len(buf.getvalue()), info.transform_descriptors)
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    rehash(dst)
    return dst


def edit_metadata(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    md = plain_metadata(dst)
    change(md)
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    rehash(dst)
    return dst


def edit_trainer(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    state = torch.load(dst / "trainer.pt", weights_only=True)
    change(state)
    torch.save(state, dst / "trainer.pt")
    rehash(dst)
    return dst


def edit_json(src: Path, dst: Path, name: str, change) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    result = change(data)
    (dst / name).write_text(json.dumps(data if result is None else result))
    return dst


def edit_header(src: Path, dst: Path, change) -> Path:
    """An HF folder whose model.safetensors header is changed (the data left as it is)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return dst


def first_tensor(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


@dataclass
class World:
    root: Path
    data: Path
    prev: Path
    ckpt: Path
    hf: Path
    p: dict  # name -> path of each hostile file or folder

    def train(self, *extra: str) -> list[str]:
        return ["train", *(f"--{o}" for o in fast_overrides(self.data, self.root / "runs", "prev")), *extra]

    def gen(self, folder: Path, *extra: str) -> list[str]:
        return ["generate", "--checkpoint", str(folder), "--max-new-tokens", "1", *extra]


@pytest.fixture(scope="module")
def world(char_data, trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-files")
    for d in ("cwd", "home", "tmp", "markers"):
        (root / d).mkdir()
    prev = root / "runs" / "prev"
    shutil.copytree(trained_run, prev)
    ckpt = prev / "checkpoints" / "step-3"
    hf = make_llama(root / "hf")
    p: dict[str, Path] = {}
    m = root / "markers"
    c = root / "ckpts"
    c.mkdir()
    # -- checkpoints (principle 3 and 1)
    p["evil-md"] = evil_metadata(ckpt, c / "evil-md", m / "evil-md")
    p["evil-entry"] = evil_shard_entry(ckpt, c / "evil-entry", m / "evil-entry")

    def traversal(md):
        key = next(iter(md.storage_data))
        info = md.storage_data[key]
        md.storage_data[key] = type(info)("../../../etc/hostname", info.offset, info.length, None)

    def negative_offset(md):
        key = next(iter(md.storage_data))
        info = md.storage_data[key]
        md.storage_data[key] = type(info)(info.relative_path, -8, info.length, None)

    p["md-traversal"] = edit_metadata(ckpt, c / "md-traversal", traversal)
    p["md-offset"] = edit_metadata(ckpt, c / "md-offset", negative_offset)
    p["md-not-metadata"] = shutil.copytree(ckpt, c / "md-not-metadata")
    (p["md-not-metadata"] / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": 1}))
    rehash(p["md-not-metadata"])
    import collections

    p["md-foreign-class"] = shutil.copytree(ckpt, c / "md-foreign-class")
    (p["md-foreign-class"] / ".metadata").write_bytes(pickle.dumps(collections.Counter("abc")))
    rehash(p["md-foreign-class"])
    p["md-persistent"] = shutil.copytree(ckpt, c / "md-persistent")
    (p["md-persistent"] / ".metadata").write_bytes(b"\x80\x02Pmarker\n.")
    rehash(p["md-persistent"])
    p["md-truncated"] = shutil.copytree(ckpt, c / "md-truncated")
    (p["md-truncated"] / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:100])
    rehash(p["md-truncated"])
    p["tr-step"] = edit_trainer(ckpt, c / "tr-step", lambda s: s.update(step=-5))
    p["tr-step-text"] = edit_trainer(ckpt, c / "tr-step-text", lambda s: s.update(step="three"))
    p["tr-dim"] = edit_trainer(ckpt, c / "tr-dim", lambda s: s["model_args"].update(dim="64"))
    p["tr-unknown-arg"] = edit_trainer(ckpt, c / "tr-unknown-arg", lambda s: s["model_args"].update(wings=2))
    p["tr-heads"] = edit_trainer(ckpt, c / "tr-heads", lambda s: s["model_args"].update(n_heads=0))
    p["tr-seq"] = edit_trainer(ckpt, c / "tr-seq", lambda s: s.update(seq_len=0))
    p["tr-optimizer"] = edit_trainer(ckpt, c / "tr-optimizer", lambda s: s.update(optimizer=7))
    p["tr-not-dict"] = shutil.copytree(ckpt, c / "tr-not-dict")
    torch.save([1, 2, 3], p["tr-not-dict"] / "trainer.pt")
    rehash(p["tr-not-dict"])
    p["sums-dup"] = shutil.copytree(ckpt, c / "sums-dup")
    text = (p["sums-dup"] / "CHECKSUMS").read_text()
    (p["sums-dup"] / "CHECKSUMS").write_text(text + text.splitlines()[0][:64] + "0" * 0 + "  trainer.pt\n")
    p["sums-huge"] = shutil.copytree(ckpt, c / "sums-huge")
    with open(p["sums-huge"] / "CHECKSUMS", "ab") as f:
        f.truncate(200 << 20)  # sparse: 200 MiB of zero bytes
    p["ck-tok-vocab"] = edit_json(ckpt, c / "ck-tok-vocab", "meta.json", lambda d: d.update(vocab_size=10**9))
    rehash(p["ck-tok-vocab"])
    # -- Hugging Face folders (principle 1)
    h = root / "hfs"
    h.mkdir()
    for name, change in {
        "hidden-zero": {"hidden_size": 0}, "hidden-negative": {"hidden_size": -48},
        "layers-text": {"num_hidden_layers": "2"}, "vocab-zero": {"vocab_size": 0},
        "heads-indivisible": {"num_attention_heads": 5, "head_dim": None},
        "kv-zero": {"num_key_value_heads": 0}, "eps-text": {"rms_norm_eps": "tiny"},
        "eps-negative": {"rms_norm_eps": -1e-6}, "theta-negative": {"rope_theta": -1.0},
        "positions-negative": {"max_position_embeddings": -64}, "tie-text": {"tie_word_embeddings": "yes"},
        "window-text": {"sliding_window": "big"}, "rope-scaling-list": {"rope_scaling": [1, 2]},
        "rope-factor-text": {"rope_scaling": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
        "head-dim-huge": {"head_dim": 10**12},
    }.items():
        p[f"hf-{name}"] = edit_json(hf, h / name, "config.json", lambda d, c=change: d.update(c))
    p["hf-st-dtype"] = edit_header(hf, h / "st-dtype", lambda hd: hd[first_tensor(hd)].update(dtype="Q7"))
    p["hf-st-shape"] = edit_header(hf, h / "st-shape", lambda hd: hd[first_tensor(hd)].update(shape=[3, 3]))
    p["hf-st-offsets"] = edit_header(hf, h / "st-offsets",
                                     lambda hd: hd[first_tensor(hd)].update(data_offsets=[16, 8]))

    def overlap(hd):
        a, b = sorted(k for k in hd if k != "__metadata__")[:2]
        hd[b]["data_offsets"] = [hd[a]["data_offsets"][0], hd[a]["data_offsets"][0] + (
            hd[b]["data_offsets"][1] - hd[b]["data_offsets"][0])]

    p["hf-st-overlap"] = edit_header(hf, h / "st-overlap", overlap)
    p["hf-st-header-len"] = shutil.copytree(hf, h / "st-header-len")
    raw = (hf / "model.safetensors").read_bytes()
    (p["hf-st-header-len"] / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + raw[8:])

    def extra_token(d):
        d["added_tokens"].append({"id": 400, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})

    p["hf-tok-renumbered"] = edit_json(hf, h / "tok-renumbered", "tokenizer.json", extra_token)

    def extra_tokens(d):
        d["added_tokens"] += [{"id": 300 + i, "content": f"<|extra{i}|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True} for i in range(5)]

    p["hf-tok-beyond"] = edit_json(hf, h / "tok-beyond", "tokenizer.json", extra_tokens)
    p["hf-tok-config-eos"] = edit_json(hf, h / "tok-config-eos", "tokenizer_config.json",
                                       lambda d: d.update(eos_token=7))
    p["hf-tok-config-list"] = edit_json(hf, h / "tok-config-list", "tokenizer_config.json", lambda d: [1, 2])
    # -- cluster files (principles 1 and 2)
    k = root / "clusters"
    k.mkdir()
    for name, text in {
        "gpu-number": '[[group]]\ngpu = 5\ncount = 8\n',
        "count-bool": '[[group]]\ngpu = "H100"\ncount = true\n',
        "per-node-zero": '[[group]]\ngpu = "H100"\ncount = 8\ngpus_per_node = 0\n[[group]]\ngpu = "A100"\ncount = 8\n',
        "per-node-text": '[[group]]\ngpu = "H100"\ncount = 8\ngpus_per_node = "8"\n',
        "intra-number": '[[group]]\ngpu = "H100"\ncount = 8\nintra = 3\n[[group]]\ngpu = "A100"\ncount = 8\n',
        "count-billions": '[[group]]\ngpu = "H100"\ncount = 8000000000\n[[group]]\ngpu = "A100"\ncount = 8\n',
        "group-not-table": 'group = [1, 2]\n',
    }.items():
        (k / f"{name}.toml").write_text(text)
        p[f"cl-{name}"] = k / f"{name}.toml"
    # -- prepared datasets (principle 1)
    d = root / "datasets"
    d.mkdir()
    p["ds-dtype"] = edit_json(char_data, d / "dtype", "meta.json", lambda m: m.update(dtype="complex-ish"))
    p["ds-splits"] = edit_json(char_data, d / "splits", "meta.json", lambda m: m.__delitem__("splits"))
    p["ds-shard-path"] = edit_json(char_data, d / "shard-path", "meta.json",
                                   lambda m: m["splits"]["train"]["shards"][0].update(file="../../../etc/hostname"))
    p["ds-vocab"] = edit_json(char_data, d / "vocab", "meta.json", lambda m: m.update(vocab_size=-3))
    p["ds-eos"] = edit_json(char_data, d / "eos", "meta.json", lambda m: m.update(eos_id=5000))
    p["ds-tokens"] = edit_json(char_data, d / "tokens", "meta.json",
                               lambda m: m["splits"]["val"]["shards"][0].update(tokens="many"))
    p["ds-chars"] = shutil.copytree(char_data, d / "chars")
    (p["ds-chars"] / "chars.json").write_text(json.dumps({"a": 1}))
    # another char tokenizer with the same vocabulary size (principle 6)
    text = (Path(char_data) / "chars.json").read_text()
    chars = json.loads(text)
    other = [("é" if ch == "Z" else ch) for ch in chars]
    corpus = root / "other.txt"
    corpus.write_text("".join(other) * 200)
    from paratrain.data import prepare_dataset

    prepare_dataset(corpus, d / "other-tok", tokenizer="char")
    p["ds-other-tok"] = d / "other-tok"
    # -- compressed corpora (principle 5)
    z = root / "corpora"
    z.mkdir()
    lines = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(400))
    full = gzip.compress(lines)
    (z / "cut.jsonl.gz").write_bytes(full[:len(full) // 2])
    (z / "garbage-tail.jsonl.gz").write_bytes(full + b"this is not gzip")
    flipped = bytearray(full)
    flipped[len(full) // 2] ^= 0xFF
    (z / "flipped.jsonl.gz").write_bytes(bytes(flipped))
    import zstandard

    zfull = zstandard.ZstdCompressor().compress(lines)
    (z / "cut.jsonl.zst").write_bytes(zfull[:len(zfull) - 7])
    (z / "garbage-tail.jsonl.zst").write_bytes(zfull + b"trailing bytes")
    (z / "cut-second-frame.jsonl.zst").write_bytes(zfull + zfull[:len(zfull) // 2])
    p["corpora"] = z
    (root / "text.txt").write_text("some text for a tiny corpus\n" * 50)
    yield World(root, Path(char_data), prev, ckpt, hf, p)


def _mixture(w: World, weights) -> list[str]:
    sources = ", ".join(f'{{dir = "{w.data}", weight = {x}, name = "d{i}"}}' for i, x in enumerate(weights))
    return w.train(f"--data.sources=[{sources}]")


P = {}  # case name -> principle


def case(principle: int, name: str, argv, pattern: str):
    P[name] = principle
    return name, argv, pattern


CASES = [
    # ---- 1. every field of every file is checked: checkpoints
    case(1, "ckpt-md-traversal", lambda w: w.gen(w.p["md-traversal"]), r"\.metadata.*storage_data names the file"),
    case(1, "ckpt-md-negative-offset", lambda w: ["export", str(w.p["md-offset"]), "--format", "hf", "--out",
                                                 str(w.root / "x")], r"offset -8 is not a byte count"),
    case(1, "ckpt-md-not-metadata", lambda w: w.gen(w.p["md-not-metadata"]), r"\.metadata holds a dict, not DCP"),
    case(1, "ckpt-md-truncated", lambda w: w.train(f"--checkpoint.resume={w.p['md-truncated']}"),
         r"\.metadata is not readable DCP metadata"),
    case(1, "ckpt-trainer-step", lambda w: w.gen(w.p["tr-step"]), r"trainer\.pt: step must be an integer >= 0"),
    case(1, "ckpt-trainer-step-text", lambda w: w.train(f"--checkpoint.resume={w.p['tr-step-text']}"),
         r"trainer\.pt: step must be an integer >= 0, got 'three'"),
    case(1, "ckpt-trainer-dim-text", lambda w: w.gen(w.p["tr-dim"]), r"trainer\.pt: model_args\.dim must be"),
    case(1, "ckpt-trainer-unknown-arg", lambda w: ["export", str(w.p["tr-unknown-arg"]), "--format", "hf", "--out",
                                                  str(w.root / "x")], r"trainer\.pt: model_args has an unknown field"),
    case(1, "ckpt-trainer-heads-zero", lambda w: w.gen(w.p["tr-heads"]), r"trainer\.pt: model_args.*n_heads"),
    case(1, "ckpt-trainer-seq-zero", lambda w: w.gen(w.p["tr-seq"]), r"trainer\.pt: seq_len must be an integer >= 1"),
    case(1, "ckpt-trainer-optimizer", lambda w: w.train(f"--checkpoint.resume={w.p['tr-optimizer']}"),
         r"trainer\.pt: optimizer must be a string, got int"),
    case(1, "ckpt-trainer-not-dict", lambda w: w.gen(w.p["tr-not-dict"]), r"trainer\.pt holds a list"),
    case(1, "ckpt-checksums-duplicate", lambda w: w.gen(w.p["sums-dup"]), r"CHECKSUMS lists trainer\.pt twice"),
    case(1, "ckpt-checksums-huge", lambda w: w.gen(w.p["sums-huge"]), r"CHECKSUMS is .* larger than"),
    case(1, "ckpt-tokenizer-vocab", lambda w: w.gen(w.p["ck-tok-vocab"]), r"meta\.json: vocab_size"),
    # ---- 3. no code from a checkpoint (and the marker tests below, through every command that reads one)
    case(3, "ckpt-md-foreign-class", lambda w: ["export", str(w.p["md-foreign-class"]), "--format", "hf", "--out",
                                               str(w.root / "x")],
         r"\.metadata asks to load collections\.Counter, which DCP metadata never holds \(refused"),
    case(3, "ckpt-md-persistent-id", lambda w: w.gen(w.p["md-persistent"]),
         r"\.metadata asks to load a persistent id, which DCP metadata never holds \(refused"),
    # ---- 1. Hugging Face config.json
    case(1, "hf-hidden-zero", lambda w: w.gen(w.p["hf-hidden-zero"]), r"config\.json: hidden_size must be"),
    case(1, "hf-hidden-negative", lambda w: w.train(f"--model.init_from=hf:{w.p['hf-hidden-negative']}"),
         r"config\.json: hidden_size must be"),
    case(1, "hf-layers-text", lambda w: w.gen(w.p["hf-layers-text"]), r"config\.json: .*num_hidden_layers"),
    case(1, "hf-vocab-zero", lambda w: w.gen(w.p["hf-vocab-zero"]), r"config\.json: vocab_size must be"),
    case(1, "hf-heads-indivisible", lambda w: w.gen(w.p["hf-heads-indivisible"]),
         r"config\.json: hidden_size=48 is not a multiple of num_attention_heads=5"),
    case(1, "hf-kv-zero", lambda w: w.gen(w.p["hf-kv-zero"]), r"config\.json: num_key_value_heads must be"),
    case(1, "hf-eps-text", lambda w: w.gen(w.p["hf-eps-text"]), r"config\.json: rms_norm_eps must be"),
    case(1, "hf-eps-negative", lambda w: w.gen(w.p["hf-eps-negative"]), r"config\.json: rms_norm_eps must be"),
    case(1, "hf-theta-negative", lambda w: w.gen(w.p["hf-theta-negative"]), r"config\.json: rope_theta must be"),
    case(1, "hf-positions-negative", lambda w: w.gen(w.p["hf-positions-negative"]),
         r"config\.json: max_position_embeddings must be"),
    case(1, "hf-tie-text", lambda w: w.gen(w.p["hf-tie-text"]), r"config\.json: tie_word_embeddings must be"),
    case(1, "hf-window-text", lambda w: w.gen(w.p["hf-window-text"]), r"config\.json: sliding_window must be"),
    case(1, "hf-rope-scaling-list", lambda w: w.gen(w.p["hf-rope-scaling-list"]), r"config\.json: rope_scaling must"),
    case(1, "hf-rope-factor-text", lambda w: w.gen(w.p["hf-rope-factor-text"]), r"config\.json: rope_scaling\.factor"),
    # ---- 1. safetensors headers
    case(1, "hf-st-dtype", lambda w: w.gen(w.p["hf-st-dtype"]), r"model\.safetensors: .*dtype 'Q7'"),
    case(1, "hf-st-shape", lambda w: w.gen(w.p["hf-st-shape"]), r"model\.safetensors: .*shape \[3, 3\] .* bytes"),
    case(1, "hf-st-offsets", lambda w: w.gen(w.p["hf-st-offsets"]), r"model\.safetensors: .*data_offsets \[16, 8\]"),
    case(1, "hf-st-overlap", lambda w: w.gen(w.p["hf-st-overlap"]), r"model\.safetensors: .*overlap"),
    case(1, "hf-st-header-len", lambda w: w.gen(w.p["hf-st-header-len"]), r"truncated shard .*model\.safetensors"),
    # ---- 1. tokenizer files
    case(1, "hf-tokenizer-beyond-vocab", lambda w: w.gen(w.p["hf-tok-beyond"]),
         r"tokenizer\.json.* id 304 .*vocab_size 304"),
    case(1, "hf-tokenizer-renumbered", lambda w: w.gen(w.p["hf-tok-renumbered"]),
         r"tokenizer\.json: added_tokens gives '<\|extra\|>' the id 400, but the tokenizer numbers it 300"),
    case(1, "hf-tokenizer-config-eos", lambda w: w.gen(w.p["hf-tok-config-eos"]),
         r"tokenizer_config\.json: eos_token must be"),
    case(1, "hf-tokenizer-config-list", lambda w: w.gen(w.p["hf-tok-config-list"]),
         r"tokenizer_config\.json is not a JSON object"),
    case(1, "import-tokenizer-beyond-vocab", lambda w: w.train(f"--model.init_from=hf:{w.p['hf-tok-beyond']}",
                                                               f"--data.dir={w.root}/newdata",
                                                               f"--data.source={w.root}/text.txt",
                                                               "--run.name=new"),
         r"tokenizer\.json.* id 304 .*vocab_size 304"),
    # ---- 1. cluster files
    case(1, "cluster-gpu-number", lambda w: ["plan", "--cluster", str(w.p["cl-gpu-number"]), "--no-write"],
         r"gpu-number\.toml: group 1: gpu must be a GPU name"),
    case(1, "cluster-count-bool", lambda w: ["plan", "--cluster", str(w.p["cl-count-bool"]), "--no-write"],
         r"count-bool\.toml: group 1: count must be an integer"),
    case(1, "cluster-per-node-zero", lambda w: ["plan", "--cluster", str(w.p["cl-per-node-zero"]), "--no-write"],
         r"per-node-zero\.toml: group 1: gpus_per_node must be an integer >= 1"),
    case(1, "cluster-per-node-text", lambda w: ["plan", "--cluster", str(w.p["cl-per-node-text"]), "--no-write"],
         r"per-node-text\.toml: group 1: gpus_per_node must be an integer"),
    case(1, "cluster-intra-number", lambda w: ["plan", "--cluster", str(w.p["cl-intra-number"]), "--no-write"],
         r"intra-number\.toml: group 1: intra must be"),
    case(1, "cluster-group-not-table", lambda w: ["plan", "--cluster", str(w.p["cl-group-not-table"]), "--no-write"],
         r"group-not-table\.toml: .*\[\[group\]\]"),
    # ---- 1. mixture weights
    case(1, "mixture-weights-overflow", lambda w: _mixture(w, ["1e308", "1e308"]), r"data\.sources.*weights"),
    case(1, "mixture-weight-vanishing", lambda w: _mixture(w, ["1.0", "1e-30"]),
         r"data\.sources\[1\]\.weight 1e-30 is too small"),
    # ---- 1. prepared-data meta.json
    case(1, "dataset-dtype", lambda w: w.train(f"--data.dir={w.p['ds-dtype']}", "--run.name=new"), r"meta\.json: dtype"),
    case(1, "dataset-no-splits", lambda w: w.train(f"--data.dir={w.p['ds-splits']}", "--run.name=new"), r"meta\.json.*splits"),
    case(1, "dataset-shard-path", lambda w: w.train(f"--data.dir={w.p['ds-shard-path']}", "--run.name=new"),
         r"meta\.json: .*file '\.\./\.\./\.\./etc/hostname' is not a file name"),
    case(1, "dataset-vocab", lambda w: w.train(f"--data.dir={w.p['ds-vocab']}", "--run.name=new"), r"meta\.json: vocab_size must be"),
    case(1, "dataset-eos", lambda w: w.train(f"--data.dir={w.p['ds-eos']}", "--run.name=new"), r"meta\.json: eos_id 5000"),
    case(1, "dataset-tokens-text", lambda w: w.train(f"--data.dir={w.p['ds-tokens']}", "--run.name=new"), r"meta\.json: .*tokens"),
    case(1, "dataset-chars", lambda w: w.train(f"--data.dir={w.p['ds-chars']}", "--run.name=new"), r"chars\.json"),
    # ---- 2. no number makes paratrain loop, allocate or spawn without bound
    case(2, "plan-gpus-billions", lambda w: ["plan", "--gpus", "1000000000000", "--gpus-per-node", "8", "--no-write"],
         r"--gpus 1000000000000 is more than"),
    case(2, "cluster-count-billions", lambda w: ["plan", "--cluster", str(w.p["cl-count-billions"]), "--no-write"],
         r"count-billions\.toml: .*more than"),
    case(2, "prepare-workers", lambda w: ["prepare", "--input", str(w.root / "text.txt"), "--out",
                                          str(w.root / "d"), "--workers", "100000"], r"--workers 100000 is more than"),
    case(2, "prepare-shard-tokens", lambda w: ["prepare", "--input", str(w.root / "text.txt"), "--out",
                                               str(w.root / "d"), "--shard-tokens", "1"], r"--shard-tokens"),
    case(2, "prepare-vocab-huge", lambda w: ["prepare", "--input", str(w.root / "text.txt"), "--out",
                                             str(w.root / "d"), "--tokenizer", "bpe", "--vocab-size", "10000000000"],
         r"--vocab-size 10000000000 is more than"),
    case(2, "generate-max-new-tokens", lambda w: ["generate", "--checkpoint", str(w.prev), "--max-new-tokens",
                                                  "1000000000000"], r"--max-new-tokens 1000000000000 is more than"),
    case(2, "hf-head-dim-huge", lambda w: w.gen(w.p["hf-head-dim-huge"]), r"config\.json: head_dim"),
    # ---- 4. no command destroys its own inputs
    case(4, "export-onto-run", lambda w: ["export", str(w.prev), "--format", "hf", "--out", str(w.prev),
                                          "--overwrite"], r"--out .*prev would delete the checkpoint it reads"),
    case(4, "export-onto-checkpoints", lambda w: ["export", str(w.ckpt), "--format", "hf", "--out",
                                                  str(w.ckpt.parent), "--overwrite"],
         r"--out .*checkpoints would delete the checkpoint it reads"),
    case(4, "export-onto-step", lambda w: ["export", str(w.ckpt), "--format", "hf", "--out", str(w.ckpt),
                                           "--overwrite"], r"would delete the checkpoint it reads"),
    case(4, "prepare-input-in-out", lambda w: ["prepare", "--input", str(w.data / "meta.json"), "--out", str(w.data),
                                               "--overwrite"], r"--out .* would delete --input"),
    case(4, "prepare-val-input-in-out", lambda w: ["prepare", "--input", str(w.root / "text.txt"), "--val-input",
                                                   str(w.data / "chars.json"), "--out", str(w.data), "--overwrite"],
         r"--out .* would delete --val-input"),
    case(4, "prepare-out-is-input-folder", lambda w: ["prepare", "--input", str(w.p["corpora"]), "--out",
                                                      str(w.p["corpora"]), "--overwrite"], r"would delete --input"),
    # ---- 5. a truncated or corrupt compressed input is an error naming the file and the offset
    case(5, "gzip-truncated", lambda w: ["prepare", "--input", str(w.p["corpora"] / "cut.jsonl.gz"), "--out",
                                         str(w.root / "d")], r"cut\.jsonl\.gz: truncated gzip stream.*offset \d+"),
    case(5, "gzip-trailing-garbage", lambda w: ["prepare", "--input", str(w.p["corpora"] / "garbage-tail.jsonl.gz"),
                                                "--out", str(w.root / "d")], r"garbage-tail\.jsonl\.gz: .*offset \d+"),
    case(5, "gzip-flipped", lambda w: ["prepare", "--input", str(w.p["corpora"] / "flipped.jsonl.gz"), "--out",
                                       str(w.root / "d")], r"flipped\.jsonl\.gz: corrupt gzip .*offset \d+"),
    case(5, "zstd-truncated", lambda w: ["prepare", "--input", str(w.p["corpora"] / "cut.jsonl.zst"), "--out",
                                         str(w.root / "d")], r"cut\.jsonl\.zst: truncated zstd stream.*offset \d+"),
    case(5, "zstd-trailing-garbage", lambda w: ["prepare", "--input", str(w.p["corpora"] / "garbage-tail.jsonl.zst"),
                                                "--out", str(w.root / "d")], r"garbage-tail\.jsonl\.zst: .*offset \d+"),
    case(5, "zstd-second-frame-cut", lambda w: ["prepare", "--input",
                                                str(w.p["corpora"] / "cut-second-frame.jsonl.zst"), "--out",
                                                str(w.root / "d")], r"cut-second-frame\.jsonl\.zst: truncated zstd"),
    # ---- 6. a resumed run is the same run
    case(6, "resume-other-tokenizer-same-vocab", lambda w: w.train(f"--data.dir={w.p['ds-other-tok']}",
                                                                   f"--checkpoint.resume={w.ckpt}"),
         r"cannot resume from .*step-3: it was trained with another tokenizer .*same vocabulary size"),
    case(6, "resume-auto-other-tokenizer", lambda w: w.train(f"--data.dir={w.p['ds-other-tok']}",
                                                             "--checkpoint.resume=auto"),
         r"another tokenizer"),
    # ---- 7. hints are true
    case(7, "export-file-with-overwrite", lambda w: ["export", str(w.prev), "--format", "hf", "--out",
                                                     str(w.root / "text.txt"), "--overwrite"],
         r"--out .*text\.txt is a file(?!.*pass --overwrite)"),
    case(7, "prepare-overwrite-hint-not-destructive", lambda w: ["prepare", "--input", str(w.data / "meta.json"),
                                                                 "--out", str(w.data)],
         r"^(?!.*pass --overwrite).*would delete --input"),
    case(7, "hf-derived-head-dim", lambda w: w.gen(w.p["hf-heads-indivisible"]),
         r"num_attention_heads=5(?!.*head_dim)"),
    case(7, "resume-other-model-names-field", lambda w: w.train(f"--checkpoint.resume={w.ckpt}",
                                                                "--model.n_heads=2"),
         r"it holds another model: n_heads 4 \(this run: 2\)"),
]


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def test_enough_cases():
    names = [c[0] for c in CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)
    for principle in range(1, 8):
        assert sum(1 for n in names if P[n] == principle) >= 2, principle


def run_cli(world: World, capsys, monkeypatch, args: list[str]) -> tuple[int, str, str]:
    monkeypatch.chdir(world.root / "cwd")
    monkeypatch.setenv("HOME", str(world.root / "home"))
    monkeypatch.setenv("TMPDIR", str(world.root / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(world.root / "tmp"))
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name, argv, pattern", CASES, ids=[c[0] for c in CASES])
def test_hostile_file(world, capsys, monkeypatch, name, argv, pattern):
    args = argv(world)
    before = snapshot(world.root)
    rc, out, err = run_cli(world, capsys, monkeypatch, args)
    assert_refused(rc, out, err, pattern)
    assert snapshot(world.root) == before, "files changed"


# ---- 3. loading a checkpoint runs no code from it

MARKER_COMMANDS = {
    "generate": lambda w, c: w.gen(c),
    "export": lambda w, c: ["export", str(c), "--format", "hf", "--out", str(w.root / "x")],
    "checkpoint-verify": lambda w, c: ["checkpoint", "verify", str(c)],
    "resume": lambda w, c: w.train(f"--checkpoint.resume={c}"),
}


@pytest.mark.parametrize("where", ["evil-md", "evil-entry"])
@pytest.mark.parametrize("command", list(MARKER_COMMANDS))
def test_pickle_runs_no_code(world, capsys, monkeypatch, command, where):
    """A .metadata (or a pickled entry inside a shard) that would create a marker when unpickled, with a CHECKSUMS
    that matches it: refused by every command that reads checkpoints, and the marker never appears."""
    marker = world.root / "markers" / where
    ckpt = world.p[where]
    before = snapshot(world.root)
    rc, out, err = run_cli(world, capsys, monkeypatch, MARKER_COMMANDS[command](world, ckpt))
    assert not marker.exists(), "code from the checkpoint ran"
    assert "Traceback" not in out + err
    refused = r"refused: loading it could run code"
    if command == "checkpoint-verify":  # its contract: one BAD line per checkpoint, exit 1
        assert rc == 1 and re.search(rf"^BAD .*{where}: .*{refused}", out, re.M), (rc, out, err)
    else:
        assert_refused(rc, out, err, refused)
    assert snapshot(world.root) == before, "files changed"


def test_plain_pickle_would_run_the_marker(world, tmp_path):
    """The hostile checkpoints are real: torch's own reader runs their code (so the tests above mean something)."""
    import torch.distributed.checkpoint as dcp

    copy = shutil.copytree(world.p["evil-md"], tmp_path / "c")
    marker = world.root / "markers" / "evil-md"
    try:
        dcp.FileSystemReader(str(copy)).read_metadata()
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_safe_reader_loads_real_checkpoints(world):
    """The allow-list admits everything a real checkpoint holds: the trained run still generates and verifies."""
    from paratrain.training import safe_dcp
    from paratrain.training.checkpoint import checkpoint_problem

    md = safe_dcp.read_metadata(world.ckpt)
    assert md.state_dict_metadata and checkpoint_problem(world.ckpt) is None
