#!/usr/bin/env python3
"""Keep every command output shown in README.md and the docs/ pages equal to what the command prints now.

An output block is a fenced code block whose first line is `$ COMMAND`: each `$` line (with `\\` continuation
lines) is a command, and the lines up to the next `$` line are what it prints (stdout and stderr together, in
order). A block whose commands show no output at all is a list of commands, not an output block, and is left
alone. A line that is exactly `...` stands for any number of output lines (the README shows the head and the tail
of a long output); at most one per command.

    python3 scripts/readme_outputs.py --check            # exit 1 and a diff when a block is stale
    python3 scripts/readme_outputs.py --update           # rewrite the deterministic blocks in place
    python3 scripts/readme_outputs.py --update --timed   # also re-run the timed ones (benchmarks, minutes)
    python3 scripts/readme_outputs.py --check docs/accuracy.md   # only the pages named

The pages are README.md and every docs/**/*.md. Timed blocks (`scaletrain bench`, `benchmarks/*.py`,
`sim validate --cv`, or any block under a line that starts "Measured on": their numbers are wall-clock
measurements) are skipped unless --timed, and each must say the machine it was measured on in the last non-blank
line above its fence, a line starting "Measured on" (--check fails on one that does not). Commands run from the repository root with this checkout's `src/` first on PYTHONPATH, a leading
`scaletrain` run as `python3 -m scaletrain`, `COLUMNS=120` (rich tables wrap to the terminal width) and unbuffered
output. The only normalisations: trailing whitespace on each line and trailing blank lines are dropped, and this
checkout's absolute path is written as `.`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MEASURED_ON = "Measured on"
ELLIPSIS = "..."
WIDTH = 120
# Outputs that are measurements (wall-clock timings): regenerated only on request.
# Timed: benchmarks (minutes of training) and the cross-validated fit (one refit per calibration row).
TIMED = (
    re.compile(r"^scaletrain bench(?! check)\b"),
    re.compile(r"^python3 benchmarks/"),
    re.compile(r"^scaletrain sim validate --cv\b"),
)
FENCE = re.compile(r"^(```+)")


@dataclass
class Command:
    """One `$` command of a block and the output the README shows for it."""

    text: str
    """The command as one line (continuations joined)."""
    source: list[str]
    """The README lines of the command itself, kept verbatim on update."""
    shown: list[str] = field(default_factory=list)
    """The output lines shown in the README."""

    @property
    def timed(self) -> bool:
        """True for a command whose output is a measurement."""
        return any(p.search(self.text) for p in TIMED)


@dataclass
class Block:
    """An output block: the README line numbers of its body (0-based, end exclusive) and its commands."""

    start: int
    end: int
    commands: list[Command]
    measured_on: str = ""
    """The "Measured on ..." line above the block's fence, if there is one."""

    @property
    def timed(self) -> bool:
        """True for a block whose outputs are measurements: a timed command, or a "Measured on" line above it."""
        return bool(self.measured_on) or any(c.timed for c in self.commands)

    @property
    def title(self) -> str:
        """The block's first command, shortened, for messages."""
        text = self.commands[0].text
        return text if len(text) <= 90 else text[:87] + "..."


def parse_blocks(lines: list[str]) -> list[Block]:
    """Every output block of a README given as lines (without newlines)."""
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].startswith(m.group(1)) and not lines[j].strip("`")),
            len(lines),
        )
        body = lines[i + 1 : end]
        if body and body[0].startswith("$ "):
            commands = _commands(body)
            if any(c.shown for c in commands):
                above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                blocks.append(Block(i + 1, end, commands, above if above.startswith(MEASURED_ON) else ""))
        i = end + 1
    return blocks


def _commands(body: list[str]) -> list[Command]:
    commands: list[Command] = []
    j = 0
    while j < len(body):
        if body[j].startswith("$ "):
            source = [body[j]]
            while source[-1].endswith("\\") and j + 1 < len(body):
                j += 1
                source.append(body[j])
            text = " ".join(s.rstrip("\\").strip() for s in source)[2:].strip()
            commands.append(Command(text, source))
        else:
            commands[-1].shown.append(body[j])
        j += 1
    return commands


