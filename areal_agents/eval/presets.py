"""Named evaluation sets with the sampling papers report them with (AReaL: AIME avg@32 at T 0.6, top-p 0.95).

A preset reads its bundled copy (offline, pinned; `areal_agents.data.builtin`) unless ``hub`` asks for the
Hugging Face hub's copy. ``--dataset`` may also be a JSONL path or a hub id; its preset is then taken
from the name when it matches (``aime24.jsonl``, ``lcb_*``), or given with ``--preset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.data.builtin import BUILTIN
from areal_agents.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Preset:
    env_id: str
    dataset: str  # a bundled set's name ("" for the generic presets, which need --dataset)
    split: str | None = None  # of the bundled set (None: its default)
    n_samples: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 32768
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    breakdown: tuple[str, ...] = ()  # row keys to break accuracy down by (difficulty, subject)


MATH_ENV = "areal_agents/Math-v0"
CODE_ENV = "areal_agents/Code-v0"
ONE_SUBMISSION = {"max_turns": 1, "max_runs": 0}  # pass@1 as published: no trial runs

PRESETS: dict[str, Preset] = {
    "aime24": Preset(MATH_ENV, "aime24", n_samples=32),
    "aime25": Preset(MATH_ENV, "aime25", n_samples=32),
    "math500": Preset(MATH_ENV, "math500", n_samples=4, breakdown=("level", "subject")),
    "gsm8k": Preset(MATH_ENV, "gsm8k", split="test", max_new_tokens=4096),
    "math": Preset(MATH_ENV, ""),  # any math JSONL / hub id: problem, answer
    # LiveCodeBench pass@1; rows need contest_date for the --lcb-start/--lcb-end window
    "lcb": Preset(CODE_ENV, "lcb_v5", n_samples=4, env_kwargs=ONE_SUBMISSION, breakdown=("platform", "difficulty")),
    "humaneval": Preset(CODE_ENV, "humaneval", n_samples=1, max_new_tokens=4096, env_kwargs=ONE_SUBMISSION),
    "code": Preset(CODE_ENV, "", env_kwargs=ONE_SUBMISSION),  # any LiveCodeBench / MBPP / HumanEval-form set
}


def _inferred(dataset: str) -> str:
    """The preset a dataset's name implies: its own, lcb for LiveCodeBench sets, code for MBPP, else math."""
    stem = Path(dataset).stem if dataset not in BUILTIN else dataset
    if stem in PRESETS:
        return stem
    if stem.startswith("lcb"):
        return "lcb"
    return "code" if stem.startswith(("mbpp", "humaneval")) else "math"


def resolve(dataset: str, preset: str | None = None, hub: bool = False) -> tuple[str, str | None, Preset]:
    """``(dataset source, split, preset)`` for ``--dataset`` (a preset, a bundled set, a path or a hub id),
    ``--preset`` and ``--hub`` (a preset's hub copy instead of the bundled one)."""
    if preset is not None and preset not in PRESETS:
        raise ConfigError(
            f"--preset: unknown preset {preset!r}.{did_you_mean(preset, PRESETS)} Presets: {', '.join(PRESETS)}"
        )
    p = PRESETS[preset or _inferred(dataset)]
    source, split = dataset, None
    if dataset in PRESETS and PRESETS[dataset].dataset:
        source, split = PRESETS[dataset].dataset, PRESETS[dataset].split
    if hub:
        if source not in BUILTIN or not BUILTIN[source].hub:
            raise ConfigError(f"--hub: {dataset!r} has no hub copy with the bundled fields; give --dataset hf:ORG/NAME")
        source, split = BUILTIN[source].hub, BUILTIN[source].hub_split
    return source, split, p
