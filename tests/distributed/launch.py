"""Run a function on N gloo ranks in fresh processes, with a timeout and each rank's traceback on failure.

Every rank runs with the collective check on (`SCALETRAIN_CHECK_COLLECTIVES=1`, scaletrain/parallel/collective_check.py:
a non-contiguous tensor or one outside its storage handed to a c10d collective is a Python error, not gloo writing
through `data_ptr()`), and with faulthandler writing the Python stacks of all its threads to a file when it dies
from a signal; a native crash names that file and where a core file went.
"""

from __future__ import annotations

import faulthandler
import glob
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import socket
import tempfile
import traceback
from pathlib import Path

# The JSON-lines file each retried group is appended to (tests/conftest.py points it into the session's tmp dir and
# prints the count at the end of the run).
RETRY_LOG_ENV = "SCALETRAIN_NATIVE_CRASH_LOG"
CHECK_ENV = "SCALETRAIN_CHECK_COLLECTIVES"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks fork from one forkserver that imported torch and the trainer once for the whole session: a spawned rank
# spent 2-4 s of a 2-core machine importing them, and the distributed tests start over a hundred ranks.
# $SCALETRAIN_TEST_START_METHOD=spawn starts every rank from scratch instead (to rule the shared imports out).
PRELOAD = ["torch", "torch.distributed", "scaletrain.parallel.collective_check", "scaletrain.train.engine"]
START_ENV = "SCALETRAIN_TEST_START_METHOD"
_context = None


def _start_context():
    """The forkserver context, its server told to preload PRELOAD (it starts with the first group)."""
    global _context
    if _context is None:
        method = os.environ.get(START_ENV, "forkserver")
        if method not in ("forkserver", "spawn"):
            raise ValueError(f"${START_ENV}={method!r}: expected 'forkserver' or 'spawn'")
        _context = mp.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(PRELOAD)
    return _context


