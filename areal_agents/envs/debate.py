"""`areal_agents/Debate-v0`: N agents answer a task, read each other's answers and revise for R rounds.

The task and its verifier come from any single-agent text env (``task_env``, arithmetic by default;
``areal_agents/Math-v0`` for math): its first observation is the question, and an answer is scored by a
second instance of that env, reset with the episode's seed and stepped with the answer (reward >= 1 is
correct).

Round 1: every agent sees the question and answers on its own. Rounds 2..R: each agent sees the answers
of the agents it can see (``visibility``: ``all`` others, or ``ring``: the next agent only) from the
previous round, rendered with ``round_prompt`` (placeholders ``{answers}`` and ``{question}``), and answers
again. The episode ends after round R; the
aggregate answer is the majority vote of the final answers (``info["majority_answer"]``,
``info["majority_correct"]``, also ``info["success"]``, the episode outcome evaluation reports; ties go to
the earliest agent).

Rewards per agent, paid at the end (all default values shown):
    correct_reward = 1.0              final answer correct
    round_reward = 0.0                each earlier round's answer correct (dense shaping)
    flip_to_right_reward = 0.0        wrong in round 1, right at the end
    right_against_majority_reward = 0.0  right at the end while the majority was wrong
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from areal_agents.envs.multi_agent import Dicts, MultiAgentTextEnv
from areal_agents.envs.templates import check_template

# a step's observations hold every agent's answer for every agent: bounded, as a client of serve-env names them
MAX_AGENTS, MAX_ANSWER_CHARS = 16, 65536
ROUND_PROMPT = "The other agents answered:\n{answers}\nKeep or correct your answer.\n{question}"


class DebateEnv(MultiAgentTextEnv):
    """Multi-agent debate over a verifiable task (parallel dict API; agents ``debater_0..N-1``)."""

    def __init__(
        self,
        num_agents: int = 2,
        rounds: int = 2,
        task_env: str = "areal_agents/Arithmetic-v0",
        task_kwargs: dict[str, Any] | None = None,
        visibility: Literal["all", "ring"] = "all",
        round_prompt: str = ROUND_PROMPT,
        correct_reward: float = 1.0,
        round_reward: float = 0.0,
        flip_to_right_reward: float = 0.0,
        right_against_majority_reward: float = 0.0,
        max_answer_chars: int = 2000,
    ) -> None:
        if not isinstance(num_agents, int) or not 2 <= num_agents <= MAX_AGENTS:
            raise ValueError(f"num_agents: expects an int in [2, {MAX_AGENTS}], got {num_agents!r}")
        if not isinstance(max_answer_chars, int) or not 1 <= max_answer_chars <= MAX_ANSWER_CHARS:
            raise ValueError(f"max_answer_chars: expects an int in [1, {MAX_ANSWER_CHARS}], got {max_answer_chars!r}")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds: expects an int >= 1, got {rounds!r}")
        if visibility not in ("all", "ring"):
            raise ValueError(f"visibility: expects 'all' or 'ring', got {visibility!r}")
        check_template(round_prompt, "round_prompt", fields=("answers", "question"), required=("answers",))
        super().__init__()
        from areal_agents.envs.registry import make_env  # noqa: PLC0415  (registry imports this module)

        self.task_id, self.task_kwargs = task_env, dict(task_kwargs or {})
        self.task = make_env(self.task_id, **self.task_kwargs)  # fails here, at construction, on a bad id or kwargs
        self.verifier = make_env(self.task_id, **self.task_kwargs)  # reset to the task's seed for every answer
        self.possible_agents = [f"debater_{i}" for i in range(num_agents)]
        self.rounds, self.visibility, self.round_prompt = rounds, visibility, round_prompt
        self.correct_reward, self.round_reward = correct_reward, round_reward
        self.flip_to_right_reward = flip_to_right_reward
        self.right_against_majority_reward = right_against_majority_reward
        self.max_answer_chars = max_answer_chars
        self.question, self.seed, self.round = "", None, 0
        self.answers: list[dict[str, str]] = []  # per round: agent -> answer
        self.correct: list[dict[str, bool]] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed, options=options)
        # the task's seed: the given one, or one drawn from our generator, so every verifier copy agrees
        self.seed = seed if seed is not None else int(self.np_random.integers(2**31 - 1))
        self.question, _ = self.task.reset(seed=self.seed)
        self.round, self.answers, self.correct = 1, [], []
        return {a: self.question for a in self.agents}, {a: {"round": 1} for a in self.agents}

    def is_correct(self, answer: str) -> bool:
        """The task env's verdict on ``answer`` for this episode's task."""
        self.verifier.reset(seed=self.seed)
        return float(self.verifier.step(answer)[1]) >= 1.0

    def _visible(self, agent: str) -> list[str]:
        i = self.possible_agents.index(agent)
        others = [a for a in self.possible_agents if a != agent]
        return others if self.visibility == "all" else [self.possible_agents[(i + 1) % len(self.possible_agents)]]

    def step(self, actions: dict[str, str]) -> Dicts:
        if self.round == 0:
            raise RuntimeError("Cannot call step() before reset()")
        if set(actions) != set(self.agents):
            raise ValueError(f"actions: expects one per acting agent {sorted(self.agents)}, got {sorted(actions)}")
        answers = {a: str(actions[a])[: self.max_answer_chars].strip() for a in self.agents}
        self.answers.append(answers)
        self.correct.append({a: self.is_correct(x) for a, x in answers.items()})
        acting = list(self.agents)
        if self.round < self.rounds:
            self.round += 1
            observations = {
                a: self.round_prompt.format(
                    answers="\n".join(f"{b}: {answers[b]}" for b in self._visible(a)), question=self.question
                )
                for a in acting
            }
            rewards = {a: self.round_reward * self.correct[-1][a] for a in acting}
            infos = {a: {"round": self.round} for a in acting}
            no = {a: False for a in acting}
            return observations, rewards, dict(no), dict(no), infos
        majority = _majority([answers[a] for a in self.possible_agents])
        majority_correct = self.is_correct(majority)
        rewards = {}
        for a in acting:
            right = self.correct[-1][a]
            rewards[a] = (
                self.correct_reward * right
                + self.round_reward * sum(c[a] for c in self.correct[:-1])
                + self.flip_to_right_reward * (right and not self.correct[0][a])
                + self.right_against_majority_reward * (right and not majority_correct)
            )
        info = {
            "success": majority_correct,  # the episode's outcome, as evaluation reads it
            "majority_answer": majority,
            "majority_correct": majority_correct,
            "rounds": self.round,
            "correct_by_round": [dict(c) for c in self.correct],
        }
        self.agents, self.round = [], 0
        done = {a: True for a in acting}
        return {a: "" for a in acting}, rewards, done, {a: False for a in acting}, {a: dict(info) for a in acting}

    def close(self) -> None:
        self.task.close()
        self.verifier.close()


def _majority(answers: list[str]) -> str:
    """The most common answer; ties go to the one given first."""
    counts = Counter(answers)
    best = max(counts.values())
    return next(a for a in answers if counts[a] == best)
