"""MLPerf Training olympic scoring: drop the fastest and the slowest run, average the rest.

At most one run may fail to converge; it counts as the slowest and is therefore always dropped. With 3 runs the
score is the median; gpt3 uses 3 runs, llama2_70b_lora 10.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from scaletrain import benchmarks

__all__ = ["RunTime", "Score", "olympic_score", "MIN_RUNS", "required_runs"]

MIN_RUNS = 3  # dropping one fastest and one slowest needs at least one run left


def required_runs(benchmark: str) -> int:
    """Runs a submission of `benchmark` needs (its registry entry); a proxy follows its official benchmark."""
    name = benchmark.removesuffix("-proxy")
    if name not in benchmarks.BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; known: {sorted(benchmarks.BENCHMARKS)}")
    return benchmarks.BENCHMARKS[name].runs


@dataclass(frozen=True)
class RunTime:
    """One run as scoring sees it."""

    time_to_train_s: float | None
    converged: bool


@dataclass
class Score:
    """Olympic score of a set of runs; `score_s` is None when the set cannot be scored, and `reason` says why."""

    score_s: float | None
    n_runs: int
    n_converged: int
    dropped: list[int] = field(default_factory=list)
    """Indices (into the input order) of the fastest and the slowest run, the ones left out of the mean."""
    reason: str | None = None

    @property
    def score_min(self) -> float | None:
        """The score in minutes, the unit MLPerf publishes."""
        return None if self.score_s is None else self.score_s / 60.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON, with score_min added."""
        return {**asdict(self), "score_min": self.score_min}


def _as_run(item: Any) -> RunTime:
    if isinstance(item, RunTime):
        return item
    if isinstance(item, Mapping):
        ttt = item.get("time_to_train_s")
        conv = item.get("converged", item.get("status") == "success")
        return RunTime(ttt, bool(conv))
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return RunTime(item[0], bool(item[1]))
    return RunTime(item.time_to_train_s, bool(item.converged))


def olympic_score(results: Iterable[Any]) -> Score:
    """Score runs given as (time_to_train_s, converged) pairs, RunTime, or dicts with those keys (or "status").

    Converged runs need a finite time. A non-converged run's time is ignored: it ranks as the slowest.
    More than one non-converged run, or fewer than 3 runs, gives score None with the reason.
    """
    runs = [_as_run(r) for r in results]
    n = len(runs)
    ok = [i for i, r in enumerate(runs) if r.converged]
    failed = [i for i, r in enumerate(runs) if not r.converged]
    times: dict[int, float] = {}
    for i in ok:
        t = runs[i].time_to_train_s
        if t is None or not math.isfinite(t) or t < 0:
            raise ValueError(f"run {i} converged but has no valid time_to_train_s ({t!r})")
        times[i] = t

    def none(reason: str) -> Score:
        return Score(None, n, len(ok), [], reason)

    if n < MIN_RUNS:
        return none(f"olympic scoring needs at least {MIN_RUNS} runs, got {n}")
    if len(failed) > 1:
        return none(f"{len(failed)} runs did not converge (runs {failed}); at most one may")
    # Stable sort by time; ties keep input order, so the first of equal times is 'fastest' and the last 'slowest'.
    order = sorted(ok, key=lambda i: times[i])
    fastest = order[0]
    slowest = failed[0] if failed else order[-1]
    kept = [i for i in ok if i not in (fastest, slowest)]
    mean = sum(times[i] for i in kept) / len(kept)
    return Score(mean, n, len(ok), sorted({fastest, slowest}))