def _entry(fn, rank, world_size, port, args, queue, crash_dir, environ, cwd):
    # The caller's environment and directory as they are now, as a spawned process would get them (the
    # forkserver's are those of the first group's start).
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault(CHECK_ENV, "1")
    # Kept open for the life of the process: faulthandler writes to its descriptor from the signal handler.
    stacks = open(os.path.join(crash_dir, f"rank{rank}.stacks.txt"), "w")  # noqa: SIM115
    faulthandler.enable(file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    from scaletrain.parallel import collective_check

    torch.set_num_threads(1)  # N ranks share 2 cores; oversubscription only slows the test down
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        with collective_check.checking():
            result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class NativeCrash(AssertionError):
    """A rank died from a signal (SIGABRT, SIGSEGV) rather than a Python exception."""


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """fn(rank, world_size, *args) on every rank (importable, picklable); returns the per-rank results in order.

    Raises AssertionError with the failing ranks' tracebacks, or naming the ranks still running at the timeout. A
    rank killed by a signal, whose peers show nothing but the lost connection, gets one fresh attempt of the whole
    group, with a warning that says so, and the retry is recorded (`record_retry`) so that the end of the pytest run
    counts it: on the 2-core CI machine a rank of the 2-rank tensor-parallel case has aborted with a corrupted heap
    ("malloc(): unaligned tcache chunk detected", native code, no Python frame of its own) twice in about 50 runs,
    and not in 50 reruns with the collective check and glibc's heap checking on (docs/multinode.md, "A rank that
    dies natively"). The retry reruns the whole group from scratch, so a passing test never rests on the crashed
    attempt's numbers. A second crash, and any Python exception, fails the test as before.
    """
    try:
        return _run_once(fn, world_size, *args, timeout=timeout)
    except NativeCrash as crash:
        import warnings

        record_retry(
            os.environ.get("PYTEST_CURRENT_TEST", getattr(fn, "__name__", "?")).split(" ")[0], world_size, str(crash)
        )
        warnings.warn(
            f"a rank died from a signal; running all {world_size} ranks once more: {str(crash)[:300]}", stacklevel=2
        )
        return _run_once(fn, world_size, *args, timeout=timeout)


def record_retry(test_id: str, world_size: int, error: str, log: str | None = None) -> None:
    """Append one retried group to the retry log (`log`, or $SCALETRAIN_NATIVE_CRASH_LOG; nothing when unset)."""
    log = log or os.environ.get(RETRY_LOG_ENV)
    if not log:
        return
    with open(log, "a") as f:
        f.write(json.dumps({"test": test_id, "world_size": world_size, "error": error[:2000]}) + "\n")


def retry_summary(log: str | os.PathLike | None) -> str:
    """The end-of-run line: how many groups were retried after a native crash, and which tests.

    A missing or empty log is 0; a line that is not a JSON object still counts (as an unreadable record), so a retry
    is never hidden by a damaged log.
    """
    tests: list[str] = []
    if log and os.path.isfile(log):
        with open(log) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    tests.append(str(record["test"]))
                except (ValueError, TypeError, KeyError):
                    tests.append("<unreadable record>")
    head = f"distributed groups retried after a native crash: {len(tests)}"
    return f"{head} ({', '.join(tests)}; details in {log})" if tests else head


def _run_once(fn, world_size: int, *args, timeout: float) -> list:
    ctx = _start_context()
    queue = ctx.Queue()
    port = _free_port()
    log = os.environ.get(RETRY_LOG_ENV)
    crash_dir = tempfile.mkdtemp(prefix="ranks-", dir=os.path.dirname(log) if log else None)
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, args, queue, crash_dir, dict(os.environ), os.getcwd()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    keep = False
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                errors = {r: v for r, (s, v) in results.items() if s == "error"}
                raise AssertionError(
                    f"timeout after {timeout:.0f} s; ranks {missing} did not finish; errors so far: {errors}"
                )
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (status, value)
                if status == "error":  # one rank failed: the others may hang in a collective
                    time.sleep(1.0)
                    while True:
                        try:
                            r2, s2, v2 = queue.get_nowait()
                            results[r2] = (s2, v2)
                        except queue_mod.Empty:
                            break
                    errs = "\n".join(f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error")
                    codes = {i: p.exitcode for i, p in enumerate(procs)}
                    # The other ranks' errors follow a crashed one (its peers lose their connection): a signal
                    # among the exit codes, and no rank failing on its own, is a native crash.
                    crashed = any(c is not None and c < 0 for c in codes.values())
                    error = NativeCrash if crashed and _only_lost_peers(results) else AssertionError
                    raise error(
                        f"rank(s) failed (exit codes so far {codes}; a rank that died without a "
                        f"traceback shows a negative signal number):\n{errs}"
                    )
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    codes = [procs[i].exitcode for i in dead]
                    error = NativeCrash if all(c < 0 for c in codes) else AssertionError
                    raise error(f"rank(s) {dead} died with exit codes {codes}") from None
    except NativeCrash as crash:
        for p in procs:
            p.join(timeout=5)
        keep = True  # the dead rank's stacks stay for whoever reads the message
        raise NativeCrash(f"{crash}\n{_crash_evidence(procs, crash_dir)}") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if not keep:
            shutil.rmtree(crash_dir, ignore_errors=True)
    return [results[r][1] for r in range(world_size)]


def _crash_evidence(procs, crash_dir: str) -> str:
    """For each rank killed by a signal: the tail of its faulthandler stacks and where its core file went."""
    lines = []
    for rank, p in enumerate(procs):
        if p.exitcode is None or p.exitcode >= 0:
            continue
        stacks = Path(crash_dir) / f"rank{rank}.stacks.txt"
        text = stacks.read_text(errors="replace").strip() if stacks.is_file() else ""
        tail = "\n".join(text.splitlines()[-40:]) if text else "(faulthandler wrote nothing)"
        lines.append(
            f"rank {rank} (pid {p.pid}) died from signal {-p.exitcode}; Python stacks of its threads "
            f"({stacks}):\n{tail}\n{core_location(p.pid)}"
        )
    return "\n".join(lines)


def core_location(pid: int, pattern_file: str = "/proc/sys/kernel/core_pattern") -> str:
    """Where the kernel put (or would have put) the core file of process `pid`, in one line."""
    soft, _ = resource.getrlimit(resource.RLIMIT_CORE)
    if soft == 0:
        return "core file: none (RLIMIT_CORE is 0; `ulimit -c unlimited` keeps one, as .ci/run does)"
    try:
        pattern = Path(pattern_file).read_text().strip()
    except OSError as e:
        return f"core file: unknown ({pattern_file}: {e.strerror})"
    if pattern.startswith("|"):
        return f"core file: piped to {pattern[1:].split()[0]} (core_pattern {pattern!r})"
    # %p is the pid; every other specifier (%e executable, %t time, ...) matches anything.
    spec = re.sub(r"%(.)", lambda m: {"p": str(pid), "%": "%"}.get(m.group(1), "*"), pattern)
    path = spec if os.path.isabs(spec) else os.path.join(os.getcwd(), spec)
    found = sorted(glob.glob(path))
    if not found and "*" not in path and os.path.isfile(f"{path}.{pid}"):
        found = [f"{path}.{pid}"]  # kernel.core_uses_pid appends the pid to a pattern without %p
    return f"core file: {', '.join(found)}" if found else f"core file: not found at {path} (core_pattern {pattern!r})"


def _only_lost_peers(results: dict) -> bool:
    """Every Python error so far is a gloo connection lost to a peer (what a crashed peer leaves behind)."""
    errors = [v for s, v in results.values() if s == "error"]
    return all("Connection reset by peer" in v or "Connection closed by peer" in v for v in errors)
