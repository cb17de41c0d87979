"""`areal-agents trace`: a hand-made run's timeline written as a Chrome/Perfetto trace and read back as JSON:
its processes and tracks are named, every span is one complete event of the span's length, slices on a
track nest, overlapping episodes sit on separate lanes with their turns inside, gauges are counters."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from areal_agents.cli import main
from areal_agents.timeline import read_timeline
from areal_agents.timeline import recorder as rec
from areal_agents.timeline.trace import _nest_lanes, build_trace
from tests.timeline.fake_run import T0, Clock, Process, sync_steps, write_run


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(rec, "time", c)
    return c


def episodes(p: Process) -> None:
    """e1 and e2 overlap; e3 starts after e1 ends (reuses its lane); e4's two agents generate at once."""
    p.span("episodes", "episode", 0.6, 1.4, episode_id="e1", group=0, reward=1.0)
    p.span("episodes", "generate", 0.6, 0.9, episode_id="e1", agent="a", turn=0, tokens=12)
    p.span("episodes", "env_step", 0.9, 1.0, episode_id="e1", turn=0)
    p.span("episodes", "generate", 1.0, 1.4, episode_id="e1", agent="a", turn=1, tokens=20)
    p.span("episodes", "episode", 0.7, 1.2, episode_id="e2", group=0, reward=0.0)
    p.span("episodes", "generate", 0.7, 1.1, episode_id="e2", agent="a", turn=0, tokens=30)
    p.span("episodes", "env_step", 1.1, 1.2, episode_id="e2", turn=0)
    p.span("episodes", "episode", 1.45, 1.9, episode_id="e3", group=1, reward=0.0)
    p.span("episodes", "generate", 1.45, 1.9, episode_id="e3", agent="a", turn=0, tokens=40)
    p.span("episodes", "episode", 0.8, 1.3, episode_id="e4", group=1, reward=0.5)
    p.span("episodes", "generate", 0.8, 1.0, episode_id="e4", agent="p0", turn=0, tokens=5)
    p.span("episodes", "generate", 0.9, 1.1, episode_id="e4", agent="p1", turn=0, tokens=5)


@pytest.fixture
def run_dir(tmp_path, clock):
    driver = Process("driver", gauges={"rollout/queued_groups": lambda t: 2.0 if t < 1.0 else 1.0})
    end = sync_steps(driver, steps=2, wait=1.5, update=0.6)
    episodes(driver)
    env = Process("serve-env", busy={"env/server": [(0.9, 1.0), (1.1, 1.2)]})
    return write_run(tmp_path / "run", clock, [driver, env], until=end)


def load(tmp_path, run_dir, capsys) -> dict:
    out = tmp_path / "out" / "t.json"
    assert main(["trace", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "https://ui.perfetto.dev" in printed and "bound:" in printed
    return json.loads(out.read_text())


def names_of(trace: dict, kind: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == kind}


def test_processes_and_tracks_are_named(tmp_path, run_dir, capsys):
    trace = load(tmp_path, run_dir, capsys)
    processes = {pid: name for (pid, _), name in names_of(trace, "process_name").items()}
    assert processes == {1: "driver", 2: "serve-env"}  # the driver's first
    threads = names_of(trace, "thread_name")
    assert set(threads.values()) == {
        "driver", "episodes 1", "episodes 2", "episodes 3", "episodes 4", "engine/hf", "trainer/default", "env/server"
    }  # fmt: skip
    assert threads[(2, 1)] == "env/server"
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert all(isinstance(e["ts"], int) and isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)  # metadata first, then events by time


def test_every_span_is_one_complete_event_of_its_length(tmp_path, run_dir, capsys):
    trace = load(tmp_path, run_dir, capsys)
    spans = read_timeline(run_dir).spans
    t0 = min(s.start for s in spans) - 0.5  # the run's first bin: start-up before the first step
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "busy"]
    assert len(slices) == len(spans) == 2 * 4 + 12  # 2 steps: wait, update, push, step
    got = sorted((e["name"], e["ts"], e["dur"], json.dumps(e.get("args", {}), sort_keys=True)) for e in slices)
    want = sorted(
        (s.name, round((s.start - t0) * 1e6), round((s.end - s.start) * 1e6), json.dumps(s.args, sort_keys=True))
        for s in spans
    )
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0] and g[3] == w[3] and abs(g[1] - w[1]) <= 1 and abs(g[2] - w[2]) <= 1
    assert trace["otherData"]["start_unix_s"] == pytest.approx(T0)


