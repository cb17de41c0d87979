"""Envs for testing clients, servers and fault handling; registered when this module is imported.

    areal-agents serve-env --module areal_agents.envs.testing

- ``areal_agents_testing/Echo-v0``: the observation is the last action; reward 1 when the action equals
  ``target``; ends after ``max_turns``. The cheapest possible env (benchmarks, protocol tests).
- ``areal_agents_testing/Faulty-v0``: like Echo, but the action ``raise`` raises, ``hang`` sleeps for
  ``hang_seconds``, ``die`` kills the process running the env; ``error_rate`` makes a seeded fraction
  of steps raise (soak tests).
- ``areal_agents_testing/Slow-v0``: Echo whose every step takes ``step_seconds`` (sleeping): an env-bound run
  on purpose (the bottleneck report's tests).
- ``areal_agents_testing/Turns-v0``: a turn-based multi-agent env: ``num_agents`` agents speak one at a time,
  in order, for ``turns`` turns; each speech is shown to every other agent; a speaker earns 1 when it says
  ``target``. Tests the protocol's turn order (``acting``) end to end.
"""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium as gym

from areal_agents.envs.base import TextEnv
from areal_agents.envs.multi_agent import Dicts, MultiAgentTextEnv


class EchoEnv(TextEnv):
    """Echo the action back; reward 1 when it equals ``target`` (a trivial env for protocol tests)."""

    def __init__(self, target: str = "hi", max_turns: int = 1) -> None:
        super().__init__(max_observation_length=4096, max_action_length=4096)
        self.target, self.max_turns, self.turn = target, max_turns, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.turn = 0
        return f"Say {self.target}.", {"role": "user"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        reward = float(action.strip() == self.target)
        done = bool(reward) or self.turn >= self.max_turns
        return action[-200:], reward, done, False, {"turn": self.turn}


class FaultyEnv(EchoEnv):
    """Echo, with injected faults: actions ``raise``, ``hang``, ``die``; a seeded ``error_rate``."""

    def __init__(self, max_turns: int = 3, hang_seconds: float = 30.0, error_rate: float = 0.0) -> None:
        super().__init__(target="hi", max_turns=max_turns)
        self.hang_seconds, self.error_rate = hang_seconds, error_rate

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "raise" or (self.error_rate and self.np_random.random() < self.error_rate):
            raise RuntimeError("injected env failure")
        if action == "hang":
            time.sleep(self.hang_seconds)
        if action == "die":
            os._exit(13)
        return super().step(action)


class SlowEnv(EchoEnv):
    """Echo whose every step sleeps ``step_seconds`` first: a slow env (a judge, a sandbox) on demand."""

    def __init__(self, max_turns: int = 3, step_seconds: float = 0.2) -> None:
        if not 0 <= step_seconds <= 60:
            raise ValueError(f"step_seconds: expects a number in [0, 60], got {step_seconds!r}")
        super().__init__(target="hi", max_turns=max_turns)
        self.step_seconds = step_seconds

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        time.sleep(self.step_seconds)
        return super().step(action)


class TurnsEnv(MultiAgentTextEnv):
    """Agents ``p0..pN-1`` speak in turn; each hears the others; saying ``target`` earns 1 (turn order tests)."""

    def __init__(self, num_agents: int = 2, turns: int = 4, target: str = "hi") -> None:
        if not isinstance(num_agents, int) or not 1 <= num_agents <= 8:
            raise ValueError(f"num_agents: expects an int in [1, 8], got {num_agents!r}")
        if not isinstance(turns, int) or not 1 <= turns <= 64:
            raise ValueError(f"turns: expects an int in [1, 64], got {turns!r}")
        super().__init__(max_observation_length=4096, max_action_length=4096)
        self.possible_agents = [f"p{i}" for i in range(num_agents)]
        self.turns, self.target, self.turn = turns, target, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.turn = 0
        return {a: f"You are {a}. Say {self.target} on your turn." for a in self.agents}, {
            a: {"role": "user"} for a in self.agents
        }

    def acting_agents(self) -> list[str]:
        return [self.possible_agents[self.turn % len(self.possible_agents)]] if self.agents else []

    def step(self, actions: dict[str, str]) -> Dicts:
        (speaker,) = self.acting_agents()
        if set(actions) != {speaker}:
            raise ValueError(f"actions: expects {speaker!r} alone (its turn), got {sorted(actions)}")
        said = str(actions[speaker])[-200:]
        self.turn += 1
        over = self.turn >= self.turns
        listeners = [a for a in self.agents if a != speaker]
        observations = {} if over else {a: f"{speaker}: {said}" for a in listeners}
        rewards = {speaker: float(said.strip() == self.target)}
        everyone = list(self.agents) if over else [speaker]
        if over:
            self.agents = []
        done = {a: over for a in everyone}
        infos = {a: {"turn": self.turn, "role": "user"} for a in everyone}
        return observations, rewards, done, {a: False for a in everyone}, infos


for _id, _cls in (
    ("areal_agents_testing/Echo-v0", EchoEnv),
    ("areal_agents_testing/Faulty-v0", FaultyEnv),
    ("areal_agents_testing/Slow-v0", SlowEnv),
    ("areal_agents_testing/Turns-v0", TurnsEnv),
):
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_cls)
