"""The rollout controller: the capacity gate, the staleness bound, filters and an exact ledger under failures."""

import asyncio
import random

import pytest

from areal_agents.errors import EngineError, EnvError
from areal_agents.rollout.controller import DataCursor, RolloutController, capacity
from areal_agents.types import Trajectory


@pytest.mark.parametrize(
    "max_concurrent, running, staleness, version, batch, accepted, expected",
    [
        (64, 0, 0, 0, 4, 0, 4),  # synchronous: one batch per version
        (64, 4, 0, 0, 4, 0, 0),  # ... and no more while it runs
        (64, 0, 0, 1, 4, 4, 4),  # the next version opens the next batch
        (64, 0, 2, 0, 4, 0, 12),  # staleness 2: up to three batches ahead
        (64, 5, 2, 1, 4, 6, 5),  # (2 + 1 + 1) * 4 - (6 + 5)
        (3, 0, 4, 0, 4, 0, 3),  # the concurrency cap wins
        (64, 10, 0, 0, 4, 0, 0),  # never negative
    ],
)
def test_capacity_formula(max_concurrent, running, staleness, version, batch, accepted, expected):
    assert capacity(max_concurrent, running, staleness, version, batch, accepted) == expected


class FakeAgent:
    """Episodes that take a random time, tag tokens with the version at generation, and fail on request.

    Whether an episode fails is a function of its id (not of scheduling order): half of the failing
    episodes fail on their first attempt only (a retry succeeds), the others on every attempt."""

    def __init__(self, version, failures=None, seed=0):
        self.version, self.failures, self.seed = version, failures or {}, seed
        self.rng = random.Random(seed)
        self.calls = 0
        self.attempts = {}

    async def run_episode(self, env, *, seed, episode_id):
        self.calls += 1
        attempt = self.attempts[episode_id] = self.attempts.get(episode_id, -1) + 1
        await asyncio.sleep(self.rng.uniform(0.001, 0.02))
        fate = random.Random(f"{self.seed}/{episode_id}")
        roll, transient = fate.random(), fate.random() < 0.5
        if transient and attempt > 0:
            roll = 1.0
        if roll < self.failures.get("env", 0):
            raise EnvError("env_error", "injected")
        if roll < self.failures.get("env", 0) + self.failures.get("engine", 0):
            raise EngineError("injected engine failure")
        if roll < sum(self.failures.values()):
            raise RuntimeError("injected policy bug")
        v = self.version[0]
        reward = float(fate.random() < 0.5)
        return [Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, v], reward=reward, episode_id=episode_id)]


def make_controller(agent, version, **kw):
    return RolloutController(
        agent,
        lambda: None,
        lambda i: 1000 + i,
        batch_size=4,
        group_size=3,
        get_version=lambda: version[0],
        **kw,
    )


async def train(controller, version, steps, train_seconds=0.01):
    batches = []
    for _ in range(steps):
        batches.append(await controller.get_batch())
        await asyncio.sleep(train_seconds)
        version[0] += 1
        controller.notify_version()
    await controller.aclose()
    return batches


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_samples_are_never_staler_than_the_bound(max_staleness):
    version = [0]
    controller = make_controller(FakeAgent(version), version, max_staleness=max_staleness)
    batches = asyncio.run(train(controller, version, steps=8))
    assert all(len(b) == 4 and all(len(g.trajectories) == 3 for g in b) for b in batches)
    assert max(controller.stats.staleness) <= max_staleness
    if max_staleness == 0:
        assert controller.stats.groups_submitted == 8 * 4  # exactly one batch per version: synchronous
    else:
        assert max(controller.stats.staleness) >= 1  # it did run ahead


def test_ledger_balances_under_env_engine_and_policy_failures():
    version = [0]
    agent = FakeAgent(version, failures={"env": 0.1, "engine": 0.1, "policy": 0.05}, seed=3)
    controller = make_controller(agent, version, max_staleness=2, max_retries=1)
    asyncio.run(train(controller, version, steps=10))
    ledger = controller.ledger
    ended = ledger.accepted + ledger.rejected + ledger.failed + ledger.env_failed + ledger.engine_failed
    assert ledger.submitted == ended + ledger.cancelled and ledger.running == 0
    assert ledger.env_failed > 0 and ledger.engine_failed > 0 and ledger.failed > 0
    assert controller.runner.retries > 0  # env and engine failures were retried first
    assert agent.calls == ledger.submitted + controller.runner.retries


