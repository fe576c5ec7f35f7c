"""Chat data: conversations rendered with the tokenizer's chat template and a loss mask, as transformers renders and
masks them (`apply_chat_template(..., return_assistant_tokens_mask=True)`), prepared into shards, and bad input.

The tokenizer is a small byte-level BPE trained here with chat special tokens and a template written here: no
network."""

from __future__ import annotations

import json
import random

import pytest

transformers = pytest.importorskip("transformers")

from paratrain.cli import main  # noqa: E402
from paratrain.data import DEFAULT_CORPUS  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|begin|>", "<|start|>", "<|sep|>", "<|eot|>"]
# Llama-3-like, with the assistant turns marked for return_assistant_tokens_mask
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "<|start|>assistant<|sep|>{% generation %}{{ message['content'] }}<|eot|>{% endgeneration %}"
            "{% else %}<|start|>{{ message['role'] }}<|sep|>{{ message['content'] }}<|eot|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}")
UNMARKED = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = "the king queen lord good night day sword love time death life heart crown france england".split()


def save_chat_tokenizer(folder, template: str | None = TEMPLATE) -> None:
    """tokenizer.json (300 ids) and tokenizer_config.json with BOS, EOS and the chat template."""
    import tokenizers as tk

    folder.mkdir(parents=True, exist_ok=True)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([DEFAULT_CORPUS.read_text()[:20000]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>", "eos_token": "<|eot|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_chats(path, n: int, seed: int = 0, long_every: int = 0) -> None:
    """n conversations: every third a prompt/completion instruction, the others 1-2 user/assistant exchanges (one in
    four with a system turn); with long_every, every long_every-th is long."""
    rng = random.Random(seed)

    def say(k):
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    with open(path, "w") as f:
        for i in range(n):
            k = 30 if long_every and i % long_every == long_every - 1 else 1
            if i % 3 == 0:
                line = {"prompt": say(rng.randint(2, 6)), "completion": say(k * rng.randint(2, 8))}
            else:
                turns = [{"role": "system", "content": say(3)}] if i % 4 == 1 else []
                for t in range(rng.choice([2, 4])):
                    turns.append({"role": "user" if t % 2 == 0 else "assistant", "content": say(k * rng.randint(2, 8))})
                line = {"messages": turns}
            f.write(json.dumps(line) + "\n")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(folder)
    return folder


CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"},
     {"role": "assistant", "content": "A humble servant, my lord."}, {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": "Nothing more."}],
    [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "I will, good night."}],
    [{"role": "user", "content": "Unicode: é, ü and — dashes"}, {"role": "assistant", "content": " spaced  out "}],
]


def encoder(folder, template_file=None, loss_on="assistant"):
    from paratrain.data.chat import chat_encoder
    from paratrain.data.tokenizers import HFTokenizer

    return chat_encoder(HFTokenizer.from_file(folder / "tokenizer.json"), folder / "tokenizer.json", template_file,
                        loss_on)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_tokens_and_mask_equal_transformers(chat_tokenizer, conversation):
    """The tokens and the assistant mask are transformers' apply_chat_template(..., return_assistant_tokens_mask=True);
    'last' keeps the last turn of them, 'all' every token; a template without {% generation %} blocks finds the same
    turns from the text each one adds."""
    from transformers import AutoTokenizer

    messages = CONVERSATIONS[conversation]
    out = AutoTokenizer.from_pretrained(chat_tokenizer).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    want_ids, want_mask = list(out["input_ids"]), list(out["assistant_masks"])
    ids, mask = encoder(chat_tokenizer).encode(messages, False, "x")
    assert list(ids) == want_ids and list(mask) == want_mask and sum(mask) > 0
    (chat_tokenizer / "unmarked.jinja").write_text(UNMARKED)
    ids2, mask2 = encoder(chat_tokenizer, str(chat_tokenizer / "unmarked.jinja")).encode(messages, False, "x")
    assert list(ids2) == want_ids and list(mask2) == want_mask
    _, last = encoder(chat_tokenizer, loss_on="last").encode(messages, False, "x")
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert list(last) == [m if i >= starts[-1] else 0 for i, m in enumerate(mask)]
    _, every = encoder(chat_tokenizer, loss_on="all").encode(messages, False, "x")
    assert every.all()


def test_prepare_chat_writes_tokens_and_masks(chat_tokenizer, tmp_path, capsys):
    """`paratrain prepare --chat`: every conversation rendered, tokenized and masked as the encoder does it, whole
    conversations in the validation split, the template kept beside, the counts in meta.json; a prompt/completion
    line without a template is BOS + prompt + completion + EOS with the completion learnt."""
    from paratrain.data.chat import conversation
    from paratrain.data.loader import Shards

    write_chats(tmp_path / "chat.jsonl", 30)
    out = tmp_path / "data"
    assert main(["prepare", "--input", str(tmp_path / "chat.jsonl"), "--out", str(out), "--tokenizer",
                 str(chat_tokenizer / "tokenizer.json"), "--chat"]) == 0
    assert "chat: 30 conversations (10 prompt/completion)" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["loss_mask"] is True and meta["chat"]["loss_on"] == "assistant" and meta["chat"]["generation_blocks"]
    assert (out / "chat_template.jinja").read_text() == TEMPLATE and meta["val_documents"] == 3
    enc = encoder(chat_tokenizer)
    expected = [enc.encode(*conversation(json.loads(line), "x"), "x")
                for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    for split, rows in (("train", [e for i, e in enumerate(expected) if (i + 1) % 10]),
                        ("val", [e for i, e in enumerate(expected) if (i + 1) % 10 == 0])):
        s = Shards(out, split, meta)
        ends = s.document_ends()
        assert len(ends) == len(rows)
        start = 0
        for end, (ids, mask) in zip(ends.tolist(), rows):
            assert list(s.read(start, end - start)) == list(ids)
            assert list(s.read(start, end - start, mask=True)) == list(mask)
            start = end
    assert meta["chat"]["target_tokens"] == sum(int(m.sum()) for _, m in expected)
    plain = tmp_path / "plain"
    save_chat_tokenizer(plain, template=None)
    no_template = encoder(plain)
    ids, mask = no_template.encode(*conversation({"prompt": "Speak.", "completion": "Good night."}, "x"), "x")
    tok = no_template.tokenizer
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert list(ids[1:-1]) == tok.encode("Speak.") + tok.encode("Good night.")
    assert list(mask) == [0] * (1 + len(tok.encode("Speak."))) + [1] * (len(tok.encode("Good night.")) + 1)


def test_packed_batches_mask_targets(chat_tokenizer, tmp_path):
    """A packed window holds whole conversations: positions restart at each, targets are the masked tokens that do
    not start a conversation, padding learns nothing; the global batch's target count is what its rows keep."""
    from paratrain.data.batch import NOT_A_TARGET
    from paratrain.data.loader import TokenData

    write_chats(tmp_path / "chat.jsonl", 40, long_every=7)
    main(["prepare", "--input", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "d"), "--tokenizer",
          str(chat_tokenizer / "tokenizer.json"), "--chat", "--quiet"])
    data = TokenData(tmp_path / "d", "train", 64)
    assert data.packed and data.packings[0].truncated > 0
    batch = data.micro_batches(0, 8, 1, 0, 1, 1)[0]
    x, y = batch
    assert batch.target_count == int((y != NOT_A_TARGET).sum()) > 0
    assert torch_equal(x[:, 1:], y[:, :-1], where=y[:, :-1] != NOT_A_TARGET)
    pos = batch.positions
    assert (y[:, :-1][pos[:, 1:] == 0] == NOT_A_TARGET).all()  # a conversation's first token is never a target
    dropped = TokenData(tmp_path / "d", "train", 64, overlong="drop")
    assert dropped.packings[0].dropped == data.packings[0].truncated and dropped.packings[0].truncated == 0
    unpacked = TokenData(tmp_path / "d", "train", 64, packing="none")
    assert unpacked.micro_batches(0, 8, 1, 0, 1, 1)[0].positions is None


def torch_equal(a, b, where) -> bool:
    return bool((a[where] == b[where]).all())


@pytest.mark.parametrize("lines, extra, message", [
    ([{"text": "no conversation"}], [], 'expected a JSON object with "messages"'),
    ([{"messages": []}], [], '"messages" must be a non-empty list'),
    ([{"messages": [{"content": "no role"}]}], [], 'messages[0] must be an object with a string "role"'),
    ([{"messages": [{"role": "user", "content": "alone"}]}], [], "without an assistant turn"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     ["--chat-template", "{bad}"], "--chat-template {bad}: no such file"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     ["--template-text", "{{ raise_exception('only one turn, please') }}"], "only one turn, please"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     ["--template-text", "{{ ''.__class__.__mro__[1].__subclasses__() }}"], "the chat template failed"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     ["--template-text", "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"],
     "renders a conversation differently from its beginning"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     ["--template-text", "{% if %}"], "is not valid Jinja"),
    ([{"prompt": "x", "completion": "y"}], ["--tokenizer", "char"], "--chat renders conversations with a Hugging Face"),
])
def test_bad_chat_input_is_one_line(chat_tokenizer, tmp_path, capsys, lines, extra, message):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    if "--template-text" in extra:  # a template file with this text
        k = extra.index("--template-text")
        (tmp_path / "t.jinja").write_text(extra[k + 1])
        extra = [*extra[:k], "--chat-template", str(tmp_path / "t.jinja")]
    argv = ["prepare", "--input", str(path), "--out", str(tmp_path / "out"), "--chat", "--tokenizer",
            str(chat_tokenizer / "tokenizer.json"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_chat_options_need_chat_and_jsonl(chat_tokenizer, tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    (tmp_path / "a.txt").write_text("plain text\n")
    tok = str(chat_tokenizer / "tokenizer.json")
    for argv, message in (
            (["--input", str(tmp_path / "a.jsonl"), "--tokenizer", tok, "--loss-on", "all"], "add --chat"),
            (["--input", str(tmp_path / "a.jsonl"), "--tokenizer", tok], "prepare it with --chat"),
            (["--input", str(tmp_path / "a.txt"), "--tokenizer", tok, "--chat"], "chat data is read from .jsonl")):
        assert main(["prepare", *argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
