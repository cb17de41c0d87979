"""FutureStore: per-queue FIFO in arrival order, long-polls, failures by category, results kept then dropped."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal_agents.errors import RequestError
from areal_agents.tinker.futures import TRY_AGAIN, FailedRequest, FutureStore, StoreFull
from areal_agents.tinker.wire import WireError


def run(coro):
    return asyncio.run(coro)


def test_one_queue_runs_its_jobs_one_at_a_time_in_arrival_order():
    async def main():
        store, order, running = FutureStore(), [], []

        def job(name, gate=None):
            async def body():
                running.append(name)
                assert len(running) == 1, f"{running} ran at once"
                if gate is not None:
                    await gate.wait()
                order.append(name)
                running.remove(name)
                return name

            return body

        gate = asyncio.Event()
        ids = [store.submit(job("fwdbwd", gate), "s", queue="m0")]
        ids += [store.submit(job(n), "s", queue="m0") for n in ("optim", "save")]
        await asyncio.sleep(0)
        assert order == []  # optim waits for the forward_backward posted before it
        gate.set()
        results = [await store.retrieve(i, wait_s=5) for i in ids]
        return order, results

    order, results = run(main())
    assert order == results == ["fwdbwd", "optim", "save"]


def test_jobs_of_different_queues_and_unqueued_jobs_run_side_by_side():
    async def main():
        store, gate, started = FutureStore(), asyncio.Event(), []

        async def wait_gate(name):
            started.append(name)
            await gate.wait()
            return name

        ids = [store.submit(lambda n=n: wait_gate(n), "s", queue=q) for n, q in (("a", "m0"), ("b", "m1"), ("c", None))]

        async def all_started():
            while len(started) < 3:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(all_started(), 10)  # each waits on the gate: they can only all start side by side
        gate.set()
        return sorted([await store.retrieve(i, wait_s=5) for i in ids])

    assert run(main()) == ["a", "b", "c"]


def test_retrieve_holds_the_poll_then_answers_try_again_and_later_the_result():
    async def main():
        store, gate = FutureStore(), asyncio.Event()

        async def slow():
            await gate.wait()
            return {"ok": 1}

        rid = store.submit(slow, "s", queue="m0")
        first = await store.retrieve(rid, wait_s=0.05)
        gate.set()
        return first, await store.retrieve(rid, wait_s=5), await store.retrieve(rid, wait_s=5)

    first, second, again = run(main())
    assert first is TRY_AGAIN
    assert second == again == {"ok": 1}  # a lost reply can be polled again


def test_retrieve_refuses_a_zero_wait_and_unknown_ids():
    async def main():
        store = FutureStore()
        rid = store.submit(lambda: 1, "s")
        with pytest.raises(ValueError, match="wait_s"):
            await store.retrieve(rid, wait_s=0)
        with pytest.raises(KeyError):
            await store.retrieve("req-nope", wait_s=1)

    run(main())


def test_plain_functions_run_in_a_thread_and_coroutine_objects_are_awaited():
    async def main():
        store = FutureStore()
        loop_thread = threading.get_ident()
        a = store.submit(lambda: threading.get_ident() != loop_thread, "s", queue="m0")

        async def coro():
            return "awaited"

        b = store.submit(coro(), "s", queue="m0")
        return await store.retrieve(a, wait_s=5), await store.retrieve(b, wait_s=5)

    assert run(main()) == (True, "awaited")


def test_failures_are_the_users_for_request_errors_else_the_servers():
    async def main():
        store = FutureStore()

        def user():
            raise RequestError("loss_fn: expects one of cross_entropy, ppo; got 'bad'")

        def wire():
            raise WireError("data[0].loss_fn_inputs['weights']", "expects length 3, got 2")

        def bug():
            raise ZeroDivisionError("division by zero")

        ids = [store.submit(f, "s", queue="m0") for f in (user, wire, bug)]
        ids.append(store.submit(lambda: "after", "s", queue="m0"))  # the queue goes on after failures
        return [await store.retrieve(i, wait_s=5) for i in ids]

    user, wire, bug, after = run(main())
    assert user == FailedRequest("loss_fn: expects one of cross_entropy, ppo; got 'bad'", "user")
    assert wire.to_json() == {"error": "data[0].loss_fn_inputs['weights']: expects length 3, got 2", "category": "user"}
    assert bug == FailedRequest("internal error: ZeroDivisionError: division by zero", "server")
    assert after == "after"


def test_dropping_an_owner_forgets_its_results_and_skips_its_queued_jobs():
    async def main():
        store, started, gate, ran = FutureStore(), asyncio.Event(), asyncio.Event(), []

        async def first():
            started.set()
            await gate.wait()
            ran.append("first")

        async def second():
            ran.append("second")

        a = store.submit(first, "s1", queue="m0")
        b = store.submit(second, "s1", queue="m0")
        await asyncio.wait_for(started.wait(), 10)
        assert store.drop_owner("s1") == 2
        later = store.submit(lambda: "kept", "s2", queue="m0")  # done only once the queue got past `second`
        gate.set()
        kept = await store.retrieve(later, wait_s=5)
        return a in store, b in store, ran, kept

    assert run(main()) == (False, False, ["first"], "kept")  # the running job ends, the queued one never runs


def test_fetched_results_are_dropped_after_the_grace_and_pending_ones_are_capped():
    async def main():
        store = FutureStore(max_pending=1, keep_fetched_s=0.0)
        rid = store.submit(lambda: 1, "s")
        assert await store.retrieve(rid, wait_s=5) == 1
        gate = asyncio.Event()
        store.submit(gate.wait, "s")  # submitting sweeps results fetched longer than the grace ago
        assert rid not in store
        with pytest.raises(StoreFull, match="1 requests are pending"):
            store.submit(lambda: 2, "s")
        gate.set()
        await store.close()

    run(main())
