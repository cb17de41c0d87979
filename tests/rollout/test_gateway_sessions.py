"""Gateway sessions without a server: ready when ended and rewarded (the session's reward, or one per call),
dropped past the reward timeout, one reward each; the running per-task baseline; the trainer's source taking
batches of sessions (stale ones dropped or kept); the trajectory store; API keys and their limits."""

import asyncio
import json
import os

import pytest

from areal_agents.agents.capture import ChatCapture
from areal_agents.config import GatewayConfig, TrainConfig, load_config
from areal_agents.engines.base import InferenceEngine
from areal_agents.errors import ConfigError, EngineError
from areal_agents.rollout.gateway.keys import ApiKeys, KeyPolicy, RateLimits
from areal_agents.rollout.gateway.session_book import FinishedSession, RunningBaselines, SessionBook, SessionError
from areal_agents.rollout.gateway.source import GatewaySource
from areal_agents.rollout.gateway.store import TrajectoryStore, read_sessions
from areal_agents.types import GenResponse, SamplingParams, Trajectory


class CountingEngine(InferenceEngine):
    """Answers every call with the same three tokens, at the version it is set to."""

    def __init__(self, tokenizer):
        self.tokens = tokenizer.encode("42", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.version = 0

    async def agenerate(self, request):
        n = len(self.tokens)
        return GenResponse(list(self.tokens), [-0.5] * n, [self.version] * n, "stop")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def book(tokenizer):
    engine, clock, ready = CountingEngine(tokenizer), Clock(), []
    cfg = GatewayConfig(reward_timeout_s=60, session_idle_s=30, max_open_sessions=3, max_calls_per_session=2)

    def capture(sid):
        return ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=8), episode_id=sid)

    book = SessionBook(cfg, capture, ready.append, clock=clock)
    book.ready, book.clock_, book.engine = ready, clock, engine
    return book


def call(book, sid, owner=""):
    session = book.session_for_call(sid, owner)
    completion = asyncio.run(session.capture.create(messages=[{"role": "user", "content": "6*7?"}]))
    book.call_finished(session)
    return completion.id


def test_a_session_is_handed_on_once_ended_and_rewarded_in_either_order(book):
    call(book, "a")
    book.reward("a", 1.0)  # before its end: kept
    assert book.ready == []
    book.end("a")
    (done,) = book.ready
    assert isinstance(done, FinishedSession) and done.reward == 1.0 and done.session_id == "a"
    (traj,) = done.trajectories
    assert traj.group_id == "a" and traj.metadata["baseline"] == 1.0 and traj.metadata["session"] == "a"
    assert sum(traj.loss_mask) == 3 and traj.reward == 1.0
    with pytest.raises(SessionError) as e:
        book.reward("a", 0.0)
    assert e.value.status == 409 and "handed to training" in str(e.value)
    book.open("math", session_id="b")
    book.end("b")  # ended with no call: nothing to train, never ready
    call_b = book.session_for_call
    with pytest.raises(SessionError) as e:
        call_b("b", "")
    assert e.value.status == 409 and "has ended" in str(e.value)


def test_per_call_rewards_make_a_session_ready_when_every_call_has_one(book):
    first, second = call(book, "s"), call(book, "s")
    book.end("s")
    book.reward("s", 0.5, completion_id=first)
    assert book.ready == []
    with pytest.raises(SessionError) as e:
        book.reward("s", 0.5, completion_id=first)
    assert e.value.status == 409
    with pytest.raises(SessionError) as e:
        book.reward("s", 1.0, completion_id="chatcmpl-nope")
    assert e.value.status == 404 and "completion_id" in str(e.value)
    book.reward("s", 1.0, completion_id="msg_" + second.removeprefix("chatcmpl-"))  # as an Anthropic client saw it
    (done,) = book.ready
    assert done.reward == 1.5 and done.trajectories[0].turn_rewards == [0.5, 1.0]


