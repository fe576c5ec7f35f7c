"""The configuration reference, docs/configuration.md, generated from the config dataclasses (`paratrain.config`).

Every section of `Config` and every key of it: its type or choices (`Literal` types, and the registries behind
`model.preset`, `model.family` and `optimizer.name`), its default and its description. The descriptions are the
`#` comments beside and above each field in the source (config.py, and models/args.py for the `[model]` keys
derived from `ModelArgs`) and the dataclasses' docstrings, read with `ast` and `tokenize`, so a new key is documented
where it is declared. Torch-free.

    python -m paratrain.config_reference > docs/configuration.md

`tests/test_docs.py` fails when the page differs from `render()`.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from dataclasses import dataclass, field

from paratrain import capabilities, config
from paratrain.capabilities import OPTIMIZERS
from paratrain.models import args as model_args
from paratrain.models.presets import PRESETS
from paratrain.models.registry import BUILTIN

COMMAND = "python -m paratrain.config_reference > docs/configuration.md"
HEADING = re.compile(r"^--\s*(.*?)\s*--$")  # `# -- communication (...) --`: a group of keys


@dataclass
class Comments:
    """What the source says about one field: the comment lines right above it, the one beside it, and the group
    heading (`# -- name --`) it follows."""

    above: list[str] = field(default_factory=list)
    beside: str = ""
    group: str = ""

    @property
    def text(self) -> str:
        above, beside = " ".join(self.above).strip(), self.beside.strip()
        if above.endswith(".") and beside[:1].islower():  # a new sentence
            beside = beside[0].upper() + beside[1:]
        return " ".join(t for t in (above, beside) if t)


@functools.lru_cache(maxsize=None)
def _source_comments(module) -> dict[str, dict[str, Comments]]:
    """Per class of `module`, per annotated field: its comments."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    comment_at: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            for n in range(tok.start[0], tok.end[0] + 1):
                code_lines.add(n)

    def own_line(n: int) -> bool:  # a line holding a comment and nothing else
        return n in comment_at and n not in code_lines

    out: dict[str, dict[str, Comments]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, Comments] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            c = Comments()
            beside = [comment_at[n] for n in range(stmt.lineno, stmt.end_lineno + 1)
                      if n in comment_at and not own_line(n)]
            c.beside = " ".join(beside)
            n = stmt.lineno - 1
            while n >= 1 and own_line(n) and lines[n - 1].strip():
                heading = HEADING.match(comment_at[n])
                if heading:
                    c.group = heading.group(1)
                    break
                c.above.insert(0, comment_at[n])
                n -= 1
            fields[stmt.target.id] = c
        out[node.name] = fields
    return out


def section_comments(section: str, section_class: type) -> dict[str, Comments]:
    """The comments of a section's fields, wherever each is declared: config.py, or the capability that owns the
    section or adds keys to it (paratrain/capabilities)."""
    out: dict[str, Comments] = {}
    for cls in [*reversed(section_class.__mro__[:-1]), *capabilities.added_keys(section)]:  # (less `object`)
        out.update(_source_comments(sys.modules[cls.__module__]).get(cls.__name__, {}))
    return out


def describe(section: str, section_class: type, key: str) -> str:
    """One config key in a line (`section_class`: its section's dataclass): the first sentence of its description
    and its choices (a Literal's, or a registry's): what a command-line flag of that key says
    (paratrain/commands/recipe_flags.py)."""
    about = section_comments(section, section_class).get(key)
    text = re.split(r"(?<![.])\. (?=[A-Z])", about.text if about else "")[0].rstrip()  # (not "0, k, 2k, ... recompute")
    text = text if text.endswith("...") else text.rstrip(".")
    annotation = typing.get_type_hints(section_class)[key]
    choices = [c for c, _ in _registry_choices().get((section, key), [])]
    choices = choices or (list(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else [])
    listed = " | ".join(map(str, choices))
    named = all(str(c) in text for c in choices)  # the description lists them already
    return f"{text}: {listed}" if text and listed and not named else text or listed


class LazyHelp(collections.UserString):
    """A flag's help text made when argparse first reads it (to print --help): `describe` tokenizes the config's
    sources, ~0.3 s CPU for a command's flags, which a command that is not asked for --help never shows. Made from a
    function (`LazyHelp(lambda: describe(...))`) or from text (what UserString's own methods make)."""

    def __init__(self, make_or_text):  # (no UserString.__init__: it would set the text now)
        if callable(make_or_text):
            self._make = make_or_text
        else:
            self.data = make_or_text

    @functools.cached_property
    def data(self) -> str:  # (a non-data descriptor: the text, once made, is the instance's own `data`)
        return self._make()

    def __mod__(self, args) -> str:  # (argparse: `help % params`, a str for its line wrapping)
        return self.data % args


def _maker_docstring(module, name: str) -> str:
    """The docstring of the function in `module` that makes the class `name` (a string constant in its body)."""
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.FunctionDef) and any(isinstance(n, ast.Constant) and n.value == name
                                                     for n in ast.walk(node)):
            return ast.get_docstring(node) or ""
    return ""


