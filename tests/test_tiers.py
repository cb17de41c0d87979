"""The test tiers: `unit_guard` fails a unit test that starts a process, listens or imports Ray, even one that
catches the error; every marker is registered; and `-m unit` collects no test that needs a process or Ray."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from unit_guard import UnitTierViolation, unit_guard

ROOT = Path(__file__).resolve().parents[1]


def _listen():
    with socket.socket() as s:
        s.listen()


def _import_ray():
    import ray  # noqa: F401


@pytest.mark.parametrize(
    ("start", "what"),
    [
        (lambda: subprocess.run([sys.executable, "-c", "pass"]), "starts a subprocess"),
        (lambda: multiprocessing.get_context("spawn").Process(target=print).start(), "multiprocessing"),
        (_listen, "listens on a socket"),
        (_import_ray, "imports ray"),
    ],
    ids=["subprocess", "multiprocessing", "listen", "ray"],
)
def test_the_guard_fails_a_process_a_server_or_ray_even_when_caught(start, what):
    before = subprocess.Popen._execute_child, vars(socket.socket).get("listen")
    violations = []
    ray = sys.modules.pop("ray", None)  # an earlier test's import would hide this one (put back within the test)
    try:
        with unit_guard(violations):
            with pytest.raises(UnitTierViolation, match=what):
                start()
            try:  # a test that swallows the error is still caught by what the guard recorded
                start()
            except Exception:
                pass
    finally:
        if ray is not None:
            sys.modules["ray"] = ray
    assert len(violations) == 2 and all(what in v for v in violations)
    assert (subprocess.Popen._execute_child, vars(socket.socket).get("listen")) == before, "not put back"


def test_the_guard_lets_in_process_work_through():
    violations = []
    with unit_guard(violations):
        with socket.socket() as s:  # a client socket, or a bound one, is not a server
            s.bind(("127.0.0.1", 0))
        assert sorted([3, 1, 2]) == [1, 2, 3]
    assert violations == []


def test_the_tier_markers_are_registered_and_markers_are_strict():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in options["markers"]}
    assert {"unit", "process", "slow", "vllm"} <= registered
    assert "--strict-markers" in options["addopts"]


@pytest.mark.process
def test_the_unit_tier_collects_no_cluster_test_and_imports_no_ray():
    """`-m unit` collection, in a fresh interpreter: conftest refuses it if it imported Ray."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "unit", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and not [i for i in ids if i.startswith("tests/cluster/")]
    assert "tests/test_tiers.py::test_the_unit_tier_collects_no_cluster_test_and_imports_no_ray" not in ids
