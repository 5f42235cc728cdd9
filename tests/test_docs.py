"""The README and docs/*.md name only things that exist, and run tools one way.

Checked, statically (well under a second, nothing imports torch):
- every command in a fenced or indented code block, or an inline code span, that runs
  Python as ``.venv/bin/python -m X`` names a module X that resolves (the package
  ``boost_titan`` imports no torch, so ``find_spec`` of its submodules is cheap); a bare
  ``python -m`` is refused: the docs use ``.venv/bin/python -m`` everywhere, which works
  in a fresh shell after ``make train``;
- every ``make T`` names a target of the Makefile;
- every relative link and image points to an existing file inside the repository, and
  a ``#anchor`` into a markdown file names one of its headings (GitHub's slugs).

Not checked: that the commands run and do what the docs say. Each one imports torch and
torchtitan (and most launch ranks), minutes in all; the tests of each tool cover their
behaviour (e.g. tests/test_checkpoint_options.py runs the README's fine-tuning example).
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md"]

FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PY_MODULE = re.compile(r"([^\s(`'\"]*python[\w.]*) -m ([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?:^|[;&|]\s*|^\s*)make((?:\s+[A-Z_]+=\S+|\s+[a-z][\w-]*)*)")


def _code(text: str) -> list[str]:
    """Code lines: fenced blocks, indented blocks (4 spaces after a blank line), inline spans."""
    lines = [ln for block in FENCE.findall(text) for ln in block.splitlines()]
    prose = FENCE.sub("", text)
    prev_blank = True
    in_indented = False
    for ln in prose.splitlines():
        if (
            ln.startswith("    ")
            and (prev_blank or in_indented)
            and not ln.lstrip().startswith("-")
        ):
            in_indented = True
            lines.append(ln.strip())
        else:
            in_indented = False
        prev_blank = not ln.strip()
    lines += INLINE.findall(prose)
    return lines


def _slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w .-]+):(?!=)", text, re.M) for t in line.split()}


def test_python_commands_name_existing_modules_one_way():
    seen = 0
    for doc in DOCS:
        for line in _code(doc.read_text()):
            for interp, module in PY_MODULE.findall(line):
                where = f"{doc.relative_to(ROOT)}: {line.strip()!r}"
                assert interp == ".venv/bin/python", f"{where}: run Python as .venv/bin/python -m"
                assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
                seen += 1
    assert seen >= 20, f"only {seen} python -m commands found: the extraction is broken"


def test_make_targets_exist():
    targets = _make_targets()
    seen = 0
    for doc in DOCS:
        for line in _code(doc.read_text()):
            for m in MAKE.finditer(line):
                words = [w for w in m.group(1).split() if "=" not in w]
                for w in words:
                    assert w in targets, (
                        f"{doc.relative_to(ROOT)}: `make {w}` is no Makefile target"
                    )
                    seen += 1
    assert seen >= 2, "no make targets found: the extraction is broken"


def test_links_point_to_files_inside_the_repository():
    seen = 0
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: link {target}"
            assert dest.is_relative_to(ROOT), f"{where} points outside the repository"
            assert dest.exists(), f"{where}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{where}: no heading with that anchor"
            seen += 1
    assert seen >= 15, f"only {seen} links found: the extraction is broken"


def test_slug_matches_github():
    assert _slug("One-command GPU check (`benchmarks/gpu_check.sh`)") == (
        "one-command-gpu-check-benchmarksgpu_checksh"
    )
