import contextlib
import os
import sys

import pytest
import transformers
from unit_guard import unit_guard

from areal_agents.models import load_model, load_tokenizer, save_tiny_model

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# CI=true (set by .ci/run): CI installs every optional extra, so a skip there means a test did not run. A
# skipped test becomes a failure naming its reason; a module skipped at collection (importorskip) fails the
# run from the terminal summary. Tests deselected by marker (-m) are not skips.
IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1")
_collection_skips: list[tuple[str, str]] = []


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


# The tiers: `unit` (every test with none of TIERS; no process, server or Ray, which unit_guard enforces) within
# the default run (not slow) within the full run (everything, scripts/test.sh).
TIERS = ("process", "slow", "vllm")
SERVER_FIXTURES = {"serve_env_url", "serve_model_url"}  # tests/sdk/conftest.py: each starts a server process
VIOLATIONS = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.process)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)


def pytest_collection_finish(session):
    if session.items and all(item.get_closest_marker("unit") for item in session.items) and "ray" in sys.modules:
        raise pytest.UsageError(
            "every test collected is unit, yet collecting them imported ray: import it inside the tests that need it "
            "(and mark those process)"
        )


def _guarded(item):
    if item.get_closest_marker("unit") is None:
        return contextlib.nullcontext()
    return unit_guard(item.stash.setdefault(VIOLATIONS, []))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    violations = item.stash.get(VIOLATIONS, [])
    if violations and not report.failed:  # the test caught the guard's error: it fails all the same
        report.outcome = "failed"
        report.longrepr = f"a unit test {'; '.join(dict.fromkeys(violations))}: mark it `process`"
    violations.clear()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every test must run: {_skip_reason(report)}"
    return report


def pytest_collectreport(report):
    if IN_CI and report.skipped:
        _collection_skips.append((report.nodeid, _skip_reason(report)))


def pytest_terminal_summary(terminalreporter):
    if _collection_skips:
        terminalreporter.section("skipped under CI=true, where every test must run", red=True)
        for nodeid, reason in _collection_skips:
            terminalreporter.write_line(f"FAILED (skipped at collection) {nodeid}: {reason}", red=True)


def pytest_sessionfinish(session, exitstatus):
    if _collection_skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A freshly built tiny model + tokenizer, saved as a real checkpoint directory."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, intermediate_size=128)


@pytest.fixture
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture
def model(tiny_dir):
    return load_model(tiny_dir)