def test_dynamic_sampling_rejects_groups_and_still_fills_the_batch():
    version = [0]
    controller = make_controller(
        FakeAgent(version, seed=5),
        version,
        max_staleness=0,
        group_filter=lambda g: len({t.reward for t in g.trajectories}) > 1,
    )
    batches = asyncio.run(train(controller, version, steps=5))
    assert controller.stats.groups_rejected > 0
    for batch in batches:
        assert len(batch) == 4 and all(len({t.reward for t in g.trajectories}) > 1 for g in batch)
    assert controller.ledger.rejected == 3 * controller.stats.groups_rejected


def test_data_position_and_a_resumed_controller_continue_the_prompt_order():
    version = [0]
    first = make_controller(FakeAgent(version), version, max_staleness=0)
    batches = asyncio.run(train(first, version, steps=3))
    assert [g.index for b in batches for g in b] == list(range(12))  # prompt order, batch by batch
    version = [3]
    resumed = make_controller(FakeAgent(version), version, max_staleness=0, start_index=12, groups_before=12)
    later = asyncio.run(train(resumed, version, steps=2))
    assert [g.index for b in later for g in b] == list(range(12, 20))
    assert resumed.stats.groups_submitted == 8 and resumed.stats.groups_stale == 0  # no burst after resume


class LongTailAgent(FakeAgent):
    """Every fourth prompt's episodes take 15x longer (long answers); tokens carry the version at generation."""

    async def run_episode(self, env, *, seed, episode_id):
        start = self.version[0]
        await asyncio.sleep(0.06 if seed % 4 == 0 else 0.004)
        return [
            Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, start, self.version[0]], episode_id=episode_id)
        ]


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_slow_groups_are_waited_for_not_dropped_as_stale(max_staleness):
    """Younger groups overtake the slow ones, but the batch keeps places for the groups that would be too
    stale for the next one: no long answer is dropped (a bias to short answers), none is staler than the bound."""
    version = [0]
    controller = make_controller(
        LongTailAgent(version), version, max_staleness=max_staleness, max_concurrent_episodes=192
    )
    batches = asyncio.run(train(controller, version, steps=12))
    consumed = sorted(g.index for b in batches for g in b)
    assert controller.stats.groups_stale == 0 and controller.ledger.rejected == 0
    assert consumed == list(range(48))  # in submission order overall: nothing skipped
    assert max(controller.stats.staleness) <= max_staleness
    assert any(sorted(g.index for g in b) != list(range(4 * i, 4 * i + 4)) for i, b in enumerate(batches))  # overtaken


class OneSlowEpisodeAgent(FakeAgent):
    """The first episode of every group is slow (a long answer), the others quick; counts episodes at once."""

    def __init__(self, version):
        super().__init__(version)
        self.running = self.peak = 0
        self.groups_seen_at_once = 0
        self.live_groups: dict[str, int] = {}

    async def run_episode(self, env, *, seed, episode_id):
        group = episode_id.split("/")[0]
        self.running += 1
        self.live_groups[group] = self.live_groups.get(group, 0) + 1
        self.peak = max(self.peak, self.running)
        self.groups_seen_at_once = max(self.groups_seen_at_once, len(self.live_groups))
        try:
            await asyncio.sleep(0.05 if episode_id.endswith("/e0") else 0.002)
        finally:
            self.running -= 1
            self.live_groups[group] -= 1
            if not self.live_groups[group]:
                del self.live_groups[group]
        return [Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, self.version[0]], reward=1.0, episode_id=episode_id)]


def test_concurrency_counts_running_episodes_not_their_groups():
    """A group whose quick episodes are done holds one place, not group_size: with room for 4 episodes and
    groups of 3, the next group starts beside the slow episode (counting groups, one group at a time)."""
    version = [0]
    agent = OneSlowEpisodeAgent(version)
    controller = make_controller(agent, version, max_staleness=4, max_concurrent_episodes=4)
    batches = asyncio.run(train(controller, version, steps=3))
    assert [len(b) for b in batches] == [4, 4, 4]
    assert agent.peak <= 4  # the cap holds, in episodes
    assert agent.groups_seen_at_once >= 2  # the next group ran beside the slow episode


def test_concurrency_below_one_group_is_refused():
    with pytest.raises(ValueError, match="max_concurrent_episodes"):
        make_controller(FakeAgent([0]), [0], max_concurrent_episodes=2)


