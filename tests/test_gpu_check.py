"""The device check's driver (bench/gpu_check.py) without a device: arguments, caps, the JSON kept as it goes,
PASS/FAIL/SKIP lines and the exit code. Its parts are fakes here (the real ones need minutes and, for their
figures, a GPU: `bash scripts/gpu_check.sh --cpu-rehearsal` runs them on the CPU)."""

import dataclasses
import json
import subprocess
import sys
import threading
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
    assert (args.out, args.parts, args.cpu_rehearsal) == ("/tmp/device-out", "abdetc", False)
    for bad in (["--parts", "az"], ["--parts", ""], ["--parts", "aa"], ["--cap-scale", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2
    assert "--parts: expects distinct letters of 'abdetc', got 'az'" in capsys.readouterr().err


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
    assert rc == 1 and calls == ["a", "finish", "e", "finish"]  # the failed part's reset closes the shared trainer
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


def test_a_capped_part_closes_what_it_opened_and_the_next_part_starts_with_no_leftover_thread(gpu_check, tmp_path):
    """A fake part starts a decode-like thread, registers its stop, and overruns its cap; the next part sees
    only the threads that were there before the first one."""
    report = gpu_check.Report(tmp_path / "r.json", {})
    before = set(threading.enumerate())
    resets, seen_by_next = [], []

    def overrunning(cap):
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="fake-decode", daemon=True).start()
        cap.closing(stop.set)
        cap.end = 0.0
        cap.check("the second round")

    gpu_check.run_part(report, "b", 60, overrunning, reset=lambda: resets.append("b"))
    gpu_check.run_part(report, "d", 60, lambda cap: seen_by_next.extend(set(threading.enumerate()) - before))
    assert seen_by_next == [] and resets == ["b"]
    statuses = [(r["part"], r["status"], r["name"]) for r in report.records[1:]]
    assert statuses == [
        ("b", "SKIP", "cap"),
        ("b", "INFO", "threads_stopped"),
        ("b", "INFO", "seconds"),
        ("d", "INFO", "seconds"),
    ]
    assert report.records[2]["threads"] == ["fake-decode"]


def test_a_cut_part_whose_thread_will_not_stop_is_a_fail_line_naming_it(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CLEANUP_S", 0.2)
    report = gpu_check.Report(tmp_path / "r.json", {})
    stop = threading.Event()

    def stuck_thread(cap):
        threading.Thread(target=stop.wait, name="trainer-loop", daemon=True).start()
        raise RuntimeError("CUDA error")

    try:
        gpu_check.run_part(report, "a", 60, stuck_thread)
    finally:
        stop.set()
    failed = [r for r in report.records if r["status"] == "FAIL"]
    assert [r["name"] for r in failed] == ["error", "threads_left"]
    assert failed[1]["threads"] == ["trainer-loop"] and report.failed == 2


def test_a_part_that_passes_keeps_its_threads_and_is_not_reset(gpu_check, tmp_path):
    """The shared trainer that part a opens stays open for parts d and e: only a cut part is reset."""
    report = gpu_check.Report(tmp_path / "r.json", {})
    stop, resets, closed = threading.Event(), [], []

    def opens_shared(cap):
        threading.Thread(target=stop.wait, name="shared-engine", daemon=True).start()
        cap.closing(lambda: closed.append("own"))

    try:
        gpu_check.run_part(report, "a", 60, opens_shared, reset=lambda: resets.append("a"))
        assert any(t.name == "shared-engine" for t in threading.enumerate())
    finally:
        stop.set()
    assert resets == [] and closed == ["own"] and report.failed == 0


def test_a_closer_that_hangs_is_interrupted_and_the_next_one_runs(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CLEANUP_S", 0.2)
    report = gpu_check.Report(tmp_path / "r.json", {})
    closed = []

    def part(cap):
        cap.closing(lambda: closed.append("engine"))
        cap.closing(lambda: time.sleep(5))  # registered last, closed first

    start = time.monotonic()
    gpu_check.run_part(report, "b", 60, part)
    assert time.monotonic() - start < 2 and closed == ["engine"]
    fail = next(r for r in report.records if r["status"] == "FAIL")
    assert fail["name"] == "cleanup" and "closing took over 0s" in fail["error"]


def test_renew_loop_cancels_what_a_cut_part_left(gpu_check):
    import asyncio

    loop = asyncio.new_event_loop()
    left = loop.create_task(asyncio.sleep(60))
    loop.run_until_complete(asyncio.sleep(0))
    fresh = gpu_check.renew_loop(loop)
    try:
        assert left.cancelled() and loop.is_closed() and not fresh.is_closed()
    finally:
        fresh.close()


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check_stats

    return gpu_check_stats


def test_accuracy_slope_and_its_interval_by_hand(stats):
    # x 1..4, y .1 .3 .2 .4: mean x 2.5, mean y .25, Sxx 5, Sxy .4 -> slope .08; residuals -.03 .09 -.09 .03,
    # sum of squares .018 -> se sqrt(.018 / 2 / 5) = .042426; t(2) 4.303 -> half-width .18256
    fit = stats.slope_interval([1, 2, 3, 4], [0.1, 0.3, 0.2, 0.4])
    assert fit["slope"] == pytest.approx(0.08) and fit["slope_se"] == pytest.approx(0.042426, abs=1e-6)
    assert fit["slope_low"] == pytest.approx(0.08 - 0.18256, abs=1e-5) and fit["rise"] == pytest.approx(0.24)
    assert stats.verdict(fit) == "inconclusive"
    # y = .2 + .01 x with residuals +-.001: the interval is far above 0
    ys = [0.2 + 0.01 * x + (0.001 if x % 2 else -0.001) for x in range(1, 31)]
    assert stats.verdict(stats.slope_interval(list(range(1, 31)), ys)) == "rises"
    assert stats.verdict(stats.slope_interval(list(range(1, 31)), ys[::-1])) == "falls"


def test_slope_needs_enough_distinct_steps_and_t_rounds_down_its_df(stats):
    with pytest.raises(ValueError, match="expects 4 or more"):
        stats.slope_interval([1, 2, 3], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="two distinct x"):
        stats.slope_interval([1, 1, 1, 1], [0.1, 0.2, 0.3, 0.4])
    assert (stats.t_975(2), stats.t_975(11), stats.t_975(500)) == (4.303, 2.228, 1.960)


def test_the_step_accuracy_is_read_from_the_runs_tensorboard_logs(stats, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    for step, acc in [(1, 0.25), (2, 0.5)]:
        writer.add_scalar("rollout/accuracy", acc, step)
    writer.close()
    assert stats.step_scalars(tmp_path) == ([1.0, 2.0], [0.25, 0.5])
    assert stats.step_scalars(tmp_path, "rollout/none") == ([], [])


@pytest.fixture
def imports(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check_imports

    return gpu_check_imports


def test_the_carried_wheels_are_read_from_the_script_and_carry_peft(imports):
    wheels = imports.carried()
    assert wheels["transformers"] == "5.24.0" and wheels["peft"] == "0.21.2"  # issue 50 item 7
    assert set(imports.CARRIED_OVER_DEVICE) <= set(wheels)
    found = imports.classify({"peft": [], "torch": [], "kernels": [], "areal-agents": [], "left-pad": []}, wheels)
    assert found == {"carried": ["peft"], "device": ["torch"], "optional": ["kernels"], "missing": ["left-pad"]}


@pytest.mark.process
def test_everything_the_check_imports_is_on_the_device_or_carried(imports):
    """In a fresh interpreter (this one has imported the test suite's packages): the check's modules."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check_imports.py"), "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout)
    assert found["missing"] == [] and {"transformers", "peft", "math-verify", "fastapi"} <= set(found["carried"])
    assert {"torch", "tokenizers", "aiohttp"} <= set(found["device"])


@pytest.mark.process
@pytest.mark.process
def test_an_overrun_comes_out_of_the_later_parts_caps(gpu_check, tmp_path, monkeypatch):
    """The caps' sum bounds the parts: one that overran (inside its grace) shortens the next, and a part left
    no time is a SKIP line. Caps 60, 90 and 30 s scaled by 0.01: 0.6 + 0.9 + 0.3 = 1.8 s in all."""
    caps = []

    def overran(seconds):
        return lambda ctx, cap: (caps.append(cap.seconds), time.sleep(seconds))

    fake = types.SimpleNamespace(PART={"a": overran(1.2), "d": overran(0.7), "e": overran(0)}, finish=lambda c: None)
    monkeypatch.setitem(sys.modules, "gpu_check_parts", fake)
    monkeypatch.setattr(gpu_check, "CPU", dataclasses.replace(gpu_check.CPU, caps={"a": 60, "d": 90, "e": 30}))
    argv = ["--cpu-rehearsal", "--out", str(tmp_path), "--work", str(tmp_path), "--parts", "ade"]
    assert gpu_check.main([*argv, "--cap-scale", "0.01"]) == 0
    assert len(caps) == 2 and caps[0] == pytest.approx(0.6) and 0.5 < caps[1] < 0.6  # d: 1.8 - 1.2 left
    records = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["part"], r["reason"]) for r in records if r["name"] == "budget"] == [("e", "the parts' 2s are spent")]
