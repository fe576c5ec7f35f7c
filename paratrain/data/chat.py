"""Chat and instruction data (`paratrain prepare --chat`): conversations rendered with the tokenizer's own chat
template, tokenized, and a loss mask beside the tokens (1 where the token is a target).

A line of the input is a conversation: `{"messages": [{"role": "user", "content": ...}, ...]}`, or an instruction
`{"prompt": ..., "completion": ...}` (strings, which become a user and an assistant turn, or lists of messages).
The template is rendered as transformers' `apply_chat_template` renders it: Jinja in a sandbox
(`ImmutableSandboxedEnvironment`, no access to Python internals; nothing in a template runs outside it), with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the `raise_exception`, `strftime_now` globals and
a `tojson` filter that does not escape HTML, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
variables; the text is then tokenized without adding special tokens (the template writes them).

Which tokens are targets (`--loss-on`): "assistant" (default) the assistant turns, "last" the last assistant turn,
"all" every token. An assistant turn is the text of a `{% generation %}` block where the template marks them (the
tokens transformers' `return_assistant_tokens_mask=True` marks: every token overlapping the block); for a template
without such blocks, the text each assistant turn adds: from the conversation rendered up to it with the generation
prompt, to the conversation rendered up to and with it (which must be a prefix of the whole rendering). Without a
template, only instructions: BOS + prompt + completion + EOS, the completion and EOS the targets.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from paratrain.data.tokenizers import token_name
from paratrain.errors import UserError, one_line

LOSS_ON = ("assistant", "last", "all")
TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves a tokenizer's template, and a dataset keeps its own
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ---------------------------------------------------------------------------- the conversations of a file

def conversation(record, where: str) -> tuple[list[dict], bool]:
    """(messages, from an instruction) of one input line; a one-line UserError naming `where` otherwise."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with \"messages\", or \"prompt\" and \"completion\"")
    if "messages" in record:
        return _messages(record["messages"], where, "messages"), False
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], True
        return _messages(prompt, where, "prompt") + _messages(completion, where, "completion"), False
    raise UserError(f"{where}: expected a JSON object with \"messages\", or \"prompt\" and \"completion\"")


def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: \"{key}\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} turns")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: {key}[{i}] must be an object with a string \"role\"")
        out.append({k: v for k, v in m.items() if v is not None})  # as transformers: unset fields are absent
    return out


# ---------------------------------------------------------------------------- the template

def template_text(tokenizer_file: Path, override: str | None = None) -> tuple[str | None, str]:
    """(the chat template, where it came from): `override` (a .jinja file), else chat_template.jinja beside the
    tokenizer.json, else tokenizer_config.json's `chat_template` (its "default" one when it names several); None
    when there is none."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise UserError(f"--chat-template {path}: no such file")
        return _read_text(path), str(path)
    folder = Path(tokenizer_file).parent
    if (folder / TEMPLATE_FILE).is_file():
        return _read_text(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE)
    config = tokenizer_config(tokenizer_file)
    value = config.get("chat_template")
    where = str(folder / "tokenizer_config.json")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: chat_template must be a string (or a list of {{name, template}} with a \"default\")")
    return value, where


def tokenizer_config(tokenizer_file: Path) -> dict:
    path = Path(tokenizer_file).parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object")
    return config


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {one_line(e)}") from None


def special_token_texts(tokenizer_file: Path) -> dict[str, str]:
    """The special tokens a template sees by name (bos_token, eos_token, ...), from tokenizer_config.json."""
    config = tokenizer_config(tokenizer_file)
    names = {key: token_name(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: value for key, value in names.items() if value is not None}


def _environment():
    """The sandbox a template renders in, with the names chat templates use, and `{% generation %}` blocks whose
    spans in the output are recorded (`Spans`)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Spans(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: the block renders as it is; while `recording` holds a list of
        the text rendered so far and a list of spans, the block's (start, end) characters are appended."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.recording = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if self.recording is not None:
                rendered, spans = self.recording
                start = sum(map(len, rendered))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Spans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env, env.extensions[Spans.identifier]


class ChatTemplate:
    """A compiled chat template: `render(messages)` -> (text, spans of its `{% generation %}` blocks)."""

    def __init__(self, text: str, origin: str, variables: dict[str, str]):
        import jinja2

        self.text, self.origin, self.variables = text, origin, variables
        env, self._spans = _environment()
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateError as e:
            raise UserError(f"{origin}: the chat template is not valid Jinja ({one_line(e)})") from None
        self.marks_generation = _has_generation_block(text)  # its assistant turns are {% generation %} blocks

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        rendered, spans = [], []
        self._spans.recording = (rendered, spans)
        try:
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 tools=None, documents=None, **self.variables):
                rendered.append(piece)
        except jinja2.TemplateError as e:  # raise_exception() of the template, or a sandbox refusal
            raise UserError(f"{self.origin}: the chat template failed ({one_line(e)})") from None
        finally:
            self._spans.recording = None
        return "".join(rendered), spans


def _has_generation_block(text: str) -> bool:
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None


# ---------------------------------------------------------------------------- tokens and loss mask

