"""The chaos suite's closing section: each test's summary line (requests by kind, 5xx for client errors,
services alive; steps lost or duplicated), in the test log whatever pytest captured."""

from chaos_fuzz import SUMMARIES


def pytest_terminal_summary(terminalreporter):
    if SUMMARIES:
        terminalreporter.section("chaos suite")
        for line in SUMMARIES:
            terminalreporter.write_line(line)
