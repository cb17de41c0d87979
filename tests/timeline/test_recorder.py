"""The timeline recorder and its reader: busy time spread over bins, gauges, spans and their size bound,
files of several processes on one grid. A fake clock makes the bins exact."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from areal_agents.timeline import recorder as rec
from areal_agents.timeline.reader import read_timeline


class Clock:
    """``time.time`` and ``time.monotonic`` that move only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return 0.0  # the sampler thread never flushes by itself: the test does


@pytest.fixture
def clock(monkeypatch):
    c = Clock(1000.0)
    monkeypatch.setattr(rec, "time", c)
    return c


def make(tmp_path, clock, process="driver", **kw):
    return rec.Timeline(tmp_path / "timeline", process, dt=0.1, **kw)


def test_a_busy_stretch_is_spread_over_the_bins_it_covers(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.idle("idle-worker")
    tl.sample()
    tl.enter("w")
    clock.now = 1000.25
    tl.leave("w")
    clock.now = 1000.5
    tl.sample()
    tl.close()
    run = read_timeline(tmp_path)
    assert run.start == pytest.approx(1000.0)
    # [1000.0, 1000.25) busy: two whole bins and half of the third, then idle
    np.testing.assert_allclose(run.busy["w"][:5], [1, 1, 0.5, 0, 0], atol=1e-6)
    assert run.busy_share("idle-worker") == 0.0 and "idle-worker" in run.busy


def test_a_worker_is_busy_while_any_caller_is_inside(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.enter("w")
    tl.enter("w")
    clock.now = 1000.1
    tl.leave("w")  # one of two callers left: still busy
    clock.now = 1000.2
    tl.leave("w")
    tl.leave("w")  # an unmatched leave changes nothing
    clock.now = 1000.3
    tl.sample()
    tl.close()
    np.testing.assert_allclose(read_timeline(tmp_path).busy["w"][:3], [1, 1, 0], atol=1e-6)


def test_an_open_stretch_shows_before_it_ends(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.enter("w")
    clock.now = 1000.35
    tl.sample()
    tl.flush()  # the bins before 1000.3 are finished and written while the worker is still busy
    run = read_timeline(tmp_path)
    np.testing.assert_allclose(run.busy["w"], [1, 1, 1], atol=1e-6)
    tl.close()


def test_gauges_are_sampled_per_bin_and_a_failing_one_is_a_gap(tmp_path, clock):
    tl = make(tmp_path, clock)
    depth = [3]
    tl.gauge("queue", lambda: depth[0])
    tl.gauge("broken", lambda: 1 / 0)
    tl.busy_fraction("gpu0", lambda: 1.7)  # out of range: capped
    for t, d in [(1000.0, 3), (1000.1, 5), (1000.2, 4)]:
        clock.now, depth[0] = t, d
        tl.sample()
    tl.close()
    run = read_timeline(tmp_path)
    np.testing.assert_allclose(run.gauges["queue"][:3], [3, 5, 4])
    assert "broken" not in run.gauges
    np.testing.assert_allclose(run.busy["gpu0"][:3], [1, 1, 1])


def test_spans_stop_at_half_the_budget_but_kept_ones_go_in(tmp_path, clock):
    tl = make(tmp_path, clock, max_bytes=2000)
    for i in range(60):
        with tl.span("engine", "generate", rid=i):
            clock.now += 0.01
        tl.flush()
    with tl.span("driver", "update", keep=True, step=1) as args:
        args["trained"] = 8
    tl.close()
    run = read_timeline(tmp_path)
    names = [s.name for s in run.spans]
    assert 0 < names.count("generate") < 60 and run.dropped_spans == 60 - names.count("generate")
    update = next(s for s in run.spans if s.name == "update")
    assert update.args == {"step": 1, "trained": 8} and update.track == "driver"


def test_past_its_budget_a_file_records_coarser_bins(tmp_path, clock):
    tl = make(tmp_path, clock, max_bytes=600)
    tl.gauge("q", lambda: 2.0)
    for _ in range(40):
        clock.now += 0.1
        tl.sample()
        tl.flush()
    assert tl.dt > 0.1  # coarsened at least once
    tl.close()
    run = read_timeline(tmp_path)
    assert run.dt == tl.dt
    assert np.nanmax(run.gauges["q"]) == 2.0 and np.isfinite(run.gauges["q"]).sum() >= 4


def test_processes_line_up_on_one_grid_and_same_names_get_the_process(tmp_path, clock):
    a = make(tmp_path, clock, process="server-a")
    b = make(tmp_path, clock, process="server-b")
    a.enter("engine/hf")
    clock.now = 1000.2
    b.enter("engine/hf")
    a.leave("engine/hf")
    clock.now = 1000.3
    b.leave("engine/hf")
    for tl in (a, b):
        tl.sample()
        tl.close()
    run = read_timeline(tmp_path)
    np.testing.assert_allclose(run.busy["server-a:engine/hf"][:3], [1, 1, 0], atol=1e-6)
    # b knew of its worker from 1000.2 only: before that its row is unknown, not idle
    np.testing.assert_allclose(run.busy["server-b:engine/hf"][:3], [np.nan, np.nan, 1], atol=1e-6)
    assert run.processes["server-b:engine/hf"] == "server-b"


def test_a_partial_last_line_is_skipped(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.gauge("q", lambda: 1.0)
    tl.sample()
    tl.close()
    with tl.path.open("a") as f:
        f.write('{"k": "bins", "dt": 0.1, "gau')
    assert read_timeline(tmp_path).gauges["q"][0] == 1.0


def test_coarse_averages_whole_groups_of_bins(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.enter("w")
    clock.now = 1000.2
    tl.leave("w")
    clock.now = 1000.4
    tl.sample()
    tl.close()
    run = read_timeline(tmp_path).coarse(max_bins=3)
    assert math.isclose(run.dt, 0.2)
    np.testing.assert_allclose(run.busy["w"][:2], [1, 0], atol=1e-6)


def test_a_run_without_a_timeline_reads_as_empty(tmp_path):
    run = read_timeline(tmp_path)
    assert run.bins == 0 and run.busy == {} and run.spans == []


def test_open_timeline_lets_child_processes_find_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv(rec.DIR_ENV, raising=False)
    tl = rec.open_timeline(tmp_path, "driver")
    try:
        assert rec.timeline() is tl and rec.DIR_ENV in __import__("os").environ
        monkeypatch.setattr(rec, "_current", rec.NULL)  # as a freshly started child sees it
        child = rec.timeline_from_env("trainer")
        assert child is not tl and child.path.parent == tmp_path / "timeline"
        child.close()
    finally:
        monkeypatch.setattr(rec, "_current", tl)
        rec.close_timeline()
    assert rec.timeline() is rec.NULL and rec.DIR_ENV not in __import__("os").environ
    rows = [json.loads(x) for x in tl.path.read_text().splitlines()]
    assert rows[0]["k"] == "meta" and rows[0]["process"] == "driver"


def test_the_null_timeline_records_nothing():
    null = rec.NULL
    with null.busy("w"), null.span("t", "n", a=1) as args:
        assert args == {"a": 1}
    null.gauge("q", lambda: 1)
    null.close()


def test_a_flush_after_close_writes_nothing_and_close_twice_is_fine(tmp_path, clock):
    tl = make(tmp_path, clock)
    tl.gauge("q", lambda: 1.0)
    tl.sample()
    tl.close()
    size = tl.path.stat().st_size
    tl.flush()
    tl.close()
    assert tl.path.stat().st_size == size


def test_workers_of_one_kind_get_their_own_rows_per_timeline(tmp_path, clock):
    tl = make(tmp_path, clock)
    assert [tl.unique("engine/hf") for _ in range(3)] == ["engine/hf", "engine/hf-1", "engine/hf-2"]
    other = make(tmp_path / "other", clock)
    assert other.unique("engine/hf") == "engine/hf"  # a new run counts from 0
    for t in (tl, other):
        t.close()


def test_bins_at_todays_wall_clock_land_on_their_own_grid_points(tmp_path, clock):
    """Near 1.8e9 s a bin's time is off by ~5e-7 s (5e-6 of a bin): each still lands on its own grid point."""
    clock.now = 1796611933.95  # bin 17966119339: its start, 1796611933.9, is where rounding bites
    tl = make(tmp_path, clock)
    tl.enter("w")
    for _ in range(30):
        clock.now += 0.1
        tl.sample()
    tl.leave("w")
    tl.close()
    row = read_timeline(tmp_path).busy["w"]
    assert np.isfinite(row).all() and row[1:30].min() > 0.99, row  # entered mid-bin: the first is half


def test_a_tail_of_bins_alone_skips_the_span_lines(tmp_path, clock):
    """TensorBoard's pictures read the bins each step: span lines (most of a file) are not even parsed."""
    from areal_agents.timeline.reader import SPAN_PREFIX
    from areal_agents.timeline.tail import TimelineTail

    tl = make(tmp_path, clock)
    tl.gauge("q", lambda: 3.0)
    tl.add_span("episodes", "generate", 1000.0, 1000.05, rid="e0/t0")
    tl.sample()
    tl.close()
    assert any(line.startswith(SPAN_PREFIX) for line in tl.path.read_text().splitlines())
    bins_only, everything = TimelineTail(tmp_path, spans=False), TimelineTail(tmp_path)
    for tail in (bins_only, everything):
        tail.read()
    assert bins_only.window().spans == [] and len(everything.window().spans) == 1
    assert bins_only.window().gauges["q"][0] == everything.window().gauges["q"][0] == 3.0
