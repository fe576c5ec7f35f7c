"""paratrain's tokenizers as Hugging Face tokenizer files (tokenizer.json + tokenizer_config.json).

Every kind becomes a `tokenizers` model that encodes text to the same ids: byte -> a byte-level BPE with the
256 byte symbols (id = byte value) and no merges; char -> a BPE over the corpus characters with no merges and
no pre-tokenizer (each character is one token) and a decoder that concatenates; bpe / tokenizer.json -> the
file itself. Special tokens (`eos_id`, `bos_id` where the tokenizer defines them) are added tokens with those
exact ids, named in tokenizer_config.json, and a BOS is prepended on encode where one is defined (as
`prepare` does for every document).
"""

from __future__ import annotations

import json
from pathlib import Path

EOS_TEXT, BOS_TEXT = "<|endoftext|>", "<|begin_of_text|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what tokenizers' ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _base_tokenizer(tok):
    """A `tokenizers.Tokenizer` encoding like paratrain's `tok`, without special tokens."""
    import tokenizers as hf

    if tok.kind == "byte":
        to_unicode = _bytes_to_unicode()
        t = hf.Tokenizer(hf.models.BPE(vocab={to_unicode[b]: b for b in range(256)}, merges=[]))
        t.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        t.decoder = hf.decoders.ByteLevel()
        return t
    if tok.kind == "char":
        t = hf.Tokenizer(hf.models.BPE(vocab={c: i for i, c in enumerate(tok.chars)}, merges=[]))
        t.decoder = hf.decoders.Fuse()
        return t
    return tok.tok  # bpe / tokenizer.json: already a tokenizers model


def special_tokens(tok) -> dict[str, tuple[int, str]]:
    """{"bos": (id, text), "eos": (id, text)} for the special tokens `tok` defines."""
    out = {}
    for role, default in (("bos", BOS_TEXT), ("eos", EOS_TEXT)):
        token_id = getattr(tok, f"{role}_id", None)
        if token_id is None:
            continue
        text = tok.tok.id_to_token(token_id) if hasattr(tok, "tok") else None
        out[role] = (int(token_id), text or default)
    return out


def tokenizer_json(tok) -> dict:
    """tokenizer.json content for paratrain's tokenizer `tok`."""
    data = json.loads(_base_tokenizer(tok).to_str())
    specials = special_tokens(tok)
    added = {a["id"]: a for a in data.get("added_tokens") or []}
    for token_id, text in specials.values():
        if token_id not in added:
            added[token_id] = {"id": token_id, "content": text, "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True}
    data["added_tokens"] = [added[i] for i in sorted(added)]
    if "bos" in specials and tok.kind in ("byte", "char"):
        bos_id, bos = specials["bos"]
        data["post_processor"] = {"type": "TemplateProcessing",
                                  "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                             {"Sequence": {"id": "A", "type_id": 0}}],
                                  "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}},
                                           {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    return data


def write_tokenizer(tok, folder: Path, max_len: int) -> dict[str, tuple[int, str]]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for `tok` in `folder`; returns the
    special tokens."""
    specials = special_tokens(tok)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(tok), ensure_ascii=False, indent=2) + "\n")
    names = {f"{role}_token": text for role, (_, text) in specials.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": max_len, **names}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    return specials