def _docstring_text(doc: str | None) -> str:
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _type(annotation) -> str:
    """A key's type as the page shows it: choices for a Literal, 'or unset' where None is allowed."""
    members = config.annotation_members(annotation)
    choices = [m for m in members if not isinstance(m, type)]
    kinds = [m for m in members if isinstance(m, type) and m is not type(None)]
    names = {bool: "bool", int: "int", float: "float", str: "string", list: "list of tables",
             tuple: "list of integers"}
    shown = [" \\| ".join(f"`{json.dumps(c)}`" for c in choices)] if choices else []
    shown += [names.get(k, k.__name__) for k in kinds]
    text = " or ".join(shown)
    return f"{text}, or unset" if type(None) in members else text


def _value(value) -> str:
    """A default as TOML writes it (None: unset)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{json.dumps(value)}`"
    if isinstance(value, (list, tuple)):
        return f"`{json.dumps(list(value))}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """A description as table-cell text: its pipes escaped (GitHub's tables need that inside code spans too)."""
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def _registry_choices() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Keys whose choices are registries, not Literal types: (section, key) -> [(choice, what it is)]."""

    return {("model", "preset"): [(name, "") for name in PRESETS],
            ("optimizer", "name"): [(name, entry.summary) for name, entry in OPTIMIZERS.items()]}


def _builtin_families() -> str:
    """`model.family` is open (a plug-in registers more): the families shipped with paratrain."""
    return "Built in: " + ", ".join(f"`{json.dumps(name)}`" for name in BUILTIN) + " (adding one: DEVELOPERS.md)."


INTRO = f"""\
# Configuration reference

<!-- Generated from paratrain/config.py by `{COMMAND}`; do not edit by hand. -->

A run is described by a typed config (`paratrain/config.py`): one dataclass per section, read from a TOML file
(`paratrain train --config F.toml`) and then from `--section.key=value` overrides on the command line. An unknown
section or key is an error naming the closest valid one; every value is type-checked (choices included) and
range-checked before anything is launched or written. Each run saves its resolved config as
`runs/<name>/config.toml`, which `--config` reads back; `paratrain train --help` lists every key with its default.

```toml
[training]
steps = 500
precision = "bf16"

[parallel]
dp_mode = "hsdp"
dp_replicate = 2
```

A key shown as "unset" has no value by default (leave it out of the TOML file; on the command line `none` unsets
it). Sections: {{sections}}.
"""


def _section(name: str, cls, comments: dict[str, Comments], doc: str) -> list[str]:
    out = [f"## `[{name}]`", ""]
    if doc:
        out += [doc, ""]
    hints = typing.get_type_hints(cls)
    defaults = cls()
    registries = _registry_choices()
    model_defaults = {f.name: f.default for f in dataclasses.fields(model_args.ModelArgs)}  # MISSING: presets set it
    model_hints = typing.get_type_hints(model_args.ModelArgs)
    group = None
    header = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    rows: list[str] = []
    for f in dataclasses.fields(cls):
        c = comments.get(f.name, Comments())
        if c.group and c.group != group:
            if rows:
                out += [*header, *rows, ""]
                rows = []
            group = c.group
            out += [f"*{group}*", ""]
        kind = _type(hints[f.name])
        text = c.text
        choices = registries.get((name, f.name))
        if choices:
            kind = " \\| ".join(f"`{json.dumps(choice)}`" for choice, _ in choices)
            explained = "; ".join(f"`{choice}`: {what}" for choice, what in choices if what)
            text = f"{text}: {explained}" if text and explained else text or explained
        default = _value(getattr(defaults, f.name))
        if name == "model" and f.name in model_defaults:  # an override of the preset's ModelArgs field
            default = "the preset's"
            if model_defaults[f.name] is not dataclasses.MISSING:
                default += f" (else {_value(model_defaults[f.name])})"
            kind = _type(model_hints[f.name])
            if f.name == "family":
                text = f"{text} {_builtin_families()}"
        rows.append(f"| `{f.name}` | {kind} | {default} | {_cell(text)} |")
    out += [*header, *rows, ""]
    return out


def render() -> str:
    """docs/configuration.md."""
    comments = _source_comments(config)
    comments["ModelConfig"] = {**_source_comments(model_args)["ModelArgs"],
                               "preset": Comments(beside="A named model size (docs/models.md); the keys below "
                                                  "override its values."),
                               "init_from": Comments(beside='"hf:PATH" starts from a Hugging Face model folder '
                                                     "(docs/fine-tuning.md).")}
    sections = dataclasses.fields(config.Config)
    lines = [INTRO.replace("{sections}", ", ".join(f"[`[{s.name}]`](#{s.name})" for s in sections)), ""]
    for s in sections:
        cls = type(getattr(config.Config(), s.name))
        doc = cls.__doc__ or ""
        if doc.startswith(f"{cls.__name__}("):  # no docstring: dataclasses writes the signature there
            doc = ""
        if cls is config.ModelConfig:  # made by make_dataclass: the docstring of the function that makes it
            doc = _maker_docstring(config, cls.__name__)
        doc = _docstring_text(doc)
        own = comments["ModelConfig"] if cls is config.ModelConfig else section_comments(s.name, cls)
        lines += _section(s.name, cls, own, doc)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
