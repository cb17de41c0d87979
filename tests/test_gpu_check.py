"""The device check's driver (bench/gpu_check.py) without a device: arguments, caps, the JSON kept as it goes,
PASS/FAIL/SKIP lines and the exit code. Its parts are fakes here (the real ones need minutes and, for their
figures, a GPU: `bash scripts/gpu_check.sh --cpu-rehearsal` runs them on the CPU)."""

import json
import sys
import time
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check

    return gpu_check


def test_arguments_default_out_to_dollar_out_and_reject_bad_parts(gpu_check, monkeypatch, capsys):
    monkeypatch.setenv("OUT", "/tmp/device-out")
    args = gpu_check.parse_args([])
    assert (args.out, args.parts, args.cpu_rehearsal) == ("/tmp/device-out", "abdec", False)
    for bad in (["--parts", "az"], ["--parts", ""], ["--parts", "aa"], ["--cap-scale", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2
    assert "--parts: expects distinct letters of 'abdec', got 'az'" in capsys.readouterr().err


def test_every_record_is_in_the_json_file_when_it_is_printed(gpu_check, tmp_path, capsys):
    path = tmp_path / "out" / "gpu_check.json"
    report = gpu_check.Report(path, {"device": "cpu"})
    report.check("a", "matmul_peak", True, tflops=791.25)
    assert [r["name"] for r in json.loads(path.read_text())] == ["environment", "matmul_peak"]
    report.check("a", "ppo_step", False, mfu=0.21)
    records = json.loads(path.read_text())
    assert [(r["part"], r["status"], r["name"]) for r in records] == [
        ("meta", "INFO", "environment"),
        ("a", "PASS", "matmul_peak"),
        ("a", "FAIL", "ppo_step"),
    ]
    assert records[2]["mfu"] == 0.21 and report.failed == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["PASS a. matmul_peak tflops=791.2", "FAIL a. ppo_step mfu=0.21"]
    with pytest.raises(ValueError, match="status: expects PASS, FAIL, SKIP or INFO, got 'OK'"):
        report.add("a", "OK", "x")


def test_a_part_past_its_cap_skips_the_rest_and_says_so(gpu_check, tmp_path):
    report = gpu_check.Report(tmp_path / "r.json", {})
    done = []

    def part(cap):
        report.check("b", "first", True)
        done.append("first")
        cap.end = 0.0  # the cap has passed
        cap.check("HFEngine at 256 concurrent requests")
        done.append("second")  # never reached

    gpu_check.run_part(report, "b", 60, part)
    assert done == ["first"]
    statuses = [(r["status"], r["name"]) for r in report.records[1:]]
    assert statuses == [("PASS", "first"), ("SKIP", "cap"), ("INFO", "seconds")]
    assert report.records[2]["reason"] == (
        "past its 60s cap: HFEngine at 256 concurrent requests and the rest of the part skipped"
    )
    assert report.failed == 0


def test_a_part_stuck_past_its_cap_is_interrupted(gpu_check, tmp_path, monkeypatch):
    """A piece of work that never returns to a `Cap.check` (a whole SFT run) is stopped by SIGALRM."""
    monkeypatch.setattr(gpu_check, "HARD_GRACE_S", 0.05)
    report = gpu_check.Report(tmp_path / "r.json", {})

    def stuck(cap):
        try:
            time.sleep(5)
        except Exception:  # noqa: BLE001  (project code catching everything must not swallow the stop)
            pass

    start = time.monotonic()
    gpu_check.run_part(report, "c", 0.05, stuck)
    assert time.monotonic() - start < 2
    assert report.records[1]["status"] == "SKIP" and "interrupted mid-way" in report.records[1]["reason"]


@pytest.mark.process
def test_an_error_in_a_part_is_a_fail_line_and_the_next_part_runs(gpu_check, tmp_path, monkeypatch):
    calls = []

    def broken(ctx, cap):
        calls.append("a")
        raise KeyError("mismatch_kl")

    def fine(ctx, cap):
        calls.append("e")
        ctx.report.check("e", "mismatch_kl", True, mismatch_kl=0.001)

    fake = types.SimpleNamespace(PART={"a": broken, "e": fine}, finish=lambda ctx: calls.append("finish"))
    monkeypatch.setitem(sys.modules, "gpu_check_parts", fake)
    rc = gpu_check.main(["--cpu-rehearsal", "--out", str(tmp_path), "--work", str(tmp_path), "--parts", "ae"])
    assert rc == 1 and calls == ["a", "e", "finish"]
    records = json.loads((tmp_path / "gpu_check.json").read_text())
    fail = next(r for r in records if r["status"] == "FAIL")
    assert fail["part"] == "a" and fail["error"] == "KeyError: 'mismatch_kl'"
    assert any(r["status"] == "PASS" and r["part"] == "e" for r in records)
    assert records[0]["device"] == "cpu" and records[0]["sizes"]["recipe_preset"] == "tiny"


@pytest.mark.process
def test_all_passing_parts_exit_0(gpu_check, tmp_path, monkeypatch):
    fake = types.SimpleNamespace(
        PART={"d": lambda ctx, cap: ctx.report.check("d", "in_process", True)}, finish=lambda ctx: None
    )
    monkeypatch.setitem(sys.modules, "gpu_check_parts", fake)
    assert gpu_check.main(["--cpu-rehearsal", "--out", str(tmp_path), "--work", str(tmp_path), "--parts", "d"]) == 0
