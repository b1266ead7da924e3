"""Every link in README.md and docs/*.md points at a file (and heading) inside the repository, none outside it."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
BARE = re.compile(r"(?:https?://|www\.)[^\s)>\]]+", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without code blocks and code spans (a URL shown as code is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target in a markdown text: inline, reference, autolinks and bare URLs that GitHub links."""
    body = prose(text)
    found = INLINE.findall(body) + REFERENCE.findall(body) + AUTOLINK.findall(body)
    rest = AUTOLINK.sub("", REFERENCE.sub("", INLINE.sub("", body)))
    return found + [url.rstrip(".,:;!?*_~'\"") for url in BARE.findall(rest)]  # as GitHub ends them


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """One line per link of `page` that leaves the repository `root` or points at nothing."""
    problems = []
    for target in links(page.read_text()):
        if SCHEME.match(target) or target.lower().startswith(("www.", "//")):
            problems.append(f"{target}: points outside the repository")
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.is_relative_to(root.resolve()):
            problems.append(f"{target}: points outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor.lower() not in anchors(file.read_text()):
            problems.append(f"{target}: no heading '#{anchor}' in {file.relative_to(root.resolve())}")
    return problems


def test_the_checker_finds_every_kind_of_link_and_each_fault(tmp_path):
    text = ("See [a](docs/a.md#two-words), ![img](pic.png 'title'), <https://x.org>, www.y.org and http://z.org.\n"
            "[ref]: ../outside.md\n```\n[not](a-link.md) http://in-code.org\n```\nand `http://in-span.org`.\n")
    assert links(text) == ["docs/a.md#two-words", "pic.png", "../outside.md", "https://x.org", "www.y.org",
                           "http://z.org"]
    assert anchors("# Two words\n## 5. Ports\n## `cs3 train`, end to end\n# Two words\n") == {
        "two-words", "5-ports", "cs3-train-end-to-end", "two-words-1"}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("# X\n[up](../../etc/passwd) [gone](nope.md) [ok](../README.md) "
                                            "[head](#nowhere) [here](#x) [web](https://x.org)\n")
    (tmp_path / "README.md").write_text("")
    assert broken(tmp_path / "docs" / "x.md", root=tmp_path) == [
        "../../etc/passwd: points outside the repository", "nope.md: no such file",
        "#nowhere: no heading '#nowhere' in docs/x.md", "https://x.org: points outside the repository"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_points_at_a_file_in_the_repository(page):
    assert broken(page) == []
