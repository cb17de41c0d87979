import threading
import time

import pytest


def _finishes_within(seconds, fn, *args):
    """``fn(*args)`` in a daemon thread (not the main one: no signal-based timeout can help); its value or
    its exception, or a test failure if it ran past ``seconds`` (measured: a regex or a big-integer
    operation holds the GIL, so the join itself may return late)."""
    out, raised = [], []

    def target():
        try:
            out.append(fn(*args))
        except BaseException as e:  # re-raised in the test's thread
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(seconds)
    elapsed = time.perf_counter() - start
    if raised:
        raise raised[0]
    assert out and elapsed < seconds, f"{fn.__name__} took {elapsed:.1f}s (limit {seconds}s)"
    return out[0]


@pytest.fixture
def finishes_within():
    return _finishes_within
