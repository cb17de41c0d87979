"""Named evaluation sets with the sampling papers report them with (AReaL: AIME avg@32 at T 0.6, top-p 0.95).

A preset names a Hugging Face dataset (needs ``areal-agents[hf]`` and a network); a local JSONL with the
same keys works offline (``--dataset ../shared/data/aime24.jsonl``; the preset is then taken from the
file name when it matches, or given with ``--preset``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Preset:
    env_id: str
    dataset: str  # Hugging Face id (or path)
    split: str = "test"
    n_samples: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 32768
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    breakdown: tuple[str, ...] = ()  # row keys to break accuracy down by (difficulty, subject)


MATH_ENV = "areal_agents/Math-v0"

PRESETS: dict[str, Preset] = {
    "aime24": Preset(MATH_ENV, "HuggingFaceH4/aime_2024", split="train", n_samples=32),
    "aime25": Preset(MATH_ENV, "math-ai/aime25", split="test", n_samples=32),
    "math500": Preset(MATH_ENV, "HuggingFaceH4/MATH-500", split="test", n_samples=4, breakdown=("level", "subject")),
    "math": Preset(MATH_ENV, "", split="test", n_samples=1),  # any math JSONL / HF id: problem, answer
    # LiveCodeBench pass@1: one submission per sample, no trial runs; rows need contest_date for the window
    "lcb": Preset(
        "areal_agents/Code-v0",
        "livecodebench/code_generation_lite",
        split="test",
        n_samples=4,
        env_kwargs={"max_turns": 1, "max_runs": 0},
        breakdown=("platform", "difficulty"),
    ),
}


def resolve(dataset: str, preset: str | None = None) -> tuple[str, Preset]:
    """``(dataset source, preset)`` for ``--dataset`` (a preset name, a path or an HF id) and ``--preset``."""
    if dataset in PRESETS and preset is None:
        return PRESETS[dataset].dataset, PRESETS[dataset]
    stem = Path(dataset).stem
    inferred = stem if stem in PRESETS else "lcb" if stem.startswith("lcb") else "math"
    name = preset or inferred
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataset, PRESETS[name]
