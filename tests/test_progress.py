"""progress_bar: tqdm's bar on a terminal; whole lines, at most one per interval, when output is a log."""

import io

import pytest
from tqdm import std as tqdm_std
from tqdm import tqdm

from areal_agents.progress import LineProgress, plural, progress_bar


class FakeClock:
    """tqdm's clock, moved by hand: ``tick(s)`` advances it ``s`` seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tqdm_std, "time", clock)  # tqdm reads its clock from here when a bar is made
    return clock


def test_a_log_gets_one_line_per_interval_and_the_last_step(clock):
    log = io.StringIO()
    bar = progress_bar(total=10, desc="rl", file=log, interval=30)
    assert isinstance(bar, LineProgress)
    for step in range(1, 11):  # 10 s a step: lines at 30, 60 and 90 s (steps 3, 6, 9), then step 10
        clock.tick(10)
        bar.set_postfix(loss=f"{1 / step:.2f}")  # a refresh: writes nothing between lines
        bar.write("an eval line", file=log)  # nor does tqdm.write
        bar.update()
    bar.close()  # the last line is out already: close adds none
    out = log.getvalue()
    assert "\r" not in out and out.endswith("\n")
    lines = [line for line in out.splitlines() if line != "an eval line"]
    assert lines == [
        "rl: 3/10 [00:30<01:10, 10.00s/it, loss=0.33]",
        "rl: 6/10 [01:00<00:40, 10.00s/it, loss=0.17]",
        "rl: 9/10 [01:30<00:10, 10.00s/it, loss=0.11]",
        "rl: 10/10 [01:40<00:00, 10.00s/it, loss=0.10]",
    ]


def test_a_log_of_a_loop_over_the_bar_ends_at_its_total(clock):
    log = io.StringIO()
    for _ in progress_bar(range(5), desc="sft", file=log):
        clock.tick(1)
    assert log.getvalue() == "sft: 5/5 [00:05<00:00,  1.00it/s]\n"


def test_a_bar_closed_early_writes_how_far_it_got_and_without_a_total_no_eta(clock):
    log = io.StringIO()
    bar = progress_bar(total=6, initial=2, desc="rl", file=log)  # a resumed run: steps 1-2 done before
    clock.tick(4)
    bar.update()
    bar.close()
    bar = progress_bar(desc="eval", file=log)
    bar.update(3)
    bar.close()
    assert log.getvalue().splitlines() == ["rl: 3/6 [00:04<00:12,  4.00s/it]", "eval: 3 [00:00, ?it/s]"]


def test_a_terminal_gets_tqdm_itself(clock):
    ours, theirs = FakeTTY(), FakeTTY()
    for _ in progress_bar(range(3), desc="rl", file=ours):
        clock.tick(1)
    for _ in tqdm(range(3), desc="rl", file=theirs, dynamic_ncols=True):
        clock.tick(1)
    assert "\r" in ours.getvalue() and "100%|" in ours.getvalue()
    assert ours.getvalue() == theirs.getvalue()
    assert type(progress_bar(desc="x", file=FakeTTY())) is tqdm


@pytest.mark.parametrize("stream", [io.StringIO(), FakeTTY()])
def test_disabled_prints_nothing(stream):
    bar = progress_bar(total=3, desc="rl", file=stream, enabled=False)
    bar.update(3)
    bar.close()
    assert stream.getvalue() == ""


def test_plural():
    assert [plural(n, "problem") for n in (0, 1, 2)] == ["0 problems", "1 problem", "2 problems"]
