"""The README is a short front door whose links all lead somewhere; the docs site lists every page; the generated
reference pages (config fields, command line) are what scripts/gen_reference.py writes from the code now.

`mkdocs build --strict` (.ci/run) checks the links between docs pages too; these tests need no mkdocs (~3 s).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# A markdown link or image: [text](target) / ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of `page` to a file, outside code blocks (no URL, no bare #anchor)."""
    out, in_code = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            out.append((n, target))
    return out


def broken_links(page: Path) -> list[str]:
    """One line per link of `page` whose file does not exist."""
    problems = []
    for n, target in relative_links(page):
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            problems.append(f"{page.relative_to(ROOT)}:{n}: {target}: no such file")
    return problems


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, as paths under docs/."""
    return re.findall(r"^\s*- [^:\n]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    # The two commands, and a link to each tutorial and reference page.
    text = "\n".join(lines)
    assert "scaletrain data fetch && scaletrain bench" in text and "python3 -m pytest -q" in text
    targets = {t for _, t in relative_links(README)}
    for page in (
        "getting-started.md",
        "tutorials/own-data.md",
        "tutorials/lora.md",
        "tutorials/mlperf.md",
        "tutorials/cluster.md",
        "reference/config.md",
        "reference/cli.md",
        "reference/run-directory.md",
        "reference/exit-codes.md",
        "accuracy.md",
        "architecture.md",
    ):
        assert f"docs/{page}" in targets, f"README.md does not link docs/{page}"


def test_readme_and_docs_links_resolve():
    problems = [p for page in [README, *sorted(DOCS.rglob("*.md"))] for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a) [web](https://x.org) [anchor](#a)\n```\n[code](nowhere.md)\n```\n"
        "`[inline](nowhere.md)` [bad](missing.md) ![img](gone.png)\n"
    )
    assert [t for _, t in relative_links(page)] == ["there.md#a", "missing.md", "gone.png"]
    # broken_links names paths relative to the repository: use one inside it.
    assert len([t for _, t in relative_links(page) if not (tmp_path / t.split("#")[0]).exists()]) == 2


def test_every_docs_page_is_in_the_site_nav():
    listed = nav_pages()
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk, "mkdocs.yml's nav and docs/ differ"


def test_generated_reference_pages_are_current():
    gen = _load("gen_reference")
    problems = gen.stale()
    assert not problems, "run `python3 scripts/gen_reference.py`:\n" + "\n\n".join(problems)


def test_reference_covers_every_config_field_and_subcommand():
    from scaletrain.config import describe

    config_md = (DOCS / "reference" / "config.md").read_text()
    for name, _, _ in describe():
        assert f"| `{name}` |" in config_md, name
    assert "| `optim.lr` | `2e-05` | `0.001` | in (0, 1000] (a larger step diverges at once) |" in config_md
    cli_md = (DOCS / "reference" / "cli.md").read_text()
    for command in (
        "train",
        "bench",
        "bench check",
        "export",
        "data fetch",
        "data prepare",
        "report",
        "config",
        "predict",
        "plan",
        "sim validate",
        "sim calibrate",
        "sim plot",
    ):
        assert f"`scaletrain {command}`" in cli_md, command
