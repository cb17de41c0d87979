"""`areal_agents/Math-v0`: math problems from a dataset, rewarded by answer verification.

    env = gymnasium.make("areal_agents/Math-v0")        # bundled GSM8K train, a set no eval preset holds
    env = gymnasium.make("areal_agents/Math-v0", dataset="aime24", max_turns=2)   # or a JSONL path, hf:ORG/NAME
    obs, info = env.reset(seed=0)                       # the problem, with the answer-format instruction
    obs, reward, terminated, truncated, info = env.step("... \\boxed{204}")

Single-turn: reward 1 for a correct final answer (plus ``format_reward`` for a boxed one). Multi-turn
(``max_turns > 1``): a wrong answer gets ``feedback`` and another try; a correct answer on turn t earns
``turn_discount ** (t - 1)``. Verification runs in a process-wide pool of worker processes with a hard
``verify_timeout`` (``reward_mode="pool"``), or in the calling process (``"inline"``, e.g. when the env
itself already runs in a killable worker).
"""

from __future__ import annotations

from typing import Any, Literal

from areal_agents.data.base import BaseDataset, load_task_dataset
from areal_agents.data.sources import resolve_source
from areal_agents.envs.base import TextEnv
from areal_agents.envs.runtime.budget import remaining_s
from areal_agents.envs.templates import check_template
from areal_agents.importing import load_object
from areal_agents.rewards.base import RewardFunction, RewardResult, as_result
from areal_agents.rewards.math_reward import MathReward, warm_up
from areal_agents.workers import CallTimeout, RemoteError, WorkerDied, WorkerPool, may_start_processes, shared_pool

DEFAULT_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def reward_pool(workers: int = 2) -> WorkerPool:
    """The process-wide reward pool, started on first use and shared by every Math env."""
    return shared_pool("math-env-rewards", workers, initializer=warm_up)


def _load(dataset: str, split: str | None, prompt_key: str | None, dataset_class: str) -> BaseDataset:
    cls = load_object(dataset_class, "env kwarg dataset_class") if dataset_class else BaseDataset
    if not (isinstance(cls, type) and issubclass(cls, BaseDataset)):
        raise ValueError(f"Expects dataset_class to name a BaseDataset subclass, got {dataset_class!r}")
    return load_task_dataset(dataset, split=split, prompt_key=prompt_key, cls=cls)


def _reward(spec: str) -> RewardFunction:
    target = load_object(spec, "env kwarg reward")
    fn = target() if isinstance(target, type) else target
    if not callable(fn):
        raise ValueError(f"Expects reward to name a reward function or class, got {spec!r}")
    return fn


class MathEnv(TextEnv):
    """Answer a math problem from a dataset; reward by `verify_math` against the row's answer."""

    def __init__(
        self,
        dataset: str = "gsm8k",
        *,
        split: str | None = None,
        prompt_key: str | None = None,
        answer_key: str = "answer",
        prompt_template: str = DEFAULT_TEMPLATE,
        max_turns: int = 1,
        feedback: str = "Your answer is incorrect. Please check your work and try again.",
        turn_discount: float = 1.0,
        format_reward: float = 0.0,
        reward_mode: Literal["pool", "inline"] = "pool",
        verify_timeout: float = 10.0,
        reward: str = "",
        dataset_class: str = "",
    ) -> None:
        """``dataset``: a bundled set's name, a JSONL path or a hub id (see `load_task_dataset`; an env
        server loads only those its operator allowed); with no arguments, bundled GSM8K train.
        ``split``/``prompt_key``: default to the bundled set's own (its train split where it has one), else
        "test" and "problem". ``prompt_template``: ``{prompt}`` once, plain (`check_template`). ``reward``: a
        ``module:Class`` (constructed with no arguments) or ``module:function`` replacing `MathReward`;
        ``dataset_class``: a ``module:Class`` subclass of `BaseDataset` that reshapes rows."""
        super().__init__(max_observation_length=65536, max_action_length=1_000_000)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"Expects max_turns to be an int >= 1, got {max_turns!r}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"Expects 0 < turn_discount <= 1, got {turn_discount!r}")
        if reward_mode not in ("pool", "inline"):
            raise ValueError(f"Expects reward_mode 'pool' or 'inline', got {reward_mode!r}")
        if not isinstance(dataset, str) or not dataset:
            raise ValueError(f"Expects dataset to be a non-empty string, got {dataset!r}")
        check_template(prompt_template, "prompt_template", fields=("prompt",), required=("prompt",))
        if prompt_key is None and resolve_source(dataset).kind != "bundled":
            prompt_key = "problem"
        self._data_args = (dataset, split, prompt_key, dataset_class)
        self.data = _load(*self._data_args)
        if answer_key not in self.data[0]:
            raise ValueError(f"Expects rows of {dataset} to have key {answer_key!r}; they have {sorted(self.data[0])}")
        self.template, self.max_turns, self.feedback = prompt_template, max_turns, feedback
        self.turn_discount, self.reward_mode, self.verify_timeout = turn_discount, reward_mode, verify_timeout
        self.reward_fn = _reward(reward) if reward else MathReward(answer_key=answer_key, format_reward=format_reward)
        self.row: dict[str, Any] | None = None
        self.turn = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the dataset (process-mode pools ship the env with every call); reloaded from cache."""
        state = self.__dict__.copy()
        state["data"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.data = _load(*self._data_args)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        index = (
            int(options["index"]) if options and "index" in options else int(self.np_random.integers(len(self.data)))
        )
        if not 0 <= index < len(self.data):
            raise ValueError(f"options['index'] must be in [0, {len(self.data)}), got {index}")
        self.row, self.turn = self.data[index], 0
        info = {"role": "user", "index": index, "id": self.row["id"], "num_problems": len(self.data)}
        return self.template.format(prompt=self.row["prompt"]), info

    def _score(self, action: str) -> RewardResult:
        # a daemonic process (a process-mode env pool's worker) cannot start the pool's workers: score here,
        # bounded by check_math's own limits and the env pool's step timeout
        if self.reward_mode == "inline" or not may_start_processes():
            return as_result(self.reward_fn(action, self.row))
        left = remaining_s()  # served: verification ends by the server's step timeout too
        timeout = self.verify_timeout if left is None else min(self.verify_timeout, left)
        args = (self.reward_fn, action, self.row)
        try:
            try:
                return as_result(reward_pool().call_sync(*args, timeout=timeout))
            except WorkerDied:  # killed from outside, or by this text: a new worker scores it once more
                return as_result(reward_pool().call_sync(*args, timeout=timeout))
        except CallTimeout:
            return RewardResult(0.0, {"correct": False, "error": "timeout"})
        except (WorkerDied, RemoteError) as e:
            return RewardResult(0.0, {"correct": False, "error": type(e).__name__, "message": str(e)})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row is None:
            raise RuntimeError("Cannot call step() before reset()")
        self.turn += 1
        result = self._score(action)
        correct = bool(result.details.get("correct"))
        reward = result.reward * (self.turn_discount ** (self.turn - 1)) if correct else result.reward
        info = {"role": "user", "turn": self.turn, "id": self.row["id"], **result.details}
        if correct or self.turn >= self.max_turns:
            return "", float(reward), True, False, info
        return self.feedback, float(reward), False, False, info
