"""`RemoteEnvPool` over several env-step servers (real processes): sessions spread round-robin and stay
on their server; a server killed mid-episode ends that episode as an env failure (``server_lost``), new
sessions go to the servers that answer, and ``resolve`` brings in replacement addresses."""

import asyncio
import signal

import pytest

from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool
from areal_agents.errors import EnvError

ENV = "areal_agents/Arithmetic-v0"


@pytest.mark.process
def test_sessions_spread_and_survive_a_lost_replica():
    with EnvServerProcess(workers=1) as a, EnvServerProcess(workers=1) as b, EnvServerProcess(workers=1) as c:
        resolved = []

        async def resolve():
            resolved.append(1)
            return [b.url, c.url]  # a's replacement: c

        async def run():
            pool = RemoteEnvPool([a.url, b.url], resolve=resolve)
            try:
                envs = [pool.make(ENV) for _ in range(4)]
                firsts = [await env.areset(seed=i) for i, env in enumerate(envs)]
                assert [env.server for env in envs] == [a.url, b.url, a.url, b.url]
                steps = await asyncio.gather(*(env.astep("0") for env in envs))  # batched per server
                assert all(s[2] for s in steps)
                assert firsts[0][0] != firsts[1][0]
                await asyncio.gather(*(env.areset(seed=9) for env in envs))
                on_a = [env for env in envs if env.server == a.url]
                a.process.send_signal(signal.SIGKILL)
                a.process.wait()
                with pytest.raises(EnvError, match="server_lost"):
                    await on_a[0].astep("0")
                await on_a[1].aclose()  # closing a session of a dead server is not an error
                fresh = [pool.make(ENV) for _ in range(4)]
                for env in fresh:
                    await env.areset(seed=1)
                assert {env.server for env in fresh} <= {b.url, c.url} and resolved
                await asyncio.sleep(0.1)  # the background re-resolve lands
                more = [pool.make(ENV) for _ in range(4)]
                for env in more:
                    await env.areset(seed=2)
                assert {env.server for env in more} == {b.url, c.url}
            finally:
                await pool.aclose()

        asyncio.run(run())


def test_no_replica_answering_is_the_unreachable_error():
    async def run():
        pool = RemoteEnvPool(["http://127.0.0.1:9", "http://127.0.0.1:10"])
        try:
            await pool.make(ENV).areset()
        finally:
            await pool.aclose()

    with pytest.raises(EnvError, match="unreachable") as caught:
        asyncio.run(run())
    assert caught.value.kind == "unreachable"  # an env failure: the episode runner retries it


@pytest.mark.process
def test_a_creation_waits_for_a_place_when_every_server_is_at_its_cap():
    """A run may want more episodes at once than the servers take: a 429 waits for a closed session, on any
    replica, and only a cap that stays full for the pool's timeout is an error."""
    with EnvServerProcess(workers=1, max_sessions=1) as a, EnvServerProcess(workers=1, max_sessions=1) as b:

        async def run():
            pool = RemoteEnvPool([a.url, b.url], timeout=3.0)
            try:
                first, second, third = pool.make(ENV), pool.make(ENV), pool.make(ENV)
                await first.areset(seed=0)
                await second.areset(seed=1)  # a is full: b takes it
                assert {first.server, second.server} == {a.url, b.url}
                waiting = asyncio.ensure_future(third.areset(seed=2))
                await asyncio.sleep(0.3)
                assert not waiting.done()  # both full: it waits rather than failing
                await first.aclose()
                await waiting
                assert third.server == first.server
                with pytest.raises(EnvError, match="server_full"):
                    await pool.make(ENV).areset(seed=3)  # nobody closes: after 3 s, the 429 (an env failure)
            finally:
                await pool.aclose()

        asyncio.run(run())
