"""`MultiAgentTextEnv`: several agents acting at once, PettingZoo's parallel API with text spaces.

``reset -> (observations, infos)`` and ``step(actions) -> (observations, rewards, terminations,
truncations, infos)``, every value a dict keyed by agent id; ``agents`` lists the agents still in the
episode. ``acting_agents()`` says who acts next: every live agent at once by default (parallel); a
turn-based env returns the agent whose turn it is, and ``step`` then gets that agent's action alone.
Rewards, terminations, truncations and infos cover at least the agents that acted (a missing agent: 0.0,
false, false, {}); observations go to every agent that gets one (e.g. the next speaker).

    class Guess(MultiAgentTextEnv):
        possible_agents = ["a", "b"]
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return {a: "Pick a number." for a in self.agents}, {a: {} for a in self.agents}
        def step(self, actions):
            done = {a: True for a in self.agents}
            rewards = {a: float(actions[a] == "7") for a in self.agents}
            self.agents = []
            return {a: "" for a in done}, rewards, done, {a: False for a in done}, {a: {} for a in done}
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding

from areal_agents.envs.base import text_space

Dicts = tuple[dict[str, str], dict[str, float], dict[str, bool], dict[str, bool], dict[str, dict[str, Any]]]


class MultiAgentTextEnv(abc.ABC):
    """Parallel multi-agent text env; subclasses set ``possible_agents`` and implement reset/step."""

    possible_agents: list[str] = []
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_observation_length: int = 8192, max_action_length: int = 8192) -> None:
        self.agents: list[str] = []
        self._obs_space = text_space(max_observation_length)
        self._act_space = text_space(max_action_length)
        self.np_random: np.random.Generator = np.random.default_rng()

    def observation_space(self, agent: str) -> spaces.Text:
        return self._obs_space

    def action_space(self, agent: str) -> spaces.Text:
        return self._act_space

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        """Seed ``np_random`` (when a seed is given) and reactivate every agent; subclasses return the dicts."""
        if seed is not None:
            self.np_random, _ = seeding.np_random(seed)
        self.agents = list(self.possible_agents)
        return {}, {}

    @abc.abstractmethod
    def step(self, actions: dict[str, str]) -> Dicts:
        """Apply every acting agent's action; return the five per-agent dicts and update ``agents``."""

    def acting_agents(self) -> list[str]:
        """Who acts next, in order (``step`` gets exactly their actions); [] once the episode is over. The
        default: every live agent (parallel); a turn-based env returns the one whose turn it is."""
        return list(self.agents)

    def close(self) -> None:  # noqa: B027  (an optional hook, not abstract)
        """Release resources; the default has none."""


def check_multi_agent_env(env: MultiAgentTextEnv, seed: int = 0, max_steps: int = 1000) -> None:
    """Gymnasium-style checks of the parallel API; raises AssertionError naming what is wrong.

    ``acting_agents()`` is a non-empty subset of ``agents`` while the episode runs and [] after it; reset
    observes at least every acting agent; a step's rewards, terminations, truncations and infos cover at
    least the agents that acted, and every dict names only possible agents; observations lie in their
    spaces; a whole episode replays identically under the same seed and actions; agents that terminate leave
    ``agents``; episodes end within ``max_steps``."""
    _check_reset(env, seed)
    _check_determinism(env, seed)
    _check_step(env, seed)
    first = _play(env, seed, max_steps)
    assert first == _play(env, seed, max_steps), "Expects the same seed and actions to replay the same episode"


def _acting(env: MultiAgentTextEnv) -> list[str]:
    acting = env.acting_agents()
    assert isinstance(acting, list), f"Expects acting_agents() to return a list, got {type(acting).__name__}"
    assert set(acting) <= set(env.agents), f"Expects acting_agents() {acting} to be live agents {env.agents}"
    assert len(set(acting)) == len(acting), f"Expects acting_agents() without repeats, got {acting}"
    return acting


def _play(env: MultiAgentTextEnv, seed: int, max_steps: int) -> list[Any]:
    """One episode with fixed-seed sampled actions; the transcript of what the env returned."""
    observations, _ = env.reset(seed=seed)
    for space in {id(s): s for a in env.agents for s in (env.action_space(a), env.observation_space(a))}.values():
        space.seed(seed)
    transcript: list[Any] = [observations]
    for _ in range(max_steps):
        acting = _acting(env)
        if not env.agents:
            return transcript
        assert acting, f"Expects acting_agents() to name someone while agents {env.agents} are live"
        actions = {a: env.action_space(a).sample() for a in acting}
        observations, rewards, terminations, truncations, _ = env.step(actions)
        transcript.append((actions, observations, rewards, terminations, truncations))
        for a in set(terminations) | set(truncations):
            if terminations.get(a) or truncations.get(a):
                assert a not in env.agents, f"Expects {a!r} to leave env.agents once terminated or truncated"
        for a, obs in observations.items():
            if a in env.agents:
                assert env.observation_space(a).contains(obs), f"Observation of {a!r} not in its space"
    raise AssertionError(f"Expects an episode to end within {max_steps} steps with sampled actions")


def _check_keys(name: str, d: Any, required: list[str], allowed: list[str]) -> None:
    assert isinstance(d, dict), f"Expects {name} to be a dict keyed by agent id, got {type(d).__name__}"
    missing, unknown = sorted(set(required) - set(d)), sorted(set(d) - set(allowed))
    assert not missing, f"Expects {name} keys {sorted(required)}, got {sorted(d)} (at least the acting agents)"
    assert not unknown, f"Expects {name} keys among the possible agents {sorted(allowed)}, got {unknown}"


def _check_reset(env: MultiAgentTextEnv, seed: int) -> None:
    assert env.possible_agents, "Expects possible_agents to list at least one agent id"
    out = env.reset(seed=seed)
    assert isinstance(out, tuple) and len(out) == 2, "Expects reset() to return (observations, infos)"
    observations, infos = out
    assert env.agents, "Expects env.agents to be non-empty after reset()"
    acting = _acting(env)
    assert acting, "Expects acting_agents() to be non-empty after reset()"
    _check_keys("reset() observations", observations, acting, env.possible_agents)
    _check_keys("reset() infos", infos, [], env.possible_agents)
    for agent, obs in observations.items():
        assert env.observation_space(agent).contains(obs), f"Observation of {agent!r} is not in its space: {obs!r}"


def _check_determinism(env: MultiAgentTextEnv, seed: int) -> None:
    first = env.reset(seed=seed)[0]
    second = env.reset(seed=seed)[0]
    assert first == second, "Expects reset(seed=s) twice to give the same observations"


def _check_step(env: MultiAgentTextEnv, seed: int) -> None:
    env.reset(seed=seed)
    acting = _acting(env)
    actions = {a: env.action_space(a).sample() for a in acting}
    out = env.step(actions)
    assert isinstance(out, tuple) and len(out) == 5, "Expects step() to return 5 dicts"
    names = ("observations", "rewards", "terminations", "truncations", "infos")
    for name, d in zip(names, out):
        _check_keys(f"step() {name}", d, [] if name == "observations" else acting, env.possible_agents)
    for agent in out[1]:
        assert isinstance(out[1][agent], (int, float)), f"Expects a number as the reward of {agent!r}"
    for agent in set(out[2]) | set(out[3]):
        assert isinstance(out[2].get(agent, False), bool) and isinstance(out[3].get(agent, False), bool), (
            f"Expects bool termination and truncation for {agent!r}"
        )
