"""The docs stay true to the tree: every relative link in README.md and docs/ names a file that exists and, for a
markdown target, a heading that is there (GitHub's anchor rules), and every `MSTAR_*` environment switch that the
code reads is named somewhere in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("mstar", "mstar_common", "mstar_kernels", "backends", "ensembles", "scripts")

# Names the code uses that are not switches for a user: a placeholder in a usage message, the variable a
# multi-worker proxy hands its own settings to its workers in, and the one a stub names its engine process's log in.
INTERNAL = {"MSTAR_KEY", "MSTAR_PROXY_SETTINGS", "MSTAR_ENGINE_LOG_NAME"}

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def heading_anchor(text: str) -> str:
    """GitHub's anchor for a heading: code marks and link targets dropped, lower case, punctuation other than
    `-` and `_` removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated heading gets `-1`, `-2`, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match:
            slug = heading_anchor(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(path: Path):
    """(line number, target) for each link outside fenced code that is not a URL."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for match in _LINK.finditer(line):
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                yield number, target


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part) if file_part else path
        if not resolved.exists():
            broken.append(f"{path.relative_to(ROOT)}:{number}: no file {target}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{path.relative_to(ROOT)}:{number}: no heading for #{fragment} in {resolved.name}")
    return broken


def test_heading_anchors_follow_github():
    assert heading_anchor("At a glance (2026-12-04, code 0fa7873)") == "at-a-glance-2026-12-04-code-0fa7873"
    assert heading_anchor("The step's head and tail, `mstar bench` & the [proxy](x.md)") == (
        "the-steps-head-and-tail-mstar-bench--the-proxy")
    assert heading_anchor("FLUX.2 [klein] 4B shapes (issue #6)") == "flux2-klein-4b-shapes-issue-6"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Real heading\n\n## Twice\n\n## Twice\n")
    page.write_text("[ok](other.md#real-heading) [ok](other.md#twice-1) [gone](missing.md) "
                    "[bad](other.md#no-such) [url](https://example.com/x)\n```\n[in code](nowhere.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["page.md:1: no file missing.md", "page.md:1: no heading for #no-such in other.md"]
    finally:
        ROOT = saved


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_every_environment_switch_the_code_reads_is_documented():
    used: dict[str, str] = {}
    for folder in CODE_DIRS:
        for source in sorted((ROOT / folder).rglob("*")):
            if source.suffix in (".py", ".sh") and source.is_file():
                for name in re.findall(r"\bMSTAR_[A-Z0-9_]*[A-Z0-9]\b", source.read_text()):
                    used.setdefault(name, str(source.relative_to(ROOT)))
    assert len(used) > 20, "the scan found too few switches to be reading the code"
    documented = "\n".join(path.read_text() for path in DOCS)
    missing = {name: where for name, where in used.items() if name not in INTERNAL and name not in documented}
    assert missing == {}, f"switches read by the code but named nowhere in README.md or docs/: {missing}"
