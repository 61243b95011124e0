"""Every relative link in the README and docs/ leads somewhere: the file (or folder) exists,
and a `#fragment` names a heading of the page it points into, as GitHub renders it. Pages get
merged and renamed; a link left behind would otherwise only show when a reader clicks it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_LINK_TEXT = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def prose_lines(text: str) -> list[str]:
    """The page's lines, those of fenced code blocks blanked (a link or heading inside one is
    code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            line = ""  # kept blank, so line numbers stay those of the file
        lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation dropped
    (word characters, hyphens and spaces kept), spaces turned into hyphens."""
    text = INLINE_LINK_TEXT.sub(r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image in the page's prose."""
    out = []
    for number, line in enumerate(prose_lines(page.read_text(encoding="utf-8")), 1):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            out.append((number, m.group(1)))
    return out


def broken_links(pages: list[Path]) -> list[tuple[Path, int, str, str]]:
    """Every relative link of `pages` that leads nowhere: (page, line, target, why)."""
    broken = []
    for page in pages:
        for number, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path_part, _, fragment = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                broken.append((page, number, target, "no such file"))
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append((page, number, target, f"no heading #{fragment} in {dest.name}"))
    return broken


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = doc_pages()
    assert len(pages) > 10  # the docs are where this test thinks they are
    assert sum(len(links(p)) for p in pages) > 50
    broken = [
        f"{page.relative_to(ROOT)}:{line}: {target} ({why})"
        for page, line, target, why in broken_links(pages)
    ]
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_a_missing_page_and_a_missing_heading_are_reported(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text(
        "# Title\n\n## `nonfinite_sync`: one wait, when asked\n\n## Repeat\n\n## Repeat\n"
    )
    (tmp_path / "a.md").write_text(
        "# A\n\n"
        "[ok](sub/b.md) [ok](sub/b.md#nonfinite_sync-one-wait-when-asked) [ok](#a)\n"
        "[ok](sub/b.md#repeat-1) [ok](sub/) [ok](https://example.com/x.md#nowhere)\n"
        "`[code](nowhere.md)` and ![img](sub/b.md)\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](sub/c.md) [bad anchor](sub/b.md#no-such-heading) [here](#nothing-here)\n"
        "[third](sub/b.md#repeat-2)\n"
    )
    page = tmp_path / "a.md"
    assert broken_links([page]) == [
        (page, 9, "sub/c.md", "no such file"),
        (page, 9, "sub/b.md#no-such-heading", "no heading #no-such-heading in b.md"),
        (page, 9, "#nothing-here", "no heading #nothing-here in a.md"),
        (page, 10, "sub/b.md#repeat-2", "no heading #repeat-2 in b.md"),
    ]


def test_heading_slugs_follow_github():
    assert slug("`nonfinite_sync`: one wait per update, when asked") == (
        "nonfinite_sync-one-wait-per-update-when-asked"
    )
    assert slug("Closure steps (`optimizer.step(closure)`)") == "closure-steps-optimizerstepclosure"
    assert slug("See [the README](../README.md) first") == "see-the-readme-first"
