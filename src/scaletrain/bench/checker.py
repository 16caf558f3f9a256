"""Run MLCommons' compliance checker on an MLLOG file, as a subprocess, and read its verdict.

A subprocess, not an import: the checker keeps its include queue in a module global, configures the root logger
and reads argv at import time, so running it in-process would leak state between checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from scaletrain import benchmarks

__all__ = [
    "CheckResult",
    "check_log",
    "check_rcp",
    "checker_command",
    "proxy_rules_path",
    "run_benchmark",
    "run_ruleset",
    "RULESET",
    "ruleset",
    "known",
]

# gpt3's ruleset (kept for callers that name it); a run's own is `ruleset(name, cfg.bench.ruleset)`.
RULESET = benchmarks.DEFAULT_RULESET
_SUCCESS = re.compile(r"^\S+ - SUCCESS\s*$", re.MULTILINE)
_FAILED = re.compile(r"^\S+ - FAILED\s*$", re.MULTILINE)


@dataclass
class CheckResult:
    """The checker's verdict on one log."""

    ok: bool
    """True only when the checker exited 0, printed SUCCESS, and printed no FAILED or traceback."""
    command: list[str]
    """The exact command line that was run."""
    output: str
    """Its stdout and stderr, concatenated (the reasons for a failure are here)."""

    def to_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def known() -> tuple[str, ...]:
    """Every benchmark with compliance rules: the official ones (checked against the package's own ruleset) and
    their proxies (checked with their packaged rules file)."""
    return benchmarks.names()


def ruleset(benchmark: str, requested: str = "") -> str:
    """The checker's --ruleset for a benchmark or its proxy: `requested` (bench.ruleset) when given, else the
    registry's fixed one (gpt3: 4.1.0), else the newest the installed mlperf-logging ships for it."""
    return benchmarks.resolve_ruleset(benchmark, requested)


def proxy_rules_path(benchmark: str = "gpt3-proxy"):
    """The packaged rules file of a proxy benchmark (a Traversable; see `check_log` for a real path)."""
    if not benchmarks.is_proxy(benchmark):
        proxies = sorted(b.proxy_name for b in benchmarks.BENCHMARKS.values() if b.has_proxy)
        raise ValueError(f"no proxy rules file for {benchmark!r}; proxies: {proxies}")
    name = benchmarks.get(benchmark).proxy_rules_file
    return resources.files("scaletrain.bench").joinpath("rules").joinpath(name)


def checker_command(
    log: str | Path,
    benchmark: str,
    config: str | Path | None = None,
    log_output: str | Path | None = None,
    rules: str = "",
) -> list[str]:
    """The checker command line for `benchmark` (official or proxy); `config` is the proxy rules path, `rules` the
    requested ruleset (bench.ruleset; "" = the benchmark's default)."""
    if benchmark not in known():
        raise ValueError(f"no compliance rules for benchmark {benchmark!r}; expected one of {sorted(known())}")
    cmd = [
        sys.executable,
        "-m",
        "mlperf_logging.compliance_checker",
        "--usage",
        "training",
        "--ruleset",
        ruleset(benchmark, rules),
        "--werror",
    ]
    if benchmarks.is_proxy(benchmark):
        if config is None:
            raise ValueError(f"{benchmark} needs its proxy rules file as config")
        # Absolute: the checker joins --config onto its own package directory, so a relative path would point there.
        cmd += ["--config", os.path.abspath(config)]
    if log_output is not None:
        cmd += ["--log_output", str(log_output)]
    return cmd + [str(log)]


