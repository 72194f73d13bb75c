"""Check the relative links of the project's markdown: every ``[text](path#anchor)`` in README.md,
BENCHMARKS.md, CONTRIBUTING.md, docs/ and benchmarks/results/ must name a file or folder that exists, and an
anchor into a markdown file must be one of that file's headings, slugged as GitHub slugs them.

    python scripts/check_links.py            # prints one line per broken link, exits 1 if there is any

GitHub's anchor rules, as implemented here: the heading's text with its markdown removed (links keep their text,
code spans their content), lower-cased, every character that is not a letter, a digit, ``_``, ``-`` or a space
dropped, each space turned into ``-``; a heading whose slug appeared before in the same file gets ``-1``, ``-2``, ...
An ``<a id="...">`` or ``<a name="...">`` also defines an anchor. Links to web addresses are not checked, nor
links inside fenced code blocks or inline code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the files whose links are checked: single files and folders (their *.md, recursively)
SCOPE = ("README.md", "BENCHMARKS.md", "CONTRIBUTING.md", "docs", "benchmarks/results")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
#: [text](target) or [text](target "title"); the text may hold one level of brackets, as in [`a[b]`](x)
_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters and digits of any script, and _
    return text.replace(" ", "-")


def _lines_outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line not inside a fenced code block."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs (de-duplicated as GitHub does) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link in a markdown file."""
    out = []
    for number, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        bare = _INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), line)  # same length: offsets stay valid
        for match in _LINK.finditer(bare):
            target = line[match.start(3):match.end(3)]
            if target and not _EXTERNAL.match(target):
                out.append((number, target))
    return out


def markdown_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for entry in SCOPE:
        path = root / entry
        if path.is_dir():
            files.extend(sorted(path.rglob("*.md")))
        elif path.is_file():
            files.append(path)
    return files


def broken_links(root: Path = ROOT) -> list[str]:
    """One line per broken link: 'file:line: target: why'."""
    cache: dict[Path, set[str]] = {}
    problems = []
    for source in markdown_files(root):
        for number, target in links(source):
            where = f"{source.relative_to(root).as_posix()}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            dest = (source.parent / path_part).resolve() if path_part else source
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if not anchor or dest.suffix.lower() != ".md":
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root).as_posix()}")
    return problems


def main() -> int:
    problems = broken_links()
    for line in problems:
        print(line)
    checked = sum(len(links(p)) for p in markdown_files())
    print(f"{len(problems)} broken of {checked} relative links in {len(markdown_files())} files", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
