"""Every deterministic command output shown in README.md is what the command prints now (~30 s: two dry runs).

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

SAMPLE = '''# demo

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
'''


def test_blocks_are_found_by_their_dollar_line():
    blocks = ro.parse_blocks(SAMPLE.splitlines())
    assert [[c.text for c in b.commands] for b in blocks] == [
        ["python3 -c \"print('a'); print('b')\""],
        ['python3 -c "import sys; print(\'x\'); sys.stdout.flush(); sys.exit(\'bad input\')"',
         'python3 -c "print(*range(10), sep=chr(10))"'],
        ["scaletrain bench"]]
    assert [c.timed for b in blocks for c in b.commands] == [False, False, False, True]
    assert len(ro.selected(blocks, timed=False)) == 2


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


def test_readme_outputs_are_current():
    problems = ro.check(ro.README)
    assert not problems, ("README.md output blocks are stale; run `python3 scripts/readme_outputs.py --update`:\n"
                          + "\n\n".join(problems))
