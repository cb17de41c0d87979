import os

import pytest
import transformers

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
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
