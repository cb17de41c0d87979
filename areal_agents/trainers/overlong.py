"""Long outputs in training: which trajectories were truncated, and DAPO's overlong reward shaping.

A trajectory is truncated when one of its generations stopped at its token budget (the engine's stop
reason ``length`` in ``metadata["stop_reasons"]``) or its agent cut the episode because the conversation
had no room left for another turn (``metadata["context_exhausted"]``). Its reward then says little about
its answer: a sound line of reasoning that ran out of tokens scores as a wrong one. DAPO (Yu et al. 2025,
§3.4) offers two remedies, both off by default:

- overlong filtering (``ppo.overlong_filtering``): truncated trajectories train no loss. As in DAPO their
  loss is masked, not dropped before advantages: they still count in their group's mean and std, so the
  other members' advantages are the same with the filter on or off. `prepare_batch` leaves them out of
  the trained set after advantages, which is the same gradient as a zeroed loss mask (the loss is summed
  over loss tokens and divided by the batch's count of them; a masked trajectory adds to neither).
- soft overlong punishment (``ppo.overlong_buffer`` K, ``ppo.overlong_penalty`` f; DAPO eq. 13): a length
  L within K tokens of ``Lmax = rollout.max_new_tokens`` adds a penalty that ramps linearly from 0 at
  ``Lmax - K`` to ``-f`` at ``Lmax``::

      R_length(L) = 0                       if L <= Lmax - K
                    ((Lmax - K) - L) / K * f  if Lmax - K < L <= Lmax
                    -f                      if L > Lmax

  It is added to the env's reward before ``reward_bias``, ``reward_scale`` and ``reward_clip``. Each turn
  of a multi-turn episode has its own budget of ``max_new_tokens``, so L is the episode's longest
  generated turn (a run of consecutive loss tokens), not the sum of its turns; the segments of one episode
  share it, as they share its reward (per agent, in a multi-agent episode).

``rollout/truncated_fraction`` (`truncated_fraction`) is the share of a step's trajectories that are
truncated, the share overlong filtering leaves out.

    penalties = overlong_penalties(trajectories, max_new_tokens=512, buffer=128, factor=1.0)
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_agents.types import Trajectory


def is_truncated(trajectory: Trajectory) -> bool:
    """Whether a generation of ``trajectory`` stopped at its budget or its agent ran out of context."""
    meta = trajectory.metadata
    return "length" in meta.get("stop_reasons", ()) or bool(meta.get("context_exhausted", False))


def truncated_fraction(trajectories: Sequence[Trajectory]) -> float:
    """The share of ``trajectories`` that are truncated (0 for none)."""
    return sum(map(is_truncated, trajectories)) / len(trajectories) if trajectories else 0.0


def longest_turn(trajectory: Trajectory) -> int:
    """The most tokens one generation of ``trajectory`` produced: its longest run of consecutive loss tokens
    (a turn's generated tokens are consecutive; the env's and the template's tokens separate turns)."""
    longest = run = 0
    for m in trajectory.loss_mask:
        run = run + 1 if m else 0
        longest = max(longest, run)
    return longest


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (eq. 13) of a generation of ``length`` tokens; 0 when ``buffer`` is 0."""
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer: expects 0 to max_new_tokens ({max_new_tokens}) tokens, got {buffer}")
    if buffer == 0:
        return 0.0
    start = max_new_tokens - buffer  # where the ramp begins
    if length <= start:
        return 0.0
    if length > max_new_tokens:
        return -factor
    return (start - length) / buffer * factor


def overlong_penalties(
    trajectories: Sequence[Trajectory], max_new_tokens: int, buffer: int, factor: float
) -> list[float]:
    """The penalty of each trajectory: that of its agent's longest turn in its episode (the segments of one
    conversation share it; in a multi-agent episode each agent answers for its own turns)."""
    keys = [(t.episode_id or f"#{i}", t.agent_id) for i, t in enumerate(trajectories)]
    longest: dict[tuple[str, str], int] = {}
    for key, t in zip(keys, trajectories):
        longest[key] = max(longest.get(key, 0), longest_turn(t))
    return [overlong_penalty(longest[key], max_new_tokens, buffer, factor) for key in keys]
