"""What a `RemoteEnvPool` makes of an env server's failures: env-side faults (no answer, a 5xx, a lost session,
an env that raises) are env failures the episode runner retries; a 4xx is the run's own mistake, raised as
`EnvRequestRefused` (a `RunHalted`: the run stops) with the server's own status and message, whether the
step went alone or in a batch; no server answering past ``unreachable_timeout_s`` stops the run too."""

import asyncio
import json
import time

import pytest
from app_in_thread import serving_app
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from areal_agents.envs.runtime.remote import (
    EnvRequestRefused,
    EnvServerProcess,
    EnvServerUnreachable,
    RemoteEnvPool,
    _by_size,
)
from areal_agents.errors import EnvError, RunHalted
from areal_agents.rollout.episodes import failure_kind

ENV = "areal_agents/Arithmetic-v0"
pytestmark = pytest.mark.slow  # starts env servers


@pytest.fixture(scope="module")
def strict_server():
    """serve-env taking actions of at most 2 characters: a longer one is a 400 ``action_too_long``."""
    with EnvServerProcess(workers=1, max_action_chars=2, module="areal_agents.envs.testing") as server:
        yield server


def run(coro_fn, *args, **pool_kwargs):
    async def main():
        pool = RemoteEnvPool(*args, **pool_kwargs)
        try:
            return await coro_fn(pool)
        finally:
            await pool.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("batch_steps", [True, False])
def test_a_4xx_step_is_the_runs_mistake_with_its_own_status(strict_server, batch_steps):
    async def step_too_long(pool):
        env = pool.make(ENV, digits=1)
        await env.areset(seed=0)
        await env.astep("12345")

    with pytest.raises(EnvRequestRefused) as caught:
        run(step_too_long, strict_server.url, batch_steps=batch_steps)
    error = caught.value
    assert (error.status, error.type) == (400, "action_too_long")  # a batch item's 400 was reported as a 404
    assert "action_too_long (400)" in str(error) and "--max-action-chars" in str(error)
    assert isinstance(error, RunHalted) and failure_kind(error) == "halt"


def test_bad_kwargs_are_the_runs_mistake(strict_server):
    async def create(pool):
        await pool.make(ENV, no_such_kwarg=1).areset(seed=0)

    with pytest.raises(EnvRequestRefused, match=r"bad_request \(400\)"):
        run(create, strict_server.url)


def test_an_env_that_raises_and_a_lost_session_are_env_failures(strict_server):
    async def raises(pool):
        env = pool.make("areal_agents_testing/Faulty-v0", error_rate=1.0)
        await env.areset(seed=0)
        await env.astep("x")

    with pytest.raises(EnvError) as caught:
        run(raises, strict_server.url)
    assert caught.value.kind == "env_error" and failure_kind(caught.value) == "env"

    async def lost(pool):
        env = pool.make(ENV, digits=1)
        await env.areset(seed=0)
        await pool._request("DELETE", f"{env.server}/v1/sessions/{env.session_id}")  # expired, say
        await env.astep("1")

    with pytest.raises(EnvError) as caught:
        run(lost, strict_server.url)
    assert caught.value.kind == "session_lost" and failure_kind(caught.value) == "env"


def test_a_5xx_is_an_env_failure():
    app = FastAPI()

    @app.post("/v1/sessions")
    def broken() -> JSONResponse:
        return JSONResponse({"error": {"type": "internal", "message": "disk full"}}, status_code=503)

    async def create(pool):
        await pool.make(ENV).areset(seed=0)

    with serving_app(app) as url, pytest.raises(EnvError) as caught:
        run(create, url)
    assert caught.value.kind == "server_error" and "503" in str(caught.value) and "disk full" in str(caught.value)


def test_no_server_answering_fails_episodes_then_stops_the_run_after_the_timeout():
    async def twice(pool):
        with pytest.raises(EnvError, match="unreachable"):  # at first: an env failure, retried
            await pool.make(ENV).areset(seed=0)
        await asyncio.sleep(0.6)
        await pool.make(ENV).areset(seed=0)

    started = time.monotonic()
    with pytest.raises(EnvServerUnreachable, match=r"env.unreachable_timeout_s=0.5") as caught:
        run(twice, "http://127.0.0.1:9", unreachable_timeout_s=0.5)
    assert failure_kind(caught.value) == "halt" and time.monotonic() - started < 60


def test_an_answer_resets_the_unreachable_clock(strict_server):
    async def flaky(pool):
        pool.urls = ["http://127.0.0.1:9"]
        with pytest.raises(EnvError, match="unreachable"):
            await pool.make(ENV).areset(seed=0)
        pool.urls = [strict_server.url]
        await asyncio.sleep(0.6)
        await pool.make(ENV).areset(seed=0)  # answered: the clock starts again
        pool.urls = ["http://127.0.0.1:9"]
        with pytest.raises(EnvError, match="unreachable"):
            await pool.make(ENV).areset(seed=0)

    run(flaky, strict_server.url, unreachable_timeout_s=0.5)


def test_batched_steps_are_split_under_the_body_limit():
    items = [(f"s{i}", "x" * 400_000, None) for i in range(6)]
    batches = _by_size(items, 1 << 20)
    assert [len(b) for b in batches] == [2, 2, 2] and [i for b in batches for i in b] == items
    assert all(len(json.dumps([a for _, a, _ in b])) < 1 << 20 for b in batches)
    assert _by_size([("s", "y" * (2 << 20), None)], 1 << 20) == [[("s", "y" * (2 << 20), None)]]  # alone, whole