def normalize(text: str) -> list[str]:
    """Output lines as compared: this checkout's path as `.`, no trailing whitespace, no trailing blank lines."""
    lines = [ln.rstrip() for ln in text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run(command: str, timeout_s: float = 600.0) -> list[str]:
    """Run one README command from the repository root; its stdout and stderr, in order, normalised."""
    argv = command
    if argv.startswith("scaletrain "):
        argv = f"{sys.executable} -m scaletrain {argv[len('scaletrain ') :]}"
    elif argv.startswith("python3 "):
        argv = f"{sys.executable} {argv[len('python3 ') :]}"
    env = dict(os.environ, COLUMNS=str(WIDTH), LINES="50", PYTHONUNBUFFERED="1", TERM="dumb")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run(
        ["bash", "-c", argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    return normalize(proc.stdout)


def _trimmed(shown: list[str]) -> list[str]:
    shown = [ln.rstrip() for ln in shown]
    while shown and not shown[-1]:
        shown.pop()
    return shown


def matches(shown: list[str], actual: list[str]) -> bool:
    """True when the README's lines equal the output, a `...` line standing for any run of lines."""
    shown = _trimmed(shown)
    if ELLIPSIS not in shown:
        return shown == actual
    k = shown.index(ELLIPSIS)
    head, tail = shown[:k], shown[k + 1 :]
    return (
        ELLIPSIS not in tail
        and len(head) + len(tail) <= len(actual)
        and actual[: len(head)] == head
        and actual[len(actual) - len(tail) :] == tail
    )


def refreshed(shown: list[str], actual: list[str]) -> list[str]:
    """What to show for `actual`: all of it, or as many head and tail lines as the README showed around `...`."""
    shown = _trimmed(shown)
    if ELLIPSIS not in shown:
        return actual
    head = shown.index(ELLIPSIS)
    tail = len(shown) - head - 1
    if head + tail >= len(actual):
        return actual
    return [*actual[:head], ELLIPSIS, *(actual[len(actual) - tail :] if tail else [])]


def selected(blocks: list[Block], timed: bool) -> list[Block]:
    """The blocks to run: all of them with `timed`, else those without a timed command."""
    return [b for b in blocks if timed or not b.timed]


def pages() -> list[Path]:
    """Every page whose output blocks are kept current: README.md, then docs/**/*.md in name order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def unlabelled(page: Path) -> list[str]:
    """One line per timed block of `page` that does not say the machine it was measured on."""
    return [
        f'{_name(page)}:{b.start}: timed block `$ {b.title}` has no "{MEASURED_ON} ..." line above it'
        for b in parse_blocks(page.read_text().splitlines())
        if b.timed and not b.measured_on
    ]


def _name(page: Path) -> str:
    try:
        return str(page.resolve().relative_to(ROOT))
    except ValueError:
        return page.name


def run_blocks(blocks: list[Block], jobs: int = 2) -> dict[tuple[int, int], list[str]]:
    """(block index, command index) -> actual output: the deterministic commands `jobs` at a time, then the timed
    ones one by one in page order (a measurement needs the machine to itself, and a tutorial's steps build on the
    previous ones)."""
    keys = [(bi, ci) for bi, b in enumerate(blocks) for ci in range(len(b.commands))]
    free = [k for k in keys if not blocks[k[0]].timed]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outs = dict(zip(free, pool.map(lambda k: run(blocks[k[0]].commands[k[1]].text), free)))
    for k in keys:
        if blocks[k[0]].timed:
            outs[k] = run(blocks[k[0]].commands[k[1]].text, timeout_s=3600.0)
    return outs


def _as_pages(readme: Path | list[Path] | None) -> list[Path]:
    if readme is None:
        return pages()
    return [readme] if isinstance(readme, Path) else list(readme)


def _run_pages(paths: list[Path], timed: bool, jobs: int) -> list[tuple[Path, list[Block], dict]]:
    """Each page with its selected blocks and their outputs; the commands of all pages share one pool."""
    per_page = [(p, selected(parse_blocks(p.read_text().splitlines()), timed)) for p in paths]
    every = [b for _, blocks in per_page for b in blocks]
    actual = run_blocks(every, jobs)
    out, k = [], 0
    for path, blocks in per_page:
        out.append(
            (
                path,
                blocks,
                {(bi, ci): actual[k + bi, ci] for bi, b in enumerate(blocks) for ci in range(len(b.commands))},
            )
        )
        k += len(blocks)
    return out


def check(readme: Path | list[Path] | None = README, timed: bool = False, jobs: int = 2) -> list[str]:
    """A unified diff per stale command output of the pages (None: all of them); empty when every selected block
    is current."""
    problems = []
    for path, blocks, actual in _run_pages(_as_pages(readme), timed, jobs):
        for bi, block in enumerate(blocks):
            for ci, cmd in enumerate(block.commands):
                if not matches(cmd.shown, actual[bi, ci]):
                    diff = difflib.unified_diff(
                        cmd.shown,
                        refreshed(cmd.shown, actual[bi, ci]),
                        f"{_name(path)}:{block.start + 1} (shown)",
                        f"$ {cmd.text} (now)",
                        lineterm="",
                    )
                    problems.append("\n".join(diff))
    return problems


def update(readme: Path | list[Path] | None = README, timed: bool = False, jobs: int = 2) -> int:
    """Rewrite the stale output blocks of the pages (None: all of them) in place; returns how many command outputs
    changed."""
    changed = 0
    for path, blocks, actual in _run_pages(_as_pages(readme), timed, jobs):
        lines = path.read_text().splitlines()
        for bi in reversed(range(len(blocks))):  # from the end, so earlier line numbers stay valid
            block, body = blocks[bi], []
            for ci, cmd in enumerate(block.commands):
                out = actual[bi, ci]
                if matches(cmd.shown, out):
                    body += [*cmd.source, *cmd.shown]
                else:
                    body += [*cmd.source, *refreshed(cmd.shown, out)]
                    changed += 1
            lines[block.start : block.end] = body
        if blocks:
            path.write_text("\n".join(lines) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command line: --check or --update."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print each output block found and exit")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when a README output is stale")
    mode.add_argument("--update", action="store_true", help="rewrite stale README outputs in place")
    p.add_argument("--timed", action="store_true", help="include timed blocks (benchmarks; minutes)")
    p.add_argument("pages", nargs="*", type=Path, help="pages to check (default README.md and docs/**/*.md)")
    p.add_argument("--readme", type=Path, action="append", help="a page to check (same as naming it; repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="commands run at a time (default 2)")
    args = p.parse_args(argv)
    paths = [*args.pages, *(args.readme or [])] or pages()
    for path in paths:
        if not path.is_file():
            p.error(f"{path}: no such page")
    if args.list:
        for path in paths:
            for b in parse_blocks(path.read_text().splitlines()):
                kind = "timed" if b.timed else "checked"
                print(f"{_name(path)}:{b.start}: {kind}: " + " | ".join(c.text for c in b.commands))
        return 0
    t0 = time.perf_counter()
    if args.check:
        problems = [*(line for path in paths for line in unlabelled(path)), *check(paths, args.timed, args.jobs)]
        for problem in problems:
            print(problem)
        n = sum(len(selected(parse_blocks(path.read_text().splitlines()), args.timed)) for path in paths)
        print(
            f"{len(paths)} pages: {n} output blocks run, {len(problems)} problems ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
        return 1 if problems else 0
    changed = update(paths, args.timed, args.jobs)
    print(f"{len(paths)} pages: {changed} outputs rewritten ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
