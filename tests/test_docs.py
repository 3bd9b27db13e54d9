"""The README is a front page and the method lives in docs/: its size, how it starts, that no section of the
README it replaced was lost (every heading of it is reachable from the new one through links), that relative
links resolve, and that docs/params.md is what its generator writes."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from conftest import REPO

README = REPO / "README.md"
MAX_README_CHARS = 15_000

# The section headings of the README before it was cut to a front page (`git show 6935c96:README.md`, 57,803
# characters, headings outside code blocks). Each must still be a heading of the README or of a page the
# README reaches through relative links: its text moved, it was not dropped.
OLD_README_HEADINGS = [
    "voxdiff",
    "What `make demo` does",
    "What should I set accumulate_every to?",
    "Compare runs",
    "Run a grid on several machines",
    "How the accumulation is made exact",
    "Resume",
    "Your own data",
    "GPUs and many processes",
    "Measured",
    "Development",
]

_LINK = re.compile(r"(?<!\\)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def headings(path: Path) -> list[str]:
    return [re.sub(r"^#+\s*", "", line).strip() for line in prose(path.read_text()) if re.match(r"^#{1,6}\s", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[|\]\([^)]*\)", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def links(path: Path) -> list[str]:
    """The link targets in a Markdown file's prose (inline code spans left out)."""
    found = []
    for line in prose(path.read_text()):
        found += _LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def reachable(start: Path) -> list[Path]:
    """Markdown files reachable from `start` through relative links, start included (breadth first)."""
    seen, todo = [start], [start]
    while todo:
        page = todo.pop(0)
        for target in links(page):
            path = unquote(target.split("#", 1)[0])
            if not path or not relative(target) or not path.endswith(".md"):
                continue
            dest = (page.parent / path).resolve()
            if dest.is_file() and dest.is_relative_to(REPO.resolve()) and dest not in seen:
                seen.append(dest)
                todo.append(dest)
    return seen


def test_readme_is_a_front_page_that_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text) <= MAX_README_CHARS, f"README.md is {len(text)} characters, more than {MAX_README_CHARS}"
    lines = text.splitlines()
    assert lines[0] == "# voxdiff"
    first = next(i for i, line in enumerate(lines) if line.strip())
    body = [line for line in lines[first + 1:] if line.strip()]
    assert body[0] == "```bash", body[:3]
    block = body[1:body.index("```")]
    assert [line.split("#")[0].strip() for line in block] == ["make demo", "make test"], block
    order = ["What voxdiff answers", "The answer", "What `make demo` does", "Everyday commands"]
    found = [h for h in headings(README) if h in order]
    assert found == order, found


def test_every_heading_of_the_old_readme_is_reachable_from_the_new_one():
    pages = reachable(README)
    assert REPO / "docs" / "params.md" in pages
    found = {h for page in pages for h in headings(page)}
    lost = [h for h in OLD_README_HEADINGS if h not in found]
    assert not lost, f"headings of the old README that no page reachable from README.md holds: {lost}"


def test_relative_links_resolve():
    """In README.md and docs/*.md: every relative link names an existing file, and an anchor into a
    Markdown file names one of its headings."""
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in links(page):
            if not relative(target):
                continue
            path, _, anchor = unquote(target).partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_docs_pages_open_with_what_a_user_does():
    """Each page the README links into docs/ starts, within its first lines, with a command or a setting to
    run or edit (a code block or a command in backticks), not with method."""
    for page in sorted((REPO / "docs").glob("*.md")):
        head = "\n".join(page.read_text().splitlines()[:12])
        assert "```" in head or re.search(r"`(make|dvc|voxdiff|python|torchrun|git) ", head), page.name


def test_params_page_is_the_generators_output():
    """docs/params.md is generated from params.py's schema and params.yaml's comments: a key added, removed or
    re-commented without `make docs` fails here."""
    from voxdiff import paramsdoc
    from voxdiff.params import SCHEMA

    page = (REPO / "docs" / "params.md").read_text()
    assert page == paramsdoc.markdown((REPO / "params.yaml").read_text()), (
        "docs/params.md is out of date: run `make docs` (python -m voxdiff.paramsdoc --out docs/params.md)")
    for section, spec in SCHEMA.items():
        for key in (spec if isinstance(spec, dict) else [None]):
            name = f"{section}.{key}" if key else section
            assert f"| `{name}` |" in page, name
