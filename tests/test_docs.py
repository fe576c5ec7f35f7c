"""The documentation's own checks: docs/configuration.md is the generated configuration reference, the README stays
short, and every relative link of README.md and docs/*.md points at a file (and a heading) that exists. (The
documented commands and configs run in tests/test_journeys.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from paratrain import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200


def test_configuration_reference_is_current():
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file() and page.read_text() == config_reference.render(), (
        f"docs/configuration.md differs from the config dataclasses in paratrain/config.py: regenerate it with "
        f"`{config_reference.COMMAND}`")


def test_configuration_reference_has_every_key():
    import dataclasses

    from paratrain.config import Config

    page = config_reference.render()
    for section in dataclasses.fields(Config):
        assert f"## `[{section.name}]`" in page
        block = page.split(f"## `[{section.name}]`")[1].split("\n## ")[0]
        for f in dataclasses.fields(getattr(Config(), section.name)):
            assert f"| `{f.name}` |" in block, f"{section.name}.{f.name} is missing from the reference"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move the details "
                                       "to a page of docs/ and link it")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


def test_configuration_reference_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, paratrain.config_reference as c; c.render(); "
            "assert 'torch' not in sys.modules, 'paratrain.config_reference imports torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
