"""Live-request latency through the gateway with and without training: the same users, the same model.

    .venv/bin/python bench/gateway.py [--sft-model runs/live/sft/model] [--steps 20] [--users 32] [--rounds 1]

Two modes, one after the other (``--rounds 2``: alternated, figures pooled): ``train examples/live/rl.yaml``
(rollout.source=gateway: the engine serves live calls while the run trains on them; a weight update pauses,
loads and resumes it, calls waiting through), then ``serve-gateway`` on the same model and engine settings, no
trainer, for as long as the first mode's traffic lasted (or ``--seconds``). The same load in both, as
examples/live/app.py sends it: ``--users`` users, each in a loop POST /rl/sessions -> one chat completion (the
openai SDK, X-Session-Id) -> POST /rl/sessions/ID/end -> the reward ``--reward-delay`` seconds later.
Latency: each chat call's, client side (this process shares the machine's cores with the server), past a
warm-up (``--warmup-s``, ``--warmup-calls``). Without ``--sft-model`` the arithmetic SFT model is built first
(tiny-model, make_sft_data, sft: about 75 s here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

from areal_agents.envs.arithmetic import ArithmeticEnv

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "live" / "rl.yaml"
SERVE_KEYS = ("seed", "model", "engine", "rollout", "gateway")  # rl.yaml's sections serve-gateway shares


def cli(*args: object) -> list[str]:
    """The venv's ``areal-agents`` with these arguments."""
    return [sys.executable, "-m", "areal_agents.cli", *map(str, args)]


def subprocess_env() -> dict[str, str]:
    """This environment with this tree's package first on the path (what a worktree's run must import)."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def started(cmd: list[str], log: Path):
    """``cmd`` running with its output in ``log``; on exit SIGTERM, then SIGKILL to its group after 60 s."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def failed(what: str, log: Path) -> SystemExit:
    """A bench failure naming the process's log, with its last lines."""
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    return SystemExit(f"bench/gateway: {what}; the last lines of {log}:\n{tail}")


def wait_gateway(run_dir: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> dict:
    """The address a run writes to run_dir/gateway.json once it serves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise failed(f"the process exited ({proc.returncode}) before serving", log)
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((run_dir / "gateway.json").read_text())
        time.sleep(0.2)
    raise failed(f"no gateway.json in {run_dir} after {timeout_s:.0f} s", log)


@dataclass
class Traffic:
    """One mode's sessions: (chat call start, its seconds, session end), monotonic clock; errors counted."""

    sessions: list[tuple[float, float, float]] = field(default_factory=list)
    errors: int = 0
    client_cpu_s: float = 0.0  # this process's CPU time while it sent the traffic

    def span(self) -> float:
        return max(s[2] for s in self.sessions) - min(s[0] for s in self.sessions) if self.sessions else 0.0

    def measured(self, warmup_calls: int, warmup_s: float) -> Traffic:
        ordered = sorted(self.sessions)
        kept = [s for i, s in enumerate(ordered) if i >= warmup_calls and s[0] >= ordered[0][0] + warmup_s]
        return Traffic(kept, self.errors, self.client_cpu_s)


class Users:
    """``n`` users sending arithmetic sessions until ``deadline``, the process exits or the gateway stops."""

    def __init__(self, gateway: dict, args: argparse.Namespace, proc: subprocess.Popen, deadline: float) -> None:
        self.http = httpx.AsyncClient(base_url=gateway["url"], timeout=120)
        self.client = AsyncOpenAI(base_url=gateway["openai_base_url"], api_key="unused", max_retries=0, timeout=120)
        self.args, self.proc, self.deadline = args, proc, deadline
        self.stopped, self.traffic, self.pending = asyncio.Event(), Traffic(), set()

    async def run(self) -> Traffic:
        watch = asyncio.create_task(self.watch())
        await asyncio.gather(*(self.user(self.args.seed * 1000 + i) for i in range(self.args.users)))
        for task in [watch, *self.pending]:
            task.cancel()
        await asyncio.gather(watch, *self.pending, return_exceptions=True)
        await self.http.aclose()
        await self.client.close()
        return self.traffic

    async def watch(self) -> None:
        while self.proc.poll() is None and time.monotonic() < self.deadline:
            await asyncio.sleep(0.5)
        self.stopped.set()

    async def user(self, seed: int) -> None:
        rng, env = random.Random(seed), ArithmeticEnv(digits=2, operators="+", split="train")
        while not self.stopped.is_set():
            try:
                await self.session(rng, env)
            except (APIConnectionError, httpx.TransportError):
                if not await self.serving():
                    self.stopped.set()  # the gateway stopped serving
                self.traffic.errors += not self.stopped.is_set()  # e.g. a kept-alive connection the server closed
            except (APIStatusError, httpx.HTTPStatusError):
                self.traffic.errors += 1  # e.g. a 503: the engine could not serve the call

    async def serving(self) -> bool:
        with contextlib.suppress(httpx.TransportError):
            return self.proc.poll() is None and (await self.http.get("/health")).status_code == 200
        return False

    async def session(self, rng: random.Random, env: ArithmeticEnv) -> None:
        problem, _ = env.reset(seed=rng.randrange(2**31))
        opened = await self.http.post("/rl/sessions", json={"task": "add"})
        sid = opened.raise_for_status().json()["session_id"]
        start = time.monotonic()
        reply = await self.client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": problem}], extra_headers={"X-Session-Id": sid}
        )
        took = time.monotonic() - start
        (await self.http.post(f"/rl/sessions/{sid}/end")).raise_for_status()
        self.traffic.sessions.append((start, took, time.monotonic()))
        _, reward, *_ = env.step(reply.choices[0].message.content or "")
        task = asyncio.create_task(self.reward_later(sid, reward, rng.uniform(*self.args.reward_delay)))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def reward_later(self, sid: str, reward: float, delay: float) -> None:
        await asyncio.sleep(delay)
        with contextlib.suppress(httpx.TransportError):
            await self.http.post(f"/rl/sessions/{sid}/reward", json={"reward": reward})