def test_stream_batch_hands_out_finished_groups_while_the_slow_one_runs():
    """`stream_batch` yields each group when it may be taken: the quick groups of a synchronous batch come
    while its slow group (a long answer) still runs, and the batch is the one `get_batch` would give."""
    version = [0]
    controller = make_controller(LongTailAgent(version), version)  # seed 1000 + i: group 0 is the slow one

    async def first_batch():
        seen = []
        async for group in controller.stream_batch():
            seen.append((group.index, controller.running_groups))
        await controller.aclose()
        return seen

    seen = asyncio.run(first_batch())
    assert sorted(i for i, _ in seen) == [0, 1, 2, 3]
    assert seen[0][1] == 1 and seen[-1] == (0, 0)  # the slow group 0 still ran when the first came; it came last
    assert len(controller.stats.staleness) == 4 * 3  # every consumed trajectory's staleness, as get_batch counts


async def train_with_cursors(controller, version, steps):
    """`train`, with the controller's `cursor` after each step (as a checkpoint of the step records it)."""
    batches, cursors = [], []
    for _ in range(steps):
        batches.append(await controller.get_batch())
        version[0] += 1
        controller.notify_version()
        cursors.append(controller.cursor)
    await controller.aclose()
    return batches, cursors


def test_out_of_order_consumption_is_recorded_and_a_resume_trains_each_group_once():
    """Staleness 2, every fourth group slow: young groups are taken before old ones, so the cursor after step 2
    holds consumed indices above its position and groups in flight (with their submission versions). A
    controller resumed from it submits the groups not consumed, in index order, first; over both runs every
    group below the final position is taken exactly once. The ledger: a run's ``accepted`` is what it
    trained (the groups it never took count as cancelled), and so is the sum over both runs."""
    version = [0]
    first = make_controller(LongTailAgent(version), version, max_staleness=2, max_concurrent_episodes=192)
    batches, cursors = asyncio.run(train_with_cursors(first, version, steps=2))
    taken = [g.index for b in batches for g in b]
    cursor = cursors[-1]
    assert cursor.position == min(set(range(max(taken) + 2)) - set(taken))
    assert cursor.consumed == tuple(sorted(i for i in taken if i > cursor.position)) and cursor.consumed  # overtaken
    assert set(cursor.in_flight) == set(range(cursor.position, first._next_index)) - set(taken)
    assert all(0 <= v <= 2 for v in cursor.in_flight.values()) and cursor.in_flight_accepted >= 0
    assert first.ledger.accepted == 3 * len(taken) and first.ledger.running == 0

    submitted = []
    resumed = RolloutController(
        LongTailAgent(version),
        lambda: None,
        lambda i: submitted.append(i) or 1000 + i,
        batch_size=4,
        group_size=3,
        get_version=lambda: version[0],
        max_staleness=2,
        max_concurrent_episodes=192,
        start_index=cursor.position,
        consumed=cursor.consumed,
        groups_before=len(taken),
    )
    later, _ = asyncio.run(train_with_cursors(resumed, version, steps=4))
    redo = sorted(cursor.in_flight)
    assert submitted[: len(redo)] == redo  # the groups in flight at the checkpoint first, in index order
    assert not set(submitted) & set(taken)  # nothing consumed is submitted again
    assert submitted == sorted(submitted)
    every = taken + [g.index for b in later for g in b]
    assert len(every) == len(set(every)) == 24  # none twice
    assert set(range(resumed.data_position)) <= set(every)  # none skipped
    assert resumed.ledger.accepted == 3 * 16 and resumed.stats.groups_stale == 0
    assert resumed.stats.groups_submitted <= (2 + 6 + 1) * 4 - len(taken)  # the gate counts from the run's start


def test_a_resumed_controller_skips_the_consumed_indices():
    version = [1]
    controller = make_controller(FakeAgent(version), version, start_index=4, consumed=(5, 7, 2), groups_before=4)
    batches, cursors = asyncio.run(train_with_cursors(controller, version, steps=2))
    assert [g.index for g in batches[0]] == [4, 6, 8, 9] and [g.index for g in batches[1]] == [10, 11, 12, 13]
    assert cursors[0].position == 10 and cursors[0].consumed == () and cursors[0].in_flight == {}
    fresh = make_controller(FakeAgent(version), version, start_index=4, consumed=(4, 5))
    assert fresh.cursor == DataCursor(6)  # a position that was consumed moves on too


def test_a_cursor_describes_itself_for_a_resume():
    assert DataCursor(4).describe() == "from prompt 4"
    ahead = DataCursor(8, (9, 11), {8: 2, 10: 3, 12: 3}).describe()
    assert ahead == "from prompt 8 (2 consumed ahead of it; 3 groups in flight, submitted at versions 2-3, run again)"
    assert (
        DataCursor(8, (), {8: 2}).describe() == "from prompt 8 (1 group in flight, submitted at version 2, run again)"
    )
