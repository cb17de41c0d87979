"""The tokenizer of each run, to show its trajectories' tokens as text: the run's ``model.path``
(``RUN/config.json``), else the tokenizer saved with its newest checkpoint.

    tokenizer, note = TokenizerCache().get(run)   # (None, "why") when neither loads: tokens show as <id>
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from areal_agents.dashboard.runs import Run
from areal_agents.errors import ArealAgentsError


def candidates(run_dir: Path) -> list[Path]:
    """Where a run's tokenizer may be, most likely first."""
    out = []
    try:
        model = json.loads((run_dir / "config.json").read_text()).get("model", {}).get("path")
    except (OSError, ValueError, AttributeError):
        model = None
    if isinstance(model, str) and model:
        out.append(Path(model) if Path(model).is_absolute() else Path.cwd() / model)
    steps = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        if re.fullmatch(r"step_\d+", p.name):
            steps.append((int(p.name[5:]), p / "model"))
    out += [p for _, p in sorted(steps, reverse=True)]
    return out


class TokenizerCache:
    """One tokenizer per run, loaded on first use (transformers is imported only then)."""

    def __init__(self) -> None:
        self._loaded: dict[int, tuple[Any, str]] = {}
        self._lock = threading.Lock()

    def get(self, run: Run) -> tuple[Any, str]:
        """(tokenizer or None, where it came from or why there is none)."""
        with self._lock:
            if run.index not in self._loaded:
                self._loaded[run.index] = self._load(run.path)
            return self._loaded[run.index]

    @staticmethod
    def _load(run_dir: Path) -> tuple[Any, str]:
        from areal_agents.models.loading import load_tokenizer, quiet_transformers

        quiet_transformers()
        tried = []
        for path in candidates(run_dir):
            try:
                return load_tokenizer(path), str(path)
            except ArealAgentsError as e:
                tried.append(str(e))
        return None, "no tokenizer: " + ("; ".join(tried) or "no model.path in config.json and no checkpoint")
