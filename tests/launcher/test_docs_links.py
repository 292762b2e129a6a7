"""Citations in code and docs point inside the repository.

Facts the code relies on live in docs/; a comment citing a file outside the repository (notes in
a sibling `shared/` folder, a design document that is not checked in) cannot be followed by a
reader of the repository alone, and a cited `docs/X.md` (or a section of it) must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("rlslurm", "tools", "tests")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".sh", ".j2", ".md", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".json", ""}

# Paths outside the repository that comments used to cite.
OUTSIDE = re.compile(r"(?<![\w-])shared/|\bDESIGN\.md\b|[\w-]+-notes\.md\b")
# `docs/X.md` (or `../../docs/X.md` from a nested README), but not `foo/docs/X.md` or a URL.
DOC_REF = re.compile(r"(?:(?<![\w./-])|(?<=\.\./))docs/([\w-]+(?:\.[\w-]+)*\.(?:md|png))")
# `docs/X.md, "Section"`, the section possibly on the next comment line.
SECTION_REF = re.compile(r"docs/([\w-]+(?:\.[\w-]+)*\.md),\s*(?:#\s*)?\"([^\"\n]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def outside_citations(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def missing_docs(text: str, docs_dir: Path) -> list[str]:
    """Cited docs files that do not exist, and cited sections with no such heading."""
    missing = [f"docs/{name}" for name in DOC_REF.findall(text) if not (docs_dir / name).is_file()]
    for name, section in SECTION_REF.findall(text):
        doc = docs_dir / name
        if doc.is_file() and section not in HEADING.findall(doc.read_text()):
            missing.append(f'docs/{name}, "{section}"')
    return missing


def scanned_files() -> list[Path]:
    files = [ROOT / f for f in SCANNED_FILES]
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                files.append(p)
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def test_the_checks_catch_bad_citations(tmp_path: Path):
    (tmp_path / "real.md").write_text("# Real\n\n## Weight updates\n")
    assert outside_citations("see ../shared/sglang-notes.md") == ["shared/", "sglang-notes.md"]
    assert outside_citations("rules (DESIGN.md)") == ["DESIGN.md"]
    assert outside_citations("run on shared storage, group-shared/ dirs, docs/real.md") == []
    assert missing_docs("(docs/gone.md) and [x](../../docs/also-gone.md)", tmp_path) == [
        "docs/gone.md", "docs/also-gone.md"]
    assert missing_docs('(docs/real.md,\n# "No such section")', tmp_path) == ['docs/real.md, "No such section"']
    assert missing_docs('(docs/real.md, "Weight updates"); https://x.org/docs/y.md; a/docs/z.md',
                        tmp_path) == []


def test_no_citation_leaves_the_repository():
    bad = []
    for p in scanned_files():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        rel = p.relative_to(ROOT)
        bad += [f"{rel}: cites {c} (outside the repository; cite docs/ instead)" for c in outside_citations(text)]
        bad += [f"{rel}: cites {c}, which does not exist" for c in missing_docs(text, ROOT / "docs")]
    assert not bad, "\n".join(bad)


# [text](target) links of Markdown, images included; a URL or an in-page #anchor is not a file
MD_LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")


def test_every_doc_is_in_the_index_and_every_link_resolves():
    """Issue 33: docs/README.md links every doc (7 of 18 were linked from nowhere), the README links
    the index, and a relative link in the README or a doc names a file that exists."""
    docs = ROOT / "docs"
    index = (docs / "README.md").read_text()
    linked = {target.split("#")[0] for _, target in MD_LINK.findall(index)}
    unlisted = sorted(p.name for p in docs.iterdir() if p.suffix in (".md", ".png") and p.name != "README.md"
                      and p.name not in linked)
    assert not unlisted, f"docs/README.md does not link: {unlisted}"
    assert "docs/README.md" in {t for _, t in MD_LINK.findall((ROOT / "README.md").read_text())}
    broken = []
    for md in [ROOT / "README.md", *sorted(docs.glob("*.md"))]:
        for _, target in MD_LINK.findall(md.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_shows_no_relative_picture():
    """On a package index the README is rendered without the repository: a relative image is a broken
    picture there (the project has no host to make it absolute), so the README names the picture's
    path in text instead of embedding it."""
    images = [t for bang, t in MD_LINK.findall((ROOT / "README.md").read_text()) if bang and "://" not in t]
    assert not images, images
