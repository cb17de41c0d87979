"""`RemoteEnvPool` over protocol v2 against real serve-env processes: multi-agent envs with their turn order
(batched or not), single-agent envs still on v1's steps, v1-only servers, owners and closing every session a
run holds; `MultiAgentChatAgent` playing Debate-v0 and the turn-based Turns-v0 through it."""

import asyncio
import json
import urllib.request

import pytest
from app_in_thread import serving_app

from areal_agents.agents.multi_agent import MultiAgentChatAgent
from areal_agents.engines import HFEngine
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.runtime.remote import EnvRequestRefused, EnvServerProcess, RemoteEnvPool, close_owned
from areal_agents.envs.runtime.server import EnvServer, ServerConfig, build_app
from areal_agents.errors import ArealAgentsError, EnvError
from areal_agents.net import free_port
from areal_agents.types import GenResponse, SamplingParams

pytestmark = pytest.mark.process

TESTING = "areal_agents.envs.testing"
DEBATE = "areal_agents/Debate-v0"
TURNS = "areal_agents_testing/Turns-v0"
ECHO = "areal_agents_testing/Echo-v0"


@pytest.fixture(scope="module")
def server():
    with EnvServerProcess(workers=2, max_action_chars=200, module=TESTING) as s:
        yield s


def health(url):
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        return json.loads(response.read())


def recording(pool):
    """Every (method, URL path, body) the pool sends, in order; the requests still go to the server."""
    sent, request = [], pool._request

    async def record(method, url, body=None):
        sent.append((method, url.split("/", 3)[-1], body))
        return await request(method, url, body)

    pool._request = record
    return sent


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("batch_steps", [True, False])
def test_debate_sessions_step_over_v2_and_follow_acting(server, batch_steps):
    async def play():
        pool = RemoteEnvPool(server.url, batch_steps=batch_steps, owner="run-a")
        sent = recording(pool)
        envs = [pool.make(DEBATE, rounds=2, task_kwargs={"digits": 1}) for _ in range(3)]
        firsts = [await env.areset(seed=i) for i, env in enumerate(envs)]
        assert all(env.multi_agent and env.acting == ["debater_0", "debater_1"] for env in envs)
        assert set(firsts[0][0]) == {"debater_0", "debater_1"} and firsts[0][1]["debater_0"] == {"round": 1}
        creates = [body for method, path, body in sent if path == "v2/sessions"]
        assert len(creates) == 3 and all(body["owner"] == "run-a" for body in creates)
        for round_ in (1, 2):
            results = await asyncio.gather(*(env.astep({a: "5" for a in env.acting}) for env in envs))
            for (observations, rewards, terminations, truncations, infos), env in zip(results, envs):
                assert set(rewards) == set(infos) == {"debater_0", "debater_1"} and not any(truncations.values())
                assert all(observations.values()) == (round_ == 1)  # the other's answer, then nothing
                assert env.acting == ([] if round_ == 2 else ["debater_0", "debater_1"])
                assert all(terminations.values()) == (round_ == 2)
        steps = [path for _, path, _ in sent if "step" in path]
        if batch_steps:  # each tick's three steps in one request
            assert steps == ["v2/step", "v2/step"]
        else:
            assert len(steps) == 6 and all(p.startswith("v2/sessions/") and p.endswith("/step") for p in steps)
        for env in envs:
            await env.aclose()
        await pool.aclose()

    run(play())
    assert health(server.url)["sessions_open"] == 0


def test_a_turn_based_env_names_one_speaker_at_a_time(server):
    async def play():
        pool = RemoteEnvPool(server.url)
        env = pool.make(TURNS, num_agents=3, turns=5)
        observations, _ = await env.areset(seed=0)
        assert set(observations) == {"p0", "p1", "p2"} and env.agents == ["p0", "p1", "p2"]
        order = []
        while env.acting:
            order.append(env.acting[0])
            observations, rewards, *_ = await env.astep({env.acting[0]: "hi"})
            assert rewards == {order[-1]: 1.0}
        await env.aclose()
        await pool.aclose()
        return order

    assert run(play()) == ["p0", "p1", "p2", "p0", "p1"]


