"""Every deterministic command output shown in README.md and docs/**/*.md is what the command prints now (~30 s on
an idle 2-core machine: three dry runs, the in-sample fit, a dozen predictions), and every timed block names the
machine it was measured on.

scripts/readme_outputs.py does the work; `--update` rewrites the blocks this test finds stale.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_outputs", ROOT / "scripts" / "readme_outputs.py")
ro = importlib.util.module_from_spec(_spec)
sys.modules["readme_outputs"] = ro
_spec.loader.exec_module(ro)

SAMPLE = """# demo

```bash
$ python3 -c "print(1)"          # a list of commands, no output shown: never run
$ rm -rf /
```

```
$ python3 -c "print('a'); print('b')"
a
b
```

```
$ python3 -c "import sys; print('x'); sys.stdout.flush(); sys.exit('bad input')"
x
stale error
$ python3 -c "print(*range(10), sep=chr(10))"
0
1
...
9
```

```
$ scaletrain bench
...
a timed table
```

Measured on a toaster:

```
$ python3 -c "print(2)"
2
```
"""


def test_blocks_are_found_by_their_dollar_line():
    blocks = ro.parse_blocks(SAMPLE.splitlines())
    assert [[c.text for c in b.commands] for b in blocks] == [
        ["python3 -c \"print('a'); print('b')\""],
        [
            "python3 -c \"import sys; print('x'); sys.stdout.flush(); sys.exit('bad input')\"",
            'python3 -c "print(*range(10), sep=chr(10))"',
        ],
        ["scaletrain bench"],
        ['python3 -c "print(2)"'],
    ]
    assert [c.timed for b in blocks for c in b.commands] == [False, False, False, True, False]
    # A "Measured on" line above a block makes it timed, whatever its command.
    assert [b.timed for b in blocks] == [False, False, True, True]
    assert [b.measured_on for b in blocks] == ["", "", "", "Measured on a toaster:"]
    assert len(ro.selected(blocks, timed=False)) == 2


def test_a_timed_block_must_say_where_it_was_measured(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(SAMPLE)
    problems = ro.unlabelled(page)
    assert len(problems) == 1 and "scaletrain bench" in problems[0] and "Measured on" in problems[0]
    page.write_text(SAMPLE.replace("```\n$ scaletrain bench", "Measured on a 2-core box:\n\n```\n$ scaletrain bench"))
    assert ro.unlabelled(page) == []


def test_ellipsis_stands_for_any_run_of_lines():
    assert ro.matches(["0", "1", "...", "9"], [str(i) for i in range(10)])
    assert ro.matches(["0", "...", "9"], ["0", "9"])
    assert not ro.matches(["0", "1", "...", "8"], [str(i) for i in range(10)])
    assert not ro.matches(["0", "1"], ["0", "1", "2"])
    assert ro.refreshed(["a", "...", "b", "c"], [str(i) for i in range(10)]) == ["0", "...", "8", "9"]


def test_check_reports_a_stale_output_and_update_fixes_it(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(SAMPLE)
    problems = ro.check(readme)
    # Only the stale error message differs: stdout and stderr in order, the rest (with `...`) matches.
    assert len(problems) == 1 and "-stale error" in problems[0] and "+bad input" in problems[0]
    assert ro.update(readme) == 1
    text = readme.read_text()
    assert "x\nbad input\n$ python3" in text and "stale error" not in text
    assert text.replace("x\nbad input\n", "x\nstale error\n") == SAMPLE  # nothing else touched
    assert ro.check(readme) == []


def test_update_rewrites_every_page_given(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text('```\n$ python3 -c "print(1)"\nstale\n```\n')
    b.write_text('```\n$ python3 -c "print(2)"\nstale\n```\n')
    assert len(ro.check([a, b])) == 2
    assert ro.update([a, b]) == 2
    assert "\n1\n" in a.read_text() and "\n2\n" in b.read_text()


def test_the_pages_are_the_readme_and_every_docs_page():
    pages = ro.pages()
    assert pages[0] == ro.README
    assert ro.DOCS / "getting-started.md" in pages and ro.DOCS / "tutorials" / "cluster.md" in pages
    assert set(pages[1:]) == set(ro.DOCS.rglob("*.md"))


def test_timed_blocks_say_where_they_were_measured():
    problems = [line for page in ro.pages() for line in ro.unlabelled(page)]
    assert not problems, "\n".join(problems)


def test_readme_and_docs_outputs_are_current():
    problems = ro.check(None)
    assert not problems, "output blocks are stale; run `python3 scripts/readme_outputs.py --update`:\n" + "\n\n".join(
        problems
    )
