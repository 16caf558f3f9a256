"""MLLogWriter: real MLLOG lines, caller file/lineno, one private logger per file, nothing on stdout."""

from __future__ import annotations

import inspect
import logging

import pytest

from scaletrain.bench.mllog import C, MLLogWriter, read_mllog


def test_lines_are_mllog_and_name_the_caller(tmp_path, capsys):
    w = MLLogWriter(tmp_path / "a.txt")
    line = inspect.currentframe().f_lineno + 1
    t = w.event(C.SEED, 7)
    w.start(C.RUN_START, metadata={"x": 1})
    w.end(C.RUN_STOP, metadata={"status": C.SUCCESS}, time_ms=t + 5)
    w.close()
    ev = read_mllog(tmp_path / "a.txt")
    assert [e["event_type"] for e in ev] == ["POINT_IN_TIME", "INTERVAL_START", "INTERVAL_END"]
    assert ev[0]["key"] == "seed" and ev[0]["value"] == 7 and ev[0]["time_ms"] == t
    # The seed checker keys runs by (file, lineno): they must point here, not into the wrapper.
    assert ev[0]["metadata"] == {"file": __file__, "lineno": line}
    assert ev[1]["metadata"]["lineno"] == line + 1 and ev[1]["metadata"]["x"] == 1
    assert ev[2]["time_ms"] == t + 5 and ev[2]["metadata"]["status"] == "success"
    assert all(raw.startswith(":::MLLOG {") for raw in (tmp_path / "a.txt").read_text().splitlines())
    assert capsys.readouterr().out == ""


def test_stack_offset_names_a_wrapping_helpers_caller(tmp_path):
    w = MLLogWriter(tmp_path / "a.txt")

    def helper():
        w.event(C.CACHE_CLEAR, True, stack_offset=1)

    line = inspect.currentframe().f_lineno + 1
    helper()
    w.close()
    assert read_mllog(tmp_path / "a.txt")[0]["metadata"]["lineno"] == line


def test_two_writers_do_not_cross_talk_and_close_detaches(tmp_path, caplog):
    a, b = MLLogWriter(tmp_path / "a.txt"), MLLogWriter(tmp_path / "b.txt")
    with caplog.at_level(logging.INFO):
        for i in range(3):
            a.event("k", f"a{i}")
            b.event("k", f"b{i}")
    logger = a._logger
    a.close()
    b.event("k", "b-after")
    b.close()
    assert [e["value"] for e in read_mllog(tmp_path / "a.txt")] == ["a0", "a1", "a2"]
    assert [e["value"] for e in read_mllog(tmp_path / "b.txt")] == ["b0", "b1", "b2", "b-after"]
    assert logger.handlers == [] and caplog.records == []  # nothing leaked to the root logger
    with pytest.raises(RuntimeError, match="closed"):
        a.event("k", 1)
    a.close()  # idempotent


def test_echo_mirrors_to_stdout(tmp_path, capsys):
    with MLLogWriter(tmp_path / "a.txt", echo=True) as w:
        w.event("k", 1)
    assert ":::MLLOG" in capsys.readouterr().out
