"""Olympic scoring: drop fastest and slowest, mean of the rest; at most one non-converged run, counted as slowest."""

from __future__ import annotations

import pytest

from scaletrain.bench.score import RunTime, olympic_score


def test_three_runs_score_the_median():
    s = olympic_score([(300.0, True), (100.0, True), (200.0, True)])
    assert s.score_s == 200.0 and s.dropped == [0, 1] and s.n_runs == 3 and s.n_converged == 3
    assert s.score_min == pytest.approx(200.0 / 60) and s.reason is None


def test_five_runs_average_the_middle_three():
    s = olympic_score([RunTime(t, True) for t in (50.0, 10.0, 20.0, 40.0, 30.0)])
    assert s.score_s == pytest.approx(30.0) and s.dropped == [0, 1]


def test_one_non_converged_run_counts_as_the_slowest():
    # The failed run was the fastest on the clock; it must still be the one dropped as slowest.
    s = olympic_score(
        [
            {"time_to_train_s": 1.0, "status": "aborted"},
            {"time_to_train_s": 300.0, "status": "success"},
            {"time_to_train_s": 100.0, "status": "success"},
        ]
    )
    assert s.score_s == 300.0 and s.dropped == [0, 2] and s.n_converged == 2


def test_two_non_converged_runs_give_no_score():
    s = olympic_score([(100.0, True), (None, False), (50.0, False), (120.0, True), (130.0, True)])
    assert s.score_s is None and s.score_min is None and "2 runs did not converge" in s.reason
    assert s.n_converged == 3 and s.to_dict()["score_s"] is None


def test_too_few_runs_and_bad_times():
    assert "at least 3" in olympic_score([(1.0, True)]).reason
    with pytest.raises(ValueError, match="run 1"):
        olympic_score([(1.0, True), (None, True), (2.0, True)])
