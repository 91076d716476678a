"""The documentation a new user follows: every relative link and #anchor lands, and the README and
the benchmark index stay guides of bounded size (issue 49). Reads files only: no network."""
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) and ![alt](target); the target stops at whitespace (an optional "title" follows).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "lake" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans, where links are live."""
    text = FENCE.sub("", text)
    return CODE_SPAN.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation other than `-` and `_`
    removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes in a markdown file: heading slugs (the n-th repeat gets -n) and
    explicit <a name/id> tags."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for _, title in HEADING.findall(FENCE.sub("", text)):
        base = slug(title)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(root)}: link ({target})"
        if not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{where}: no anchor #{anchor} in {dest.relative_to(root)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_github():
    assert slug("A lake on S3") == "a-lake-on-s3"
    assert slug("Off the engine's numerics") == "off-the-engines-numerics"
    assert slug("Scale-out: one GPU, several GPUs") == "scale-out-one-gpu-several-gpus"
    assert slug("The `games` table") == "the-games-table"


def test_a_broken_link_is_named(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n[ok](b.md#there) [gone](c.md) [bad](b.md#nowhere) [self](#top)\n"
                                   "`[code](x.md)`\n```\n[fenced](y.md)\n```\n")
    (tmp_path / "b.md").write_text("## There\n")
    problems = broken_links(tmp_path / "a.md", root=tmp_path)
    assert problems == ["a.md: link (c.md): no file c.md", "a.md: link (b.md#nowhere): no anchor #nowhere in b.md"]


def test_readme_is_a_short_guide():
    readme = ROOT / "README.md"
    size = readme.stat().st_size
    assert size <= 15_000, f"README.md is {size:,} bytes; the guide's bound is 15,000 (move detail into docs/)"
    head = "\n".join(readme.read_text(encoding="utf-8").splitlines()[:40])
    for command in ("make demo", "make test"):
        assert command in head, f"README.md: `{command}` is not in its first 40 lines"


def test_benchmarks_is_an_index():
    size = (ROOT / "BENCHMARKS.md").stat().st_size
    assert size <= 30_000, f"BENCHMARKS.md is {size:,} bytes; an index stays within 30,000 (one page per bench)"
