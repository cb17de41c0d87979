"""A stand-in app with live users: each user asks the gateway an addition problem with the `openai` SDK, in a
session of its own, and the app scores the reply and posts the reward later (a user's verdict arrives after a
delay), as a deployed agent's feedback would. Run beside `areal-agents train examples/live/rl.yaml`:

    python examples/live/app.py --run-dir runs/live/rl --users 32 --reward-delay 0.5,3

It waits for the run's gateway (run_dir/gateway.json), sends traffic until the run stops serving, and prints
what it sent and how often the model was right, per 10 s of traffic (``--window``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
from openai import APIConnectionError, AsyncOpenAI

from areal_agents.envs.arithmetic import ArithmeticEnv


async def find_gateway(run_dir: Path, old: str | None, timeout_s: float) -> dict:
    """The gateway's address, once the run has written it (a file older than this app's start is skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "gateway.json"
        if path.exists() and path.read_text() != old:
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass  # being written
        await asyncio.sleep(0.2)
    raise SystemExit(f"app: no gateway at {run_dir / 'gateway.json'} after {timeout_s:.0f} s")


class App:
    def __init__(self, gateway: dict, args: argparse.Namespace) -> None:
        self.http = httpx.AsyncClient(base_url=gateway["url"], timeout=120)
        self.client = AsyncOpenAI(base_url=gateway["openai_base_url"], api_key="unused", max_retries=0, timeout=120)
        self.delay, self.stopped = args.reward_delay, asyncio.Event()
        self.pending: set[asyncio.Task] = set()
        self.window = args.window
        self.rewards: dict[int, list[float]] = {}  # window of traffic -> rewards
        self.start = time.monotonic()

    async def user(self, seed: int) -> None:
        rng, env = random.Random(seed), ArithmeticEnv(digits=2, operators="+", split="train")
        while not self.stopped.is_set():
            try:
                await self.one_session(rng, env)
            except (APIConnectionError, httpx.TransportError):
                if not await self.serving():
                    self.stopped.set()  # the run stopped serving

    async def serving(self) -> bool:
        """Whether the gateway still answers (a dropped keep-alive connection is no reason to stop)."""
        for _ in range(3):
            try:
                return (await self.http.get("/health")).status_code == 200
            except httpx.TransportError:
                await asyncio.sleep(1)
        return False

    async def one_session(self, rng: random.Random, env: ArithmeticEnv) -> None:
        problem, _ = env.reset(seed=rng.randrange(2**31))
        opened = (await self.http.post("/rl/sessions", json={"task": "add"})).json()
        sid = opened["session_id"]
        reply = await self.client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": problem}], extra_headers={"X-Session-Id": sid}
        )
        await self.http.post(f"/rl/sessions/{sid}/end")
        _, reward, *_ = env.step(reply.choices[0].message.content or "")
        self.rewards.setdefault(int((time.monotonic() - self.start) // self.window), []).append(reward)
        task = asyncio.create_task(self.reward_later(sid, reward, rng.uniform(*self.delay)))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def reward_later(self, sid: str, reward: float, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.http.post(f"/rl/sessions/{sid}/reward", json={"reward": reward})
        except httpx.TransportError:
            pass  # the run stopped before this verdict came


async def main(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    old = (run_dir / "gateway.json").read_text() if (run_dir / "gateway.json").exists() else None
    app = App(await find_gateway(run_dir, old, args.wait_s), args)
    users = [asyncio.create_task(app.user(args.seed * 1000 + i)) for i in range(args.users)]
    await asyncio.gather(*users)
    for task in list(app.pending):
        task.cancel()
    print("seconds  sessions  reward_mean (the live traffic's, sampled at temperature 1)")
    for k, rewards in sorted(app.rewards.items()):
        print(f"{k * app.window:>7.0f}  {len(rewards):>8}  {sum(rewards) / len(rewards):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/live/rl")
    parser.add_argument("--users", type=int, default=32, help="users sending one session at a time each")
    parser.add_argument(
        "--reward-delay", type=lambda s: tuple(map(float, s.split(","))), default=(0.5, 3.0),
        help="seconds between a session's end and its reward, uniform in LOW,HIGH",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window", type=float, default=10, help="seconds of traffic per line of the summary")
    parser.add_argument("--wait-s", type=float, default=600, help="how long to wait for the run's gateway")
    asyncio.run(main(parser.parse_args()))