def drive(run_dir: Path, proc: subprocess.Popen, log: Path, args: argparse.Namespace, seconds: float) -> Traffic:
    """The users' traffic on the process's gateway, for ``seconds`` at most."""
    gateway, cpu = wait_gateway(run_dir, proc, log), time.process_time()
    traffic = asyncio.run(Users(gateway, args, proc, time.monotonic() + seconds).run())
    traffic.client_cpu_s = time.process_time() - cpu
    return traffic


def engine_overrides(model: Path, args: argparse.Namespace) -> list[str]:
    """What both modes run with: the model, the engine's threads, a free port."""
    return [f"model.path={model}", f"engine.cpu_threads={args.engine_threads}", "gateway.port=0", *args.set]


def train_mode(work: Path, model: Path, args: argparse.Namespace, i: int) -> tuple[Traffic, dict]:
    """``train rollout.source=gateway`` under the users' load; its traffic and its summary.json."""
    run_dir, log = work / f"train-{i}", work / f"train-{i}.log"
    (run_dir / "gateway.json").unlink(missing_ok=True)  # an earlier run's (an --out used again)
    cmd = cli("train", RECIPE, "--overwrite", "--no-progress", f"run_dir={run_dir}", f"steps={args.steps}")
    with started(cmd + engine_overrides(model, args), log) as proc:
        traffic = drive(run_dir, proc, log, args, args.timeout_s)
        try:
            proc.wait(600)  # the final eval and checkpoint after the gateway stops
        except subprocess.TimeoutExpired:
            raise failed("the run did not finish within 600 s of its traffic", log) from None
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        raise failed(f"the run failed ({proc.returncode})", log)
    return traffic, json.loads((run_dir / "summary.json").read_text())


def serve_mode(work: Path, model: Path, args: argparse.Namespace, i: int, seconds: float) -> Traffic:
    """``serve-gateway`` (rl.yaml's model, engine, rollout and gateway sections) under the users' load."""
    run_dir, log, config = work / f"serve-{i}", work / f"serve-{i}.log", work / "serve.yaml"
    (run_dir / "gateway.json").unlink(missing_ok=True)
    recipe = yaml.safe_load(RECIPE.read_text())
    config.write_text(yaml.safe_dump({k: recipe[k] for k in SERVE_KEYS if k in recipe}))
    cmd = cli("serve-gateway", config, f"run_dir={run_dir}", f"gateway.trajectory_dir={run_dir / 'sessions'}")
    with started(cmd + engine_overrides(model, args), log) as p:
        traffic = drive(run_dir, p, log, args, seconds)
        if p.poll() is not None:
            raise failed(f"serve-gateway exited ({p.returncode}) while serving", log)
    return traffic


def build_model(work: Path) -> Path:
    """The arithmetic SFT model, as examples/live/run.sh builds it."""
    start, arith = time.perf_counter(), ROOT / "examples" / "arithmetic"
    data, sft = work / "sft_data.jsonl", work / "sft"
    steps = [
        cli("tiny-model", "--overwrite", work / "tiny"),
        [sys.executable, str(arith / "make_sft_data.py"), str(data), "--n", "20000"],
        cli("sft", arith / "sft.yaml", "--overwrite", "--no-progress", f"run_dir={sft}", f"data={data}",
            f"model.path={work / 'tiny'}"),
    ]  # fmt: skip
    for cmd in steps:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=subprocess_env())
    print(f"built the SFT model in {time.perf_counter() - start:.0f} s: {sft / 'model'}", flush=True)
    return sft / "model"