def test_limits_owners_bad_values_and_unknown_sessions_are_client_errors(book):
    cases = []
    call(book, "mine", owner="alice")
    for action in (
        lambda: book.reward("mine", 1.0, owner="bob"),  # another key's session
        lambda: book.reward("mine", float("nan"), owner="alice"),
        lambda: book.reward("mine", True, owner="alice"),
        lambda: book.reward("nobody", 1.0),
        lambda: book.open(task=7),
        lambda: book.open(session_id="bad id/with slash"),
        lambda: [call(book, "mine", owner="alice") for _ in range(2)],  # max_calls_per_session=2
    ):
        with pytest.raises(SessionError) as e:
            action()
        cases.append(e.value.status)
    assert cases == [403, 400, 400, 404, 400, 400, 429]
    book.open(session_id="x")
    book.open(session_id="y")
    with pytest.raises(SessionError) as e:  # max_open_sessions=3
        book.open()
    assert e.value.status == 429 and "max_open_sessions" in str(e.value)


def test_idle_sessions_end_and_unrewarded_ones_expire(book):
    call(book, "idle")
    book.clock_.now += 31  # past session_idle_s
    book.sweep()
    assert book.sessions["idle"].ended is not None and book.counts.idle_ended == 1
    book.clock_.now += 61  # past reward_timeout_s after its end
    book.sweep()
    assert "idle" not in book.sessions and book.counts.expired == 1 and book.ready == []
    with pytest.raises(SessionError) as e:
        book.reward("idle", 1.0)
    assert e.value.status == 410 and "expired" in str(e.value)


def test_running_baseline_compares_each_session_with_the_rewards_before_it():
    b = RunningBaselines(decay=0.5)
    assert b.take("add", 1.0) == 1.0  # the very first session: its own reward, no signal
    assert b.take("add", 0.0) == 1.0
    assert b.take("add", 1.0) == 0.5
    # a new task starts from the all-task baseline (1 -> 0.5 -> 0.75 after the three above)
    assert b.take("mul", 0.0) == 0.75
    assert b.values["mul"] == pytest.approx(0.375)


def session(sid, version, reward=1.0, task=""):
    traj = Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], [-1, version, version], reward=reward, group_id=sid)
    traj.metadata = {"baseline": 0.5, "task": task, "session": sid}
    return FinishedSession(sid, task, reward, 0.5, [traj])


def test_the_source_takes_batches_and_drops_or_keeps_stale_sessions():
    async def batches(stale):
        source = GatewaySource(2, lambda: 5, max_staleness=1, stale_sessions=stale)
        for sid, v in (("old", 3), ("a", 4), ("b", 5)):
            source.put(session(sid, v))
        batch = await source.get_batch()
        late = asyncio.ensure_future(source.get_batch())
        await asyncio.sleep(0.05)
        waited = not late.done()  # waits for traffic, without spinning
        source.put(session("c", 5))
        source.put(session("d", 5))
        more = await asyncio.wait_for(late, 5)
        return source, [g.group_id for g in batch], [g.group_id for g in more], waited

    source, batch, more, waited = asyncio.run(batches("drop"))
    assert batch == ["a", "b"] and more == ["c", "d"] and waited
    assert source.stats.groups_stale == 1 and source.ledger.rejected == 1 and source.cursor.position == 4
    source, batch, more, _ = asyncio.run(batches("correct"))
    assert batch == ["old", "a"] and more == ["b", "c"] and source.stats.staleness[:2] == [2, 1]
    asyncio.run(source.aclose())  # "d" was rewarded and never trained
    assert source.ledger.cancelled == 1 and source.ledger.running == 0 and source.ledger.accepted == 4


def test_the_store_keeps_sessions_on_disk_reads_them_back_and_prunes_old_files(tmp_path):
    store = TrajectoryStore(str(tmp_path / "kept"), retention_hours=1)
    store.append(session("s1", 0, reward=0.25, task="t"))
    (back,) = read_sessions(str(tmp_path / "kept"))
    assert back.session_id == "s1" and back.task == "t" and back.reward == 0.25
    assert back.trajectories[0].versions == [-1, 0, 0] and back.trajectories[0].metadata["baseline"] == 0.5
    (path,) = (tmp_path / "kept").glob("sessions-*.jsonl")
    assert store.prune() == []
    os.utime(path, (0, 0))  # written long ago
    assert store.prune() == [path] and not path.exists()
    (tmp_path / "kept" / "sessions-20260101-00.jsonl").write_text('{"session_id": "x"}\n')
    with pytest.raises(ConfigError, match=r"sessions-20260101-00.jsonl:1"):
        list(read_sessions(str(tmp_path / "kept")))