class ChatEncoder:
    """Token ids and loss mask of a conversation, with a tokenizer.json tokenizer (`HFTokenizer`) and its template."""

    def __init__(self, tokenizer, template: ChatTemplate | None, loss_on: str = "assistant"):
        if loss_on not in LOSS_ON:
            raise UserError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        self.tokenizer, self.template, self.loss_on = tokenizer, template, loss_on

    def encode(self, messages: list[dict], instruction: bool, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) as int64 and uint8 arrays of one conversation."""
        if self.template is None:
            if not instruction:
                raise UserError(f"{where}: the tokenizer has no chat template to render \"messages\" with (none in "
                                "its tokenizer_config.json or a chat_template.jinja beside it): give --chat-template "
                                "FILE.jinja, or use prompt/completion lines")
            return self._plain(messages[0]["content"], messages[1]["content"])
        if self.loss_on != "all" and not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: a conversation without an assistant turn has nothing to learn with "
                            f"--loss-on {self.loss_on} (use --loss-on all to learn every token)")
        text, spans = self.template.render(messages)
        if not self.template.marks_generation:
            spans = self._turn_spans(messages, text, where)
        if self.loss_on == "last":
            spans = spans[-1:]
        encoding = self._encode(text)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if self.loss_on == "all":
            return ids, np.ones(len(ids), dtype=np.uint8)
        return ids, overlap_mask(encoding.offsets, spans)

    def _encode(self, text: str):
        tok = self.tokenizer.tok
        old = getattr(tok, "encode_special_tokens", None)
        if old is not None:  # the template writes special tokens as text: they must be read as special tokens
            tok.encode_special_tokens = False
        try:
            return tok.encode(text, add_special_tokens=False)
        finally:
            if old is not None:
                tok.encode_special_tokens = old

    def _turn_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        """The characters each assistant turn adds, for a template without `{% generation %}` blocks."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, _ = self.template.render(messages[:i], add_generation_prompt=True)
            upto, _ = self.template.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise UserError(f"{where}: {self.template.origin} renders a conversation differently from its "
                                f"beginning (turn {i} changes the text before it), so its assistant turns cannot be "
                                "found: mark them with {% generation %} blocks, or use --loss-on all")
            spans.append((len(before), len(upto)))
        return spans

    def record(self, stats: dict, folder: Path) -> dict:
        """meta.json's "chat": how the conversations were rendered and what they hold; the template is kept in
        `folder` (the dataset's TEMPLATE_FILE)."""
        out = {"loss_on": self.loss_on, "template": None, **stats}
        if self.template is not None:
            (folder / TEMPLATE_FILE).write_text(self.template.text, encoding="utf-8")
            out.update(template=self.template.origin, generation_blocks=self.template.marks_generation,
                       template_sha256=hashlib.sha256(self.template.text.encode()).hexdigest())
        return out

    def _plain(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        first = [tok.bos_id] if tok.bos_id is not None else []
        last = [tok.eos_id] if tok.eos_id is not None else []
        head = np.asarray(first + list(tok.encode(prompt)), dtype=np.int64)
        tail = np.asarray(list(tok.encode(completion)) + last, dtype=np.int64)
        mask = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
        if self.loss_on == "all":
            mask[:] = 1
        return np.concatenate([head, tail]), mask


def overlap_mask(offsets, spans) -> np.ndarray:
    """1 for every token whose characters overlap one of the (sorted) character spans."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def chat_encoder(tokenizer, tokenizer_file: Path, template_file: str | None, loss_on: str) -> ChatEncoder:
    """The encoder `paratrain prepare --chat` uses: the tokenizer's own template (or `template_file`)."""
    text, origin = template_text(tokenizer_file, template_file)
    template = ChatTemplate(text, origin, special_token_texts(tokenizer_file)) if text is not None else None
    return ChatEncoder(tokenizer, template, loss_on)


def write_conversations(encoder: ChatEncoder, sources, val_sources, split_of, writers, progress, counters) -> dict:
    """Every conversation of the inputs (data/sources.py `Source.records`), encoded with its loss mask, into the
    split writers (prepare.py `SplitWriter`): the conversations of `sources` into `split_of(their index)`, those of
    `val_sources` into "val". Returns the counts meta.json keeps."""
    stats = {"conversations": 0, "instructions": 0, "target_tokens": 0}
    for group, fixed in ((sources, None), (val_sources, "val")):
        for src in group:
            src.documents = 0
            for lineno, record in src.records():
                where = f"{src.path} line {lineno}"
                messages, instruction = conversation(record, where)
                ids, mask = encoder.encode(messages, instruction, where)
                split = fixed
                if split is None:
                    split = split_of(counters["docs"])
                    counters["docs"] += 1
                writers[split].write(ids, True, mask)
                counters["text"] = counters["text"] or len(ids) > 0
                src.documents += 1
                stats["conversations"] += 1
                stats["instructions"] += instruction
                stats["target_tokens"] += int(mask.sum())
                progress.add_counts(sum(len(str(m.get("content", ""))) for m in messages), 1, len(ids))
    return stats
