"""The trajectory viewer's data: a step's dumped trajectories as a filterable list, and one of them as the model
saw it (decoded tokens with their loss mask, policy version and logprob; generations and per-turn rewards;
tool calls, parse failures and history rewrites from its metadata).

Rows are ``dataclasses.asdict(Trajectory)`` (``rollout.dump_trajectories``; held-out eval samples in the same
shape); a row that is no trajectory is counted as skipped, never an error.

    listing = summaries(rows)                                   # [{"index": 0, "reward": 1.0, ...}, ...]
    detail = episode_detail(rows, 3, tokenizer)                 # tokens, spans, generations, messages
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from areal_agents.dashboard.runs import ClientError
from areal_agents.trainers.overlong import is_truncated
from areal_agents.types import Trajectory

_FIELDS = {f.name for f in dataclasses.fields(Trajectory)}


def trajectory(row: dict[str, Any]) -> Trajectory | None:
    """The trajectory a dumped row holds, or None when it holds none (missing or unequal fields)."""
    try:
        t = Trajectory(**{k: v for k, v in row.items() if k in _FIELDS})
    except (TypeError, ValueError):
        return None
    return t if isinstance(t.metadata, dict) and isinstance(t.turn_rewards, list) else None


def clean(value: Any) -> Any:
    """``value`` with NaN and infinities as None, at any depth (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def _count(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key, 0)
    return value if isinstance(value, int) else 0


def _truncated(t: Trajectory) -> bool:
    try:
        return is_truncated(t)
    except TypeError:  # stop_reasons that is no list: a row written by something else
        return False


def summary(index: int, t: Trajectory) -> dict[str, Any]:
    """One line of the episode list: what the filters and the table need."""
    meta = t.metadata
    return clean(
        {
            "index": index,
            "episode_id": str(t.episode_id),
            "group_id": str(t.group_id),
            "agent_id": str(t.agent_id),
            "reward": t.reward,
            "turn_rewards": t.turn_rewards,
            "tokens": len(t),
            "generated": t.num_generated,
            "truncated": _truncated(t),
            "tool_calls": _count(meta, "tool_calls"),
            "tool_parse_failures": _count(meta, "tool_parse_failures"),
            "segment": _count(meta, "segment"),
            "num_segments": max(1, _count(meta, "num_segments")),
        }
    )


@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes to list; None leaves that criterion out."""

    agent: str | None = None
    truncated: bool | None = None
    failed: bool | None = None  # has tool-call parse failures
    min_reward: float | None = None
    max_reward: float | None = None

    def keeps(self, s: dict[str, Any]) -> bool:
        """Whether the summary ``s`` passes every given criterion."""
        reward = s["reward"] if s["reward"] is not None else math.nan
        return (
            (self.agent is None or s["agent_id"] == self.agent)
            and (self.truncated is None or s["truncated"] == self.truncated)
            and (self.failed is None or (s["tool_parse_failures"] > 0) == self.failed)
            and (self.min_reward is None or reward >= self.min_reward)
            and (self.max_reward is None or reward <= self.max_reward)
        )


def summaries(rows: list[dict[str, Any]], keep: EpisodeFilter = EpisodeFilter()) -> dict[str, Any]:
    """The listed episodes (index = the row's place in the file), the agents seen, and rows that were no
    trajectory."""
    listed, agents, bad = [], set(), 0
    for i, row in enumerate(rows):
        t = trajectory(row)
        if t is None:
            bad += 1
            continue
        s = summary(i, t)
        agents.add(s["agent_id"])
        if keep.keeps(s):
            listed.append(s)
    return {"episodes": listed, "agents": sorted(agents), "total": len(rows) - bad, "bad_rows": bad}


def spans(t: Trajectory) -> list[dict[str, Any]]:
    """Runs of tokens with one loss mask: what the model read (0) and each generation (1), in order."""
    out, start = [], 0
    for i in range(1, len(t) + 1):
        if i == len(t) or t.loss_mask[i] != t.loss_mask[start]:
            out.append({"start": start, "end": i, "generated": bool(t.loss_mask[start])})
            start = i
    return out


def _earlier_generations(rows: list[dict[str, Any]], t: Trajectory) -> int:
    """Generations in the earlier segments of ``t``'s episode and agent in the same file: where its own
    generations sit among the episode's turns when a template rewrote history."""
    seg = _count(t.metadata, "segment")
    total = 0
    for row in rows:
        other = trajectory(row)
        if other is None or (other.episode_id, other.agent_id) != (t.episode_id, t.agent_id):
            continue
        if _count(other.metadata, "segment") < seg:
            total += sum(1 for s in spans(other) if s["generated"])
    return total


def episode_detail(rows: list[dict[str, Any]], index: int, tokenizer: Any) -> dict[str, Any]:
    """Row ``index`` decoded for the viewer; 404 naming the range when there is no such trajectory."""
    if not 0 <= index < len(rows):
        raise ClientError(404, f"episode: no episode {index}; this step has {len(rows)} (0..{len(rows) - 1})")
    t = trajectory(rows[index])
    if t is None:
        raise ClientError(404, f"episode: row {index} of this step is not a trajectory (fields missing or unequal)")
    texts = decode_tokens(tokenizer, t.input_ids)
    runs = spans(t)
    meta = t.metadata
    stops = meta.get("stop_reasons") if isinstance(meta.get("stop_reasons"), list) else []
    offset = _earlier_generations(rows, t)
    gen_no = 0
    for s in runs:
        s["text"] = "".join(texts[s["start"] : s["end"]])
        if s["generated"]:
            s["generation"] = offset + gen_no
            s["stop_reason"] = stops[offset + gen_no] if offset + gen_no < len(stops) else None
            gen_no += 1
    messages = meta.get("messages") if isinstance(meta.get("messages"), list) else []
    return clean(
        {
            **summary(index, t),
            "text": "".join(texts),
            "token_text": texts,
            "input_ids": t.input_ids,
            "loss_mask": t.loss_mask,
            "versions": t.versions,
            "logprobs": t.logprobs,
            "spans": runs,
            "stop_reasons": stops,
            "messages": messages,
            "metadata": {k: v for k, v in meta.items() if k != "messages"},
            "decoded": tokenizer is not None,
        }
    )


def decode_tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text (special tokens kept: they are what the model saw); ``<id>`` with no tokenizer."""
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    try:
        return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    except (ValueError, TypeError, OverflowError, IndexError):  # an id the tokenizer does not know
        return [f"<{i}>" for i in ids]