def test_api_keys_from_a_file_and_their_per_minute_limits(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("sk-aaaaaaaaaaaaaaaa: {name: bot, requests_per_minute: 2, tokens_per_minute: 100}\n")
    keys = ApiKeys.load(str(keys_file))
    assert keys.identify("Bearer sk-aaaaaaaaaaaaaaaa", None).name == "bot"
    assert keys.identify(None, "sk-aaaaaaaaaaaaaaaa").name == "bot"  # Anthropic's header
    with pytest.raises(SessionError) as e:
        keys.identify("Bearer sk-wrong", None)
    assert e.value.status == 401
    assert ApiKeys.load("").identify(None, None) == KeyPolicy("")
    clock = Clock()
    limits, bot = RateLimits(clock), keys.identify(None, "sk-aaaaaaaaaaaaaaaa")
    limits.admit(bot)
    limits.admit(bot)
    with pytest.raises(SessionError) as e:
        limits.admit(bot)
    assert e.value.status == 429 and "requests a minute" in str(e.value)
    clock.now += 61
    limits.admit(bot)
    limits.spent(bot, 150)
    clock.now += 1
    with pytest.raises(SessionError, match="tokens a minute"):
        limits.admit(bot)
    bad = (("[1, 2]", "mapping"), ("short: {}", "16 characters"), ("sk-aaaaaaaaaaaaaaaa: {rpm: 3}", "entry"))
    for text, where in bad:
        keys_file.write_text(text)
        with pytest.raises(ConfigError, match=where):
            ApiKeys.load(str(keys_file))


def test_gateway_config_refuses_an_open_network_endpoint_and_mismatched_sources(tmp_path):
    with pytest.raises(ValueError, match="api_keys_file"):
        GatewayConfig(host="0.0.0.0")
    GatewayConfig(host="0.0.0.0", api_keys_file="keys.yaml")
    GatewayConfig(host="::1")
    for overrides, message in (
        (["ppo.advantage=baseline"], "rollout.source=gateway"),
        (["rollout.source=gateway", "policies={a: m1}"], "one shared policy"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, None, overrides)
    cfg = load_config(TrainConfig, None, ["rollout.source=gateway", "ppo.advantage=baseline"])
    assert cfg.gateway.port == 8400 and json.dumps(cfg.gateway.stale_sessions) == '"drop"'


def test_an_aborted_call_is_an_engine_error_not_a_reply(tokenizer):
    """An engine that stops mid-call answers ``abort``: no OpenAI finish_reason fits, so the gateway says 503."""

    class Aborting(InferenceEngine):
        async def agenerate(self, request):
            return GenResponse([], [], [], "abort")

    capture = ChatCapture(Aborting(), tokenizer, SamplingParams(max_new_tokens=4), episode_id="e")
    with pytest.raises(EngineError, match="aborted"):
        asyncio.run(capture.create(messages=[{"role": "user", "content": "hi"}]))


def test_a_source_without_traffic_says_it_waits_and_goes_on_waiting(capsys):
    async def quiet():
        source = GatewaySource(1, lambda: 0, max_staleness=0)
        source.quiet_s = 0.05
        batch = asyncio.ensure_future(source.get_batch())
        await asyncio.sleep(0.2)
        waiting = not batch.done()
        source.put(session("late", 0))
        return waiting, await asyncio.wait_for(batch, 5)

    waiting, batch = asyncio.run(quiet())
    assert waiting and [g.group_id for g in batch] == ["late"]
    assert "waiting for rewarded sessions (0 of 1 for this step)" in capsys.readouterr().out


def test_a_resumed_gateway_run_may_move_its_address_but_not_change_its_training(tmp_path):
    from areal_agents.config import config_to_dict
    from areal_agents.trainers.resume import check_resume_config

    base = ["rollout.source=gateway", "ppo.advantage=baseline", f"run_dir={tmp_path}"]
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(load_config(TrainConfig, None, base))))
    moved = load_config(TrainConfig, None, [*base, "gateway.port=9001", "gateway.reward_timeout_s=60"])
    assert check_resume_config(tmp_path, moved, allow_change=False) == []
    changed = load_config(TrainConfig, None, [*base, "gateway.baseline_decay=0.5"])
    with pytest.raises(ConfigError, match="baseline_decay"):
        check_resume_config(tmp_path, changed, allow_change=False)