def test_slices_of_a_track_nest(tmp_path, run_dir, capsys):
    """On every thread track each slice ends before the next starts or holds it whole (as the viewers need)."""
    trace = load(tmp_path, run_dir, capsys)
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_track.values():
        open_ends: list[int] = []
        for a, b in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
            while open_ends and open_ends[-1] <= a:
                open_ends.pop()
            assert not open_ends or b <= open_ends[-1], f"{(a, b)} overlaps a slice it is not inside"
            open_ends.append(b)
    driver = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "driver"]
    assert len({e["tid"] for e in driver}) == 1  # steps hold their phases on one track


def test_overlapping_episodes_get_lanes_and_hold_their_turns(tmp_path, run_dir, capsys):
    trace = load(tmp_path, run_dir, capsys)
    threads = names_of(trace, "thread_name")
    lane = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "episodes":
            lane.setdefault(e["args"]["episode_id"], []).append((e["name"], threads[(e["pid"], e["tid"])]))
    assert lane["e1"] == [("episode", "episodes 1"), ("generate", "episodes 1"), ("env_step", "episodes 1")] + [
        ("generate", "episodes 1")
    ]
    assert {t for _, t in lane["e2"]} == {"episodes 2"}
    assert {t for _, t in lane["e3"]} == {"episodes 1"}  # e1 ended: its lane is free again
    # e4's agents generate at once: its second generate takes a lane of its own next to the episode's
    assert sorted(t for _, t in lane["e4"]) == ["episodes 3", "episodes 3", "episodes 4"]


def test_busy_stretches_and_gauges_are_slices_and_counters(tmp_path, run_dir, capsys):
    trace = load(tmp_path, run_dir, capsys)
    threads = names_of(trace, "thread_name")
    env_busy = [e for e in trace["traceEvents"] if e["ph"] == "X" and threads[(e["pid"], e["tid"])] == "env/server"]
    assert [(e["name"], e["dur"], e["args"]["share"]) for e in env_busy] == [("busy", 100000, 1.0)] * 2
    assert [e["ts"] for e in env_busy] == [900000, 1100000]
    queued = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "rollout/queued_groups"]
    assert [(e["ts"], e["args"]["value"]) for e in queued] == [(0, 2.0), (1000000, 1.0)]  # changes only
    shares = [e["args"]["value"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "env/server busy"]
    assert shares == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_nest_lanes_puts_a_partial_overlap_on_a_new_lane():
    # [0,10) holds [1,3) and [3,5); [4,12) overlaps [0,10) in part: lane 1; [10,11) follows [0,10) on lane 0
    assert _nest_lanes([(0, 10), (1, 3), (3, 5), (4, 12), (10, 11)]) == [0, 0, 0, 1, 0]


def test_a_run_without_a_timeline_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no timeline recorded" in err and str(tmp_path / "timeline") in err
    assert build_trace(read_timeline(tmp_path))["traceEvents"] == []


def test_calls_outside_episodes_overlapping_are_one_slice_on_a_lane_of_their_own(tmp_path, clock):
    p = Process("driver")
    for k in range(5):  # a run's first resets, all at once, then one more
        p.span("episodes", "env_reset", 0.1 + 0.01 * k, 0.2 + 0.01 * k)
    p.span("episodes", "env_reset", 0.5, 0.6)
    p.span("episodes", "episode", 0.1, 0.7, episode_id="e1")
    trace = build_trace(read_timeline(write_run(tmp_path / "run", clock, [p], until=1.0)))
    threads = names_of(trace, "thread_name")
    slices = [(e["name"], threads[(e["pid"], e["tid"])], e.get("args")) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices == [
        ("episode", "episodes 1", {"episode_id": "e1"}),
        ("env_reset", "outside episodes", {"calls": 5}),
        ("env_reset", "outside episodes", None),
    ]


def test_a_long_run_s_counters_are_averaged_into_fewer_bins(tmp_path, run_dir):
    run = read_timeline(run_dir)
    queued = [e for e in build_trace(run, max_bins=2)["traceEvents"] if e["name"] == "rollout/queued_groups"]
    half = run.bins // 2 + run.bins % 2  # the first of the two bins holds the first half: 2.0 for 1 s, then 1.0
    assert [e["ts"] for e in queued] == [0, half * 100000]
    assert queued[0]["args"]["value"] == pytest.approx((10 * 2.0 + (half - 10) * 1.0) / half)