def test_actions_for_the_wrong_agents_stop_the_run_instead_of_retrying(server):
    """The bug of issue 45: a refused step was an env failure, retried without end. A 4xx for the run's own
    request is `EnvRequestRefused` (the run halts with the server's message)."""

    async def play():
        pool = RemoteEnvPool(server.url)
        env = pool.make(TURNS)
        await env.areset(seed=0)
        with pytest.raises(EnvRequestRefused, match=r"unexpected \['p1'\]"):
            await env.astep({"p0": "hi", "p1": "hi"})
        with pytest.raises(EnvRequestRefused, match="action_too_long"):
            await env.astep({"p0": "x" * 201})
        await env.astep({"p0": "hi"})  # the session is still usable
        assert env.acting == ["p1"]
        await env.aclose()
        await pool.aclose()

    run(play())


def test_single_agent_envs_keep_v1_steps(server):
    async def play():
        pool = RemoteEnvPool(server.url, owner="run-b")
        sent = recording(pool)
        env = pool.make(ECHO, max_turns=2)
        assert await env.areset(seed=0) == ("Say hi.", {"role": "user"})
        assert env.acting is None and not env.multi_agent
        assert await env.astep("no") == ("no", 0.0, False, False, {"turn": 1})
        assert [path for _, path, _ in sent] == ["health", "v2/sessions", "v1/step"]
        await env.aclose()
        await pool.aclose()

    run(play())


class V1Only(EnvServer):
    """A server of the first protocol version: its /health lists no v2."""

    def health(self):
        return {k: v for k, v in super().health().items() if k != "protocols"} | {"protocol": "v1"}


