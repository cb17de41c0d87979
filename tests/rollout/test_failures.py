"""Failed episodes without a flood: `FailureLog` logs the first of each cause (its traceback once, to a file)
and then counts; the controller stops a run whose episodes mostly fail (``max_failed_fraction``) instead of
spinning through them; an episode that halts the run (`RunHalted`) is not retried."""

import asyncio
import logging

import pytest
from test_controller import FakeAgent, make_controller

from areal_agents.errors import EnvError, RunHalted
from areal_agents.rollout.episodes import EpisodeRunner, RolloutLedger, failure_kind
from areal_agents.rollout.failures import FailureLog


def raised(error):
    try:
        raise error
    except Exception as e:  # noqa: BLE001  (a raised error carries its traceback)
        return e


def test_the_first_failure_of_each_cause_is_logged_with_its_traceback_once(tmp_path, caplog):
    failures = FailureLog(tmp_path / "failures.log", interval_s=3600)
    with caplog.at_level(logging.WARNING):
        for i in range(500):
            failures.record("env_failed", raised(EnvError("unreachable", f"http://x/{i}: refused")), f"g{i}/e0")
        failures.record("failed", raised(RuntimeError("agent bug")), "g9/e1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one per cause, not 501
    assert lines[0].startswith("env_failed: episode g0/e0: EnvError unreachable: http://x/0: refused")
    assert "traceback in" in lines[0] and "RuntimeError: agent bug" in lines[1]
    trace = (tmp_path / "failures.log").read_text()
    assert trace.count("Traceback (most recent call last)") == 2 and "== env_failed: EnvError unreachable" in trace
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        failures.flush()
    assert [r.getMessage() for r in caplog.records] == [caplog.records[0].getMessage()] and caplog.records[
        0
    ].getMessage().startswith("env_failed ×499 in the last ")
    assert caplog.records[0].getMessage().endswith("EnvError unreachable: http://x/499: refused")


def test_counts_are_logged_once_per_interval(caplog):
    failures = FailureLog(interval_s=0.0)  # every record after the first is its own line
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            failures.record("engine_failed", raised(RuntimeError("503")), "e")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and messages[1].startswith("engine_failed ×1 in the last 0 s: RuntimeError: 503")
    assert caplog.records[0].exc_info is not None  # no file: the first traceback goes to the log itself


def test_the_description_names_the_commonest_failures_not_retries():
    failures = FailureLog()
    for _ in range(3):
        failures.record("retried", EnvError("env_error", "boom"), "e")
    for _ in range(2):
        failures.record("env_failed", EnvError("env_error", "boom"), "e")
    failures.record("failed", ValueError("bad"), "e")
    assert failures.describe(failures.totals) == "env_failed ×2 (EnvError env_error: boom); failed ×1 (ValueError: bad)"


def test_a_halt_is_not_retried_and_propagates():
    runner = EpisodeRunner(max_retries=3)
    tries = []

    async def episode():
        tries.append(1)
        raise RunHalted("env server: bad_request (400): no")

    with pytest.raises(RunHalted):
        asyncio.run(runner.run(episode, "e"))
    assert tries == [1] and runner.ledger == RolloutLedger(submitted=1, failed=1)
    assert failure_kind(RunHalted("x")) == "halt"


def test_a_run_whose_episodes_all_fail_stops_after_about_a_batch_of_them():
    version = [0]
    agent = FakeAgent(version, failures={"env": 1.0})  # without retries, every episode fails
    controller = make_controller(agent, version, max_retries=0, max_failed_fraction=0.5)

    async def first_batch():
        try:
            await controller.get_batch()
        finally:
            await controller.aclose()

    with pytest.raises(RunHalted, match=r"rollout.max_failed_fraction=0.5\): env_failed ×\d+ \(EnvError env_error"):
        asyncio.run(first_batch())
    batch = 4 * 3  # batch_size x group_size in make_controller
    assert batch <= controller.ledger.env_failed <= 3 * batch  # it stopped, rather than spin on
    assert controller.ledger.accepted == 0 and controller.ledger.running == 0


def test_a_run_with_some_failed_episodes_goes_on():
    version = [0]
    agent = FakeAgent(version, failures={"env": 0.2, "policy": 0.1}, seed=5)
    controller = make_controller(agent, version, max_retries=1, max_staleness=1, max_failed_fraction=0.5)

    async def steps():
        try:
            for _ in range(6):
                await controller.get_batch()
                version[0] += 1
                controller.notify_version()
        finally:
            await controller.aclose()

    asyncio.run(steps())
    assert controller.ledger.failures > 0 and controller.stats.groups_accepted >= 24


def test_the_fraction_is_checked_only_once_a_batch_has_ended():
    """A run's first failures (a cold server) do not stop it: the share counts once a batch's worth ended."""
    version = [0]
    controller = make_controller(FakeAgent(version), version, max_failed_fraction=0.5)
    controller._window = (0, 0, controller.failures.totals.copy())
    controller.ledger.env_failed = 11  # 11 of 12 failed: but fewer than a batch's 12 have ended
    controller._check_failures()
    assert controller._fatal is None
    controller.ledger.accepted = 1
    controller._ready_event = asyncio.Event()
    controller._check_failures()
    assert isinstance(controller._fatal, RunHalted)