def describe(traffics: list[Traffic], args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    """p50, p99 and max latency and sessions/s of the measured calls (pooled over rounds)."""
    measured = [t.measured(args.warmup_calls, args.warmup_s) for t in traffics]
    seconds = [s[1] for t in measured for s in t.sessions]
    if len(seconds) < 2:
        raise SystemExit("bench/gateway: under 2 calls left after the warm-up; run longer or lower --warmup-*")
    rate = sum(len(t.sessions) for t in measured) / sum(t.span() for t in measured)
    p99 = statistics.quantiles(seconds, n=100, method="inclusive")[98]
    fig = {"p50": statistics.median(seconds), "p99": p99, "max": max(seconds), "rate": rate}
    errors, cpu = sum(t.errors for t in traffics), sum(t.client_cpu_s for t in traffics)
    line = (f"p50 {fig['p50']:.3f} s  p99 {fig['p99']:.3f} s  max {fig['max']:.2f} s  sessions/s {rate:.1f}  "
            f"({len(seconds)} calls measured, {errors} errors, client CPU "
            f"{cpu / sum(t.span() for t in traffics):.0%})")  # fmt: skip
    return line, fig


def header(args: argparse.Namespace, model: Path) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return (f"== bench/gateway ({cpu}, {os.cpu_count()} cores, commit {commit.stdout.strip() or 'unknown'}; "
            f"{args.users} users, model {model}, engine.cpu_threads {args.engine_threads}, {args.steps} steps x 128, "
            f"rewards after {args.reward_delay[0]:g}-{args.reward_delay[1]:g} s, {args.rounds} rounds) ==")  # fmt: skip


def run(args: argparse.Namespace, work: Path) -> None:
    model = Path(args.sft_model).resolve() if args.sft_model else build_model(work)
    trained, served, summaries = [], [], []
    for i in range(1, args.rounds + 1):
        traffic, summary = train_mode(work, model, args, i)
        trained, summaries = [*trained, traffic], [*summaries, summary]
        served.append(serve_mode(work, model, args, i, args.seconds or traffic.span()))
        print(f"round {i}: traffic with training {traffic.span():.0f} s, serving only {served[-1].span():.0f} s")
    print("\n" + header(args, model))
    line, base = describe(served, args)
    print(f"serving only:   {line}")
    line, train = describe(trained, args)
    samples = statistics.median(s["trained_samples_per_s"] for s in summaries)
    before, after = summaries[0]["accuracy_before"], statistics.median(s["accuracy_after"] for s in summaries)
    print(f"with training:  {line}  trained samples/s {samples:.1f}  held-out {before:.1%} -> {after:.1%}")
    print(f"latency ratio (training / serving only): p50 {train['p50'] / base['p50']:.1f}x  "
          f"p99 {train['p99'] / base['p99']:.1f}x  max {train['max'] / base['max']:.1f}x; "
          f"sessions/s {train['rate'] / base['rate']:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", default="", help="the arithmetic SFT model (default: build one)")
    parser.add_argument("--steps", type=int, default=20, help="training steps of the training mode")
    parser.add_argument("--users", type=int, default=32, help="concurrent users, one session at a time each")
    parser.add_argument(
        "--reward-delay", type=lambda s: tuple(map(float, s.split(","))), default=(0.5, 3.0),
        help="seconds between a session's end and its reward, uniform in LOW,HIGH",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=0, help="serving-only traffic (0: the training mode's)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both modes, alternated")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="each mode's first seconds, not measured")
    parser.add_argument("--warmup-calls", type=int, default=50, help="each mode's first calls, not measured")
    parser.add_argument("--engine-threads", type=int, default=1, help="engine.cpu_threads in both modes")
    parser.add_argument("--set", action="append", default=[], help="a model/engine/rollout/gateway override, both")
    parser.add_argument("--timeout-s", type=float, default=3600, help="the training mode's traffic at most")
    parser.add_argument("--seed", type=int, default=1, help="the users' problems")
    parser.add_argument("--out", default="", help="keep run dirs and logs here (default: a temporary dir)")
    args = parser.parse_args()
    with contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory(prefix="bench_gw_") as work:
        Path(work).mkdir(parents=True, exist_ok=True)
        run(args, Path(work).resolve())


if __name__ == "__main__":
    main()
