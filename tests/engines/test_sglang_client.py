"""`SGLangEngine`'s retries against a stand-in SGLang server (aiohttp, in the test's loop) that records
every request id: a fresh id per attempt, the abandoned attempt aborted, no retry of what would repeat."""

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest, SamplingParams

pytestmark = pytest.mark.process

OK = {
    "text": "hi",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "x",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    },
}


class StandIn:
    """Answers /generate by ``script`` (one entry per call, the last repeating): "hang" (past any client
    timeout), "ok", or ``(status, body)``; /health with ``health``. Records rids and aborted rids."""

    def __init__(self, script, health=200):
        self.script, self.health = list(script), health
        self.rids, self.aborted = [], []
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_post("/abort_request", self.abort)
        self.app.router.add_get("/health", self.health_check)

    async def generate(self, request):
        self.rids.append((await request.json())["rid"])
        step = self.script[min(len(self.rids), len(self.script)) - 1]
        if step == "hang":
            await asyncio.sleep(30)
        if step in ("hang", "ok"):
            return web.json_response(OK)
        status, body = step
        return web.Response(status=status, text=body if isinstance(body, str) else json.dumps(body))

    async def abort(self, request):
        self.aborted.append((await request.json())["rid"])
        return web.Response()

    async def health_check(self, request):
        return web.Response(status=self.health)


def generate(stand_in, **engine_kwargs):
    """One agenerate against ``stand_in``: (the response or the exception raised, the engine's stats)."""

    async def run():
        server = TestServer(stand_in.app)
        await server.start_server()
        engine = SGLangEngine([str(server.make_url(""))], backoff_s=0.01, **engine_kwargs)
        try:
            return await engine.agenerate(GenRequest("ep3/t1", [1, 2, 3], SamplingParams(2))), engine.stats
        except EngineError as e:
            return e, engine.stats
        finally:
            await engine.aclose()
            await server.close()

    return asyncio.run(run())


def test_a_retry_after_a_client_timeout_has_a_fresh_rid_and_the_first_is_aborted():
    stand_in = StandIn(["hang", "ok"])
    response, stats = generate(stand_in, request_timeout_s=0.5)
    assert response.output_tokens == [7, 8] and stats["retries"] == 1
    first, second = stand_in.rids
    assert first != second and first.startswith("ep3/t1#") and second.startswith("ep3/t1#")
    assert stand_in.aborted == [first]  # the first may still be generating there: stopped


@pytest.mark.parametrize(
    "status, body, message",
    [
        # SGLang builds SamplingParams(**sampling_params): a key its version lacks is a TypeError, a 500
        (500, {"error": {"message": "__init__() got an unexpected keyword argument 'no_stop_trim'"}}, "no_stop_trim"),
        (500, "Internal Server Error", "Internal Server Error"),  # uncaught, as FastAPI words it
        (400, {"error": {"message": "top_p must be in (0, 1], got 1.5."}}, "top_p must be"),
        (422, {"detail": "bad"}, "bad"),
        (501, "Not Implemented", "Not Implemented"),
    ],
)
def test_errors_the_server_would_repeat_are_not_retried_and_carry_its_message(status, body, message):
    stand_in = StandIn([(status, body)])  # /health answers 200: the server is fine, the request is not
    error, stats = generate(stand_in, max_retries=5)
    assert isinstance(error, EngineError) and f"HTTP {status}: " in str(error) and message in str(error)
    assert len(stand_in.rids) == 1 and stats["retries"] == 0


@pytest.mark.parametrize("status, health", [(500, 503), (503, 200), (429, 200)])
def test_transient_errors_are_retried(status, health):
    """A 500 from a server whose /health fails (a decode loop that died: the launcher restarts it), a 503,
    a 429: the next attempt may succeed."""
    stand_in = StandIn([(status, "busy"), "ok"], health=health)
    response, stats = generate(stand_in, max_retries=3)
    assert response.output_tokens == [7, 8] and stats["retries"] == 1 and len(set(stand_in.rids)) == 2


def test_a_cancelled_generation_is_aborted_on_the_server():
    stand_in = StandIn(["hang"])

    async def run():
        server = TestServer(stand_in.app)
        await server.start_server()
        engine = SGLangEngine([str(server.make_url(""))])
        task = asyncio.ensure_future(engine.agenerate(GenRequest("ep4/t0", [1, 2, 3], SamplingParams(2))))
        while not stand_in.rids:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.aclose()
        await server.close()

    asyncio.run(run())
    assert stand_in.aborted == stand_in.rids and len(stand_in.rids) == 1


@pytest.mark.parametrize("status", [400, 422])
def test_a_request_the_server_refuses_is_a_request_error(status):
    """A 4xx the server would repeat is the request's fault: a `RequestError`, which the episode runner
    never retries; a 5xx stays a plain `EngineError`."""
    from areal_agents.errors import RequestError

    refused, _ = generate(StandIn([(status, {"error": {"message": "bad input_ids"}})]), max_retries=5)
    assert isinstance(refused, RequestError)
    failed, _ = generate(StandIn([(500, "Internal Server Error")]), max_retries=5)
    assert isinstance(failed, EngineError) and not isinstance(failed, RequestError)
