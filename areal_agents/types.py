"""Core data types: token-in/token-out generation requests and the training trajectory.

Trajectory schema (one training sequence, all lists of equal length ``L``):

=============  =========  ==============================================================
field          dtype      meaning
=============  =========  ==============================================================
input_ids      int        prompt, observation and generated tokens, in order
loss_mask      int 0/1    1 only on tokens the policy generated
logprobs       float      behavior logprob of each generated token; 0 where loss_mask is 0
versions       int        policy version that generated each token; -1 where loss_mask is 0
=============  =========  ==============================================================

plus ``reward`` (scalar), optional ``turn_rewards``, ``group_id``, ``agent_id``, ``episode_id`` and
free-form ``metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

StopReason = Literal["stop", "length", "abort", "tool_calls"]


@dataclass
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # stop only at stop_token_ids or max_new_tokens
    seed: int | None = None  # this request's own sampler seed (SGLang's ``sampling_seed``); None: the engine's

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"Expects max_new_tokens >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"Expects temperature >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Expects 0 < top_p <= 1, got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"Expects top_k >= 0, got {self.top_k}")


@dataclass
class GenRequest:
    """Generate a continuation of ``input_ids``; ``rid`` identifies the request (and its episode);
    ``lora_name`` names the LoRA adapter loaded on the engine that generates it (None: the base model)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    lora_name: str | None = None


@dataclass
class GenResponse:
    """Generated token ids with their behavior logprobs and the policy version of each token."""

    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.output_tokens)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                "Expects output_tokens, output_logprobs and output_versions of equal length, got "
                f"{n}, {len(self.output_logprobs)}, {len(self.output_versions)}"
            )


@dataclass
class Trajectory:
    """One training sequence; see the module docstring for the schema."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    group_id: str = ""
    agent_id: str = "agent"
    episode_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = (len(self.loss_mask), len(self.logprobs), len(self.versions))
        if any(length != n for length in lengths):
            raise ValueError(f"Expects input_ids, loss_mask, logprobs, versions of equal length, got {(n, *lengths)}")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_generated(self) -> int:
        """Number of tokens the policy generated (the loss tokens)."""
        return sum(self.loss_mask)
