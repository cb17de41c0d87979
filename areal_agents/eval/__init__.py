"""Evaluation harness: datasets (or any env's reset seeds) run through the training envs, engines and
episode runner, scored as papers report.

The names below load on first use, so that `areal-agents` builds its parser from `eval.options` (the
``eval`` flags) without importing the harness and with it torch.
"""

from __future__ import annotations

from areal_agents.importing import lazy_exports

_HOMES = {
    "EvalOptions": "options",
    "EvalSettings": "runner",
    "Problem": "problems",
    "ProblemSet": "problems",
    "evaluate_dataset": "runner",
    "load_problems": "problems",
    "maj_at_k": "metrics",
    "pass_at_k": "metrics",
    "run_eval": "runner",
    "summarize": "summary",
}
__all__ = sorted(_HOMES)


__getattr__ = lazy_exports(__name__, _HOMES)
