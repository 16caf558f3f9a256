"""Profiling on demand: a torch.profiler trace of chosen steps and a CUDA memory snapshot, into <run_dir>/profile/.

`train.profile_steps` ("A-B" or "N", global step numbers, inclusive) and `train.profile_ranks` ("0", "0,3", "all")
choose what is traced; `train.memory_snapshot` records the CUDA allocator's history over the same steps (the first
MEMORY_DEFAULT_STEPS steps of this process when profile_steps is ""). The loop wraps every engine.train_step in
`StepProfiler.step(n)` and calls `close()` at the end; with nothing asked for both are no-ops and torch.profiler is
never imported.

Files (rank R):
- trace_rankR_stepsA-B.pt.trace.json: Chrome trace-event JSON written by `profile.export_chrome_trace`; Perfetto
  (ui.perfetto.dev) and chrome://tracing open it, and the name ends in ".pt.trace.json" so TensorBoard's profiler
  plugin (torch-tb-profiler) finds it. Each profiled step is one "ProfilerStep#N" range, N the global step.
- memory_snapshot_rankR.UNTRUSTED.pickle: torch.cuda.memory._dump_snapshot's native format, a pickle (load it only
  from a source you trust; pytorch.org/memory_viz reads it in the browser without running it), and beside it
  memory_snapshot_rankR.json, a pickle-free summary (peaks, top allocations) written by `memory_summary`.

The profiler only observes: it draws no random numbers and changes no kernel, so a profiled run trains exactly as an
unprofiled one. Its overhead is in the profiled steps' step_time_s and in the time to train, and so is the export
after the last profiled step. Steps before a resumed run's step are never profiled; a run that ends (or crashes)
inside the range writes what it traced, named by the steps it holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scaletrain.config import TrainConfig, parse_ranks, parse_step_range
from scaletrain.log import get_logger

log = get_logger(__name__)

__all__ = ["StepProfiler", "memory_summary", "MEMORY_DEFAULT_STEPS"]

MEMORY_DEFAULT_STEPS = 3
"""Steps of memory history when train.memory_snapshot is on and train.profile_steps is "": the first ones trained."""
TOP_ALLOCATIONS = 10
MAX_MEMORY_EVENTS = 100_000  # allocator history entries kept: bounds the snapshot of a long profiled range


class StepProfiler:
    """What the loop asks around each step: start/stop the trace and the memory history on this rank's chosen steps."""

    def __init__(self, train: TrainConfig, run_dir: str | Path, rank: int = 0, device: Any = None) -> None:
        """`rank`: this process's global rank; `device`: the engine's torch.device (None: CPU)."""
        ranks = parse_ranks(train.profile_ranks)
        chosen = ranks is None or rank in ranks
        self.rank, self.device, self.with_stack = rank, device, train.profile_with_stack
        self.out = Path(run_dir) / "profile"
        self.cuda = getattr(device, "type", None) == "cuda"
        self.trace_steps = parse_step_range(train.profile_steps) if chosen else None
        self.memory_steps = self.trace_steps
        self.memory = chosen and train.memory_snapshot
        if self.memory and not self.cuda:
            log.warning(
                "train.memory_snapshot: memory snapshots need CUDA and this run is on the CPU; no snapshot is "
                "taken, the run continues"
            )
            self.memory = False
        self._prof: Any = None
        self._traced: list[int] = []  # steps in the open trace
        self._recording = False  # the allocator's history is being recorded
        self._recorded: list[int] = []  # steps in it
        self._trace_done = self._memory_done = False
        self.files: list[Path] = []  # what this profiler wrote

    @property
    def enabled(self) -> bool:
        """Whether anything is asked of this rank."""
        return self.trace_steps is not None or self.memory

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Around engine.train_step of global step `n`."""
        if not self.enabled:
            yield
            return
        self._before(n)
        if self._prof is None:
            yield
        else:
            from torch.profiler import record_function

            self._traced.append(n)
            with record_function(f"ProfilerStep#{n}"):  # the step marker TensorBoard's plugin splits steps by
                yield
        if self._recording:
            self._recorded.append(n)
        self._after(n)

    def close(self) -> None:
        """End of the run: write what is still open (a run that stopped inside the range). Idempotent."""
        if self._prof is not None:
            self._write(self._write_trace)
        if self._recording:
            self._write(self._write_memory)

    def _before(self, n: int) -> None:
        if _inside(n, self.trace_steps) and self._prof is None and not self._trace_done:
            self._start_trace()
        if self.memory and not self._recording and not self._memory_done:
            if self.memory_steps is None:
                self.memory_steps = (n, n + MEMORY_DEFAULT_STEPS - 1)
            if _inside(n, self.memory_steps):
                import torch

                torch.cuda.memory._record_memory_history(
                    enabled="all", stacks="python", max_entries=MAX_MEMORY_EVENTS, device=self.device
                )
                self._recording = True

    def _after(self, n: int) -> None:
        if self._prof is not None and self.trace_steps is not None and n >= self.trace_steps[1]:
            self._write(self._write_trace)
        if self._recording and self.memory_steps is not None and n >= self.memory_steps[1]:
            self._write(self._write_memory)

    @staticmethod
    def _write(write: Any) -> None:
        # A full disk or a read-only run directory costs the profile, not the training run.
        try:
            write()
        except OSError as exc:
            log.warning(f"profile: could not write {exc.filename or 'a file'}: {exc.strerror or exc}")

    def _start_trace(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, record_shapes=True, with_stack=self.with_stack)
        self._prof.start()

    def _write_trace(self) -> None:
        prof, self._prof, self._trace_done = self._prof, None, True
        prof.stop()
        if not self._traced:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"trace_rank{self.rank}_steps{self._traced[0]}-{self._traced[-1]}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.files.append(path)
        log.info(f"profile: trace of steps {self._traced[0]}-{self._traced[-1]} written to {path}")

    def _write_memory(self) -> None:
        import torch

        steps, self._recording, self._memory_done = self._recorded, False, True
        base = self.out / f"memory_snapshot_rank{self.rank}"
        pickle_path = base.with_name(base.name + ".UNTRUSTED.pickle")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            snapshot = torch.cuda.memory._snapshot(self.device)
            with torch.cuda.device(self.device):  # _dump_snapshot takes the current device's
                torch.cuda.memory._dump_snapshot(str(pickle_path))  # the format memory_viz reads: a pickle
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        peaks = {
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
        }
        summary = memory_summary(snapshot, peaks, steps, pickle_path.name)
        json_path = base.with_suffix(".json")
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        self.files += [pickle_path, json_path]
        log.info(f"profile: memory snapshot written to {pickle_path}, its summary to {json_path}")


def _inside(n: int, steps: tuple[int, int] | None) -> bool:
    return steps is not None and steps[0] <= n <= steps[1]


def memory_summary(snapshot: dict, peaks: dict, steps: list[int], pickle_name: str) -> dict:
    """Pickle-free summary of a torch.cuda.memory._snapshot() dict: peaks since the run's start (`peaks`), what the
    allocator held at the dump (reserved segments, allocated blocks) and the largest allocations recorded in the
    history, each with the innermost frame of this project (or the innermost frame) that made it."""
    segments = snapshot.get("segments", [])
    blocks = [b for s in segments for b in s.get("blocks", [])]
    allocs = [e for trace in snapshot.get("device_traces", []) for e in trace if e.get("action") == "alloc"]
    allocs.sort(key=lambda e: -int(e.get("size", 0)))
    return {
        "steps": [steps[0], steps[-1]] if steps else [],
        "snapshot_file": pickle_name,
        **peaks,
        "reserved_bytes_at_dump": sum(int(s.get("total_size", 0)) for s in segments),
        "allocated_bytes_at_dump": sum(int(b.get("size", 0)) for b in blocks if b.get("state") == "active_allocated"),
        "segments": len(segments),
        "alloc_events": len(allocs),
        "top_allocations": [
            {"size_bytes": int(e.get("size", 0)), "frame": _frame(e.get("frames", []))}
            for e in allocs[:TOP_ALLOCATIONS]
        ],
    }


def _frame(frames: list[dict]) -> str:
    if not frames:
        return ""
    ours = [f for f in frames if "scaletrain" in str(f.get("filename", ""))]
    f = (ours or frames)[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
