"""Run scaletrain as a fresh install would: every top-level module outside the allowed set is absent.

Started by tests/unit/test_declared_dependencies.py as `python declared_imports.py ALLOWED_JSON DATA_DIR STEP...`:
ALLOWED_JSON lists the top-level modules the declared requirements provide (stdlib and scaletrain are always
allowed). Steps: `modules` imports every scaletrain module, `help` runs `--help` of every subcommand, `bpe` runs
`data fetch --tokenizer bpe --excerpt`. Prints one JSON object: the refused imports that a scaletrain module made
(a failure even when scaletrain caught the ImportError) and the errors of the steps; exit 1 when either is non-empty.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


class Gate:
    """The only meta-path finder: it hands each import to the interpreter's own finders, except a top-level module
    outside `allowed`, which no finder gets to see. That is what absence looks like: `import x` raises
    ModuleNotFoundError, importlib.util.find_spec("x") returns None (libraries probe optional modules so)."""

    def __init__(self, allowed: set[str], finders: list) -> None:
        self.allowed, self.finders = allowed, finders
        self.by_scaletrain: set[str] = set()

    def permitted(self, top: str) -> bool:
        return (
            top in self.allowed
            or top in sys.stdlib_module_names
            or top.startswith("_sysconfigdata")  # the interpreter's build variables, part of the stdlib
            or top == "scaletrain"
            or top in sys.modules
        )

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if not self.permitted(top):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "") if frame is not None else ""
            if caller.startswith("scaletrain"):
                self.by_scaletrain.add(f"{fullname} (from {caller})")
            return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                return spec
        return None

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def main() -> int:
    allowed_file, data_dir, *steps = sys.argv[1:]
    with open(allowed_file) as f:
        finder = Gate(set(json.load(f)), list(sys.meta_path))
    sys.meta_path[:] = [finder]
    errors: list[str] = []
    if "modules" in steps:
        import pkgutil

        import scaletrain

        for mod in pkgutil.walk_packages(scaletrain.__path__, "scaletrain."):
            if mod.name == "scaletrain.__main__":  # importing it runs the CLI
                continue
            try:
                __import__(mod.name)
            except Exception:
                errors.append(f"import {mod.name}: {traceback.format_exc(limit=-3)}")
    from scaletrain.cli.main import build_parser, subcommand_parsers
    from scaletrain.cli.main import main as cli_main

    if "help" in steps:
        for path, _ in subcommand_parsers(build_parser()):
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    cli_main([*path, "--help"])
                errors.append(f"{' '.join(path)} --help: returned instead of exiting")
            except SystemExit as exc:
                if exc.code != 0:
                    errors.append(f"{' '.join(path)} --help: exit {exc.code}")
            except Exception:
                errors.append(f"{' '.join(path)} --help: {traceback.format_exc(limit=-3)}")
    if "bpe" in steps:
        argv = ["data", "fetch", "--tokenizer", "bpe", "--excerpt", "--vocab-size", "512", "--data-dir", data_dir]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(argv)
            if code != 0:
                errors.append(f"{' '.join(argv)}: exit {code}")
        except Exception:
            errors.append(f"{' '.join(argv)}: {traceback.format_exc(limit=-3)}")
    print(json.dumps({"refused_by_scaletrain": sorted(finder.by_scaletrain), "errors": errors}))
    return 1 if errors or finder.by_scaletrain else 0


if __name__ == "__main__":
    sys.exit(main())