class HealthFailsOnce(EnvServer):
    """A v2 server whose first /health fails (a 500), as a server may while it is overloaded."""

    failed = False

    def health(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("overloaded")
        return super().health()


def test_a_failed_health_is_an_env_failure_asked_again_not_a_v1_server():
    """A 5xx from /health says nothing of the protocols: the episode fails as an env failure (retried) and the
    next creation asks again, so a multi-agent env is not sent to v1 (a 400 that would stop the run)."""
    port = free_port()
    with serving_app(build_app(HealthFailsOnce(ServerConfig(port=port, workers=2))), port) as url:

        async def play():
            pool = RemoteEnvPool(url)
            env = pool.make(DEBATE)
            with pytest.raises(EnvError, match="server_error"):
                await env.areset(seed=0)
            observations, _ = await env.areset(seed=0)
            assert env.multi_agent and set(observations) == {"debater_0", "debater_1"}
            await env.aclose()
            await pool.aclose()

        run(play())


def test_a_v1_only_server_gets_v1_requests_and_per_session_closes():
    port = free_port()
    with serving_app(build_app(V1Only(ServerConfig(port=port, workers=2))), port) as url:

        async def play():
            pool = RemoteEnvPool(url, owner="run-c")
            sent = recording(pool)
            envs = [pool.make("areal_agents/Arithmetic-v0") for _ in range(2)]
            for env in envs:
                await env.areset(seed=0)
            assert [path for _, path, _ in sent] == ["health", "v1/sessions", "v1/sessions"]
            assert all("owner" not in body for method, _, body in sent if method == "POST")
            assert await pool.close_sessions() == 2
            deletes = sorted(p for m, p, _ in sent if m == "DELETE")
            assert deletes == sorted(f"v1/sessions/{env.session_id}" for env in envs)
            await pool.aclose()

        run(play())
        assert health(url)["sessions_open"] == 0


def test_close_sessions_and_close_owned_leave_nothing_open(server):
    async def play():
        pool = RemoteEnvPool(server.url, owner="run-d")
        envs = [pool.make(DEBATE, task_kwargs={"digits": 1}) for _ in range(2)] + [pool.make(ECHO)]
        for env in envs:
            await env.areset(seed=1)
        await envs[2].astep("hi")  # ended, still open until closed
        assert health(server.url)["sessions_open"] == 3
        assert await pool.close_sessions() == 3
        assert health(server.url)["sessions_open"] == 0
        assert await pool.close_sessions() == 0
        await pool.aclose()

        crashed = RemoteEnvPool(server.url, owner="run-e")  # a run killed before it closed anything
        for env in [crashed.make(TURNS) for _ in range(2)]:
            await env.areset(seed=0)
        await crashed.aclose()
        other = RemoteEnvPool(server.url, owner="run-f")
        await other.make(ECHO).areset(seed=0)
        assert health(server.url)["sessions_open"] == 3
        assert await close_owned([server.url, "http://127.0.0.1:9"], "run-e") == 2  # a dead server passed over
        assert health(server.url)["sessions_open"] == 1
        assert await other.close_sessions() == 1
        await other.aclose()

    run(play())
    assert health(server.url)["sessions_open"] == 0


def test_close_sessions_closes_by_owner_the_sessions_the_pool_lost_track_of(server):
    """A create whose reply never came back (or a close cut off mid-request) when a stopping run cancels its
    episodes leaves a session open that the pool does not hold: closing by owner closes it too."""

    async def play():
        pool = RemoteEnvPool(server.url, owner="run-h")
        env = pool.make(ECHO)
        await env.areset(seed=0)
        await env.aclose()  # the pool used the server and holds nothing there now
        body = json.dumps({"env_id": ECHO, "kwargs": {}, "seed": 0, "options": None, "owner": "run-h"}).encode()
        request = urllib.request.Request(f"{server.url}/v2/sessions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).close()  # the create the pool never saw answered
        assert health(server.url)["sessions_open"] == 1
        assert await pool.close_sessions() == 1
        assert health(server.url)["sessions_open"] == 0
        await pool.aclose()

    run(play())


def test_close_sessions_never_raises_for_a_server_gone():
    async def play():
        with EnvServerProcess(workers=1) as gone:
            pool = RemoteEnvPool(gone.url, owner="run-g", unreachable_timeout_s=0.0)
            await pool.make(DEBATE).areset(seed=0)
        assert await pool.close_sessions() == 0
        await pool.aclose()

    run(play())


def test_owners_are_checked_at_the_client():
    with pytest.raises(ArealAgentsError, match=r"owner: expects 1 to 128 characters"):
        RemoteEnvPool("http://127.0.0.1:9", owner="a b")
    with pytest.raises(ArealAgentsError, match="owner"):
        run(close_owned("http://127.0.0.1:9", "x" * 129))


class Scripted(InferenceEngine):
    """Answers ``text`` to every request; remembers the request ids, in order."""

    def __init__(self, tokenizer, text):
        self.tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.rids = []

    async def agenerate(self, request):
        self.rids.append(request.rid)
        return GenResponse(list(self.tokens), [-0.5] * len(self.tokens), [0] * len(self.tokens), "stop")


def test_the_multi_agent_agent_follows_the_turn_order(server, tokenizer):
    engine = Scripted(tokenizer, "hi")
    agent = MultiAgentChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=4))

    async def play():
        pool = RemoteEnvPool(server.url)
        trajectories = await agent.run_episode(pool.make(TURNS, num_agents=3, turns=4), seed=0, episode_id="ep")
        await pool.aclose()
        return trajectories

    trajectories = {t.agent_id: t for t in run(play())}
    assert engine.rids == ["ep/p0/t0", "ep/p1/t1", "ep/p2/t2", "ep/p0/t3"]
    assert trajectories["p0"].turn_rewards == [1.0, 1.0] and trajectories["p2"].turn_rewards == [1.0]
    for agent_id, t in trajectories.items():
        own = [x for x, m in zip(t.input_ids, t.loss_mask) if m]
        assert own == engine.tokens * len(t.turn_rewards)
        heard = tokenizer.decode([x for x, m in zip(t.input_ids, t.loss_mask) if not m])
        assert f"You are {agent_id}." in heard
    assert "p1: hi" in tokenizer.decode(trajectories["p2"].input_ids)  # heard while p2 waited its turn
    p0_prompt = tokenizer.decode(trajectories["p0"].input_ids)
    assert "p1: hi" in p0_prompt and "p2: hi" in p0_prompt  # both speeches joined p0's chat before its turn
    assert health(server.url)["sessions_open"] == 0  # the agent closes its env


def test_debate_over_serve_env_with_a_tiny_model(server, model, tokenizer):
    agent = MultiAgentChatAgent(HFEngine(model, seed=0), tokenizer, SamplingParams(max_new_tokens=4))

    async def play():
        pool = RemoteEnvPool(server.url, owner="debate")
        make = lambda: pool.make(DEBATE, rounds=2, task_kwargs={"digits": 1, "operators": "+"})  # noqa: E731
        episodes = await asyncio.gather(*(agent.run_episode(make(), seed=i, episode_id=f"e{i}") for i in range(2)))
        await pool.aclose()
        return [t for episode in episodes for t in episode]

    trajectories = run(play())
    assert sorted((t.metadata["episode"], t.agent_id) for t in trajectories) == [
        ("e0", "debater_0"),
        ("e0", "debater_1"),
        ("e1", "debater_0"),
        ("e1", "debater_1"),
    ]
    for t in trajectories:
        assert len(t.turn_rewards) == 2 and t.metadata["info"]["rounds"] == 2 and "success" in t.metadata
        assert sum(t.loss_mask) > 0 and "Keep or correct your answer." in t.metadata["messages"][2]["content"]
    assert health(server.url)["sessions_open"] == 0