def check_log(
    path: str | Path,
    benchmark: str,
    log_output: str | Path | None = None,
    timeout_s: float = 300.0,
    rules: str = "",
) -> CheckResult:
    """Check the MLLOG file `path` against the rules of `benchmark` with `--werror`.

    "gpt3", "llama2_70b_lora", "llama31_405b", "llama31_8b": the official rules of ruleset
    `ruleset(benchmark, rules)` (gpt3 4.1.0, the others the newest the package ships for them). "gpt3-proxy", "llama2_70b_lora-proxy": the same engine with
    `--config` = the packaged proxy rules file.
    The checker also appends its messages to a file (by default `compliance_checker.log` in the current directory);
    CheckResult.output already holds them, so that copy goes to os.devnull unless `log_output` names a file,
    which is then replaced (the checker itself would append to an old one).
    """
    path = Path(path)
    if log_output is None:
        log_output = os.devnull
    elif path.is_file():
        Path(log_output).unlink(missing_ok=True)
    with ExitStack() as stack:
        config = None
        if benchmarks.is_proxy(benchmark):
            # as_file gives a real path even from a zipped install; an ordinary install returns the file itself.
            config = stack.enter_context(resources.as_file(proxy_rules_path(benchmark)))
        cmd = checker_command(path, benchmark, config=config, log_output=log_output, rules=rules)
        if not path.is_file():
            return CheckResult(False, cmd, f"no such log file: {path}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            # TimeoutExpired carries bytes even with text=True (the output was never decoded).
            out = b"".join(x if isinstance(x, bytes) else x.encode() for x in (exc.stdout, exc.stderr) if x)
            return CheckResult(False, cmd, f"checker timed out after {timeout_s:g} s\n{out.decode(errors='replace')}")
        except OSError as exc:
            return CheckResult(False, cmd, f"could not run the checker: {exc}")
    output = (proc.stdout or "") + (proc.stderr or "")
    return CheckResult(verdict(proc.returncode, output), cmd, output)


def check_rcp(logs: list[str | Path], benchmark: str, rules: str = "", timeout_s: float = 300.0) -> CheckResult:
    """MLCommons' RCP checker on the MLLOGs of one submission (its N runs) of an official benchmark: do the runs,
    olympic-averaged, converge no faster than the reference convergence points allow at their GBS (interpolated
    between the two nearest RCP batch sizes when none matches)? Ruleset as `check_log`'s.

    The checker reads `result_*.txt` files from a directory, so the logs are copied into a temporary one as
    result_0.txt, result_1.txt, ... in the order given. Proxies have no RCPs: ValueError.
    """
    import shutil
    import tempfile

    if benchmark not in benchmarks.BENCHMARKS:
        raise ValueError(
            f"no reference convergence points for {benchmark!r}; expected one of {sorted(benchmarks.BENCHMARKS)}"
        )
    with tempfile.TemporaryDirectory(prefix="rcp_") as tmp:
        for i, log in enumerate(logs):
            shutil.copyfile(log, Path(tmp) / f"result_{i}.txt")
        cmd = [
            sys.executable,
            "-m",
            "mlperf_logging.rcp_checker",
            "--rcp_usage",
            "training",
            "--rcp_version",
            ruleset(benchmark, rules),
            "--log_output",
            os.devnull,
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return CheckResult(False, cmd, f"RCP checker timed out after {timeout_s:g} s")
    output = (proc.stdout or "") + (proc.stderr or "")
    ok = proc.returncode == 0 and "RCP test PASSED" in output and "Traceback (most recent call last)" not in output
    return CheckResult(ok, cmd, output)


def verdict(returncode: int, output: str) -> bool:
    """Pass only on exit 0 with a SUCCESS line and no FAILED line or traceback.

    The exit code alone is not enough: a rules file the checker cannot find is reported as a message and a crash
    inside a rules file's code may be swallowed; the SUCCESS line alone is not enough if the process died later.
    """
    return (
        returncode == 0
        and bool(_SUCCESS.search(output))
        and not _FAILED.search(output)
        and "Traceback (most recent call last)" not in output
    )


def run_benchmark(run_dir: str | Path) -> str | None:
    """`bench.benchmark` from the config.json of a run directory, or None when there is none to read."""
    return _run_bench_field(run_dir, "benchmark") or None


def run_ruleset(run_dir: str | Path) -> str:
    """`bench.ruleset` from the config.json of a run directory; "" (the benchmark's default) when there is none."""
    return _run_bench_field(run_dir, "ruleset")


def _run_bench_field(run_dir: str | Path, name: str) -> str:
    from scaletrain.config_io import load_json_bounded

    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return ""
    try:  # bounded: a 10^5-deep file is a RecursionError for the plain parser
        value = load_json_bounded(path).get("bench", {}).get(name)
    except (ValueError, AttributeError):
        raise ValueError(f"{path}: not a scaletrain config.json; pass --benchmark NAME") from None
    return value if isinstance(value, str) else ""
