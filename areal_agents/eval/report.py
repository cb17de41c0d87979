"""`areal-agents eval-report RUN...`: the headline metrics of several eval runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

from areal_agents.errors import ArealAgentsError

HEADLINE = ("avg@", "pass@", "maj@")


def load_summary(run: str | Path) -> dict:
    path = Path(run) / "summary.json" if Path(run).is_dir() else Path(run)
    if not path.is_file():
        raise ArealAgentsError(f"eval-report: no summary.json in {run} (is it an `areal-agents eval` output?)")
    return json.loads(path.read_text())


def compare(runs: list[str]) -> str:
    """A table: one row per metric any run has, one column per run (values in %, tokens as counts)."""
    summaries = [load_summary(r) for r in runs]
    names = [Path(r).name or str(r) for r in runs]
    metrics: list[str] = []
    for s in summaries:
        metrics += [k for k in s if k.startswith(HEADLINE) and k not in metrics]
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["metric".ljust(12) + "".join(n.rjust(width) for n in names)]
    for m in metrics:
        cells = [f"{100 * s[m]:.1f}%" if m in s else "-" for s in summaries]
        lines.append(m.ljust(12) + "".join(c.rjust(width) for c in cells))
    for key, label, fmt in (("mean_tokens", "tokens", "{:.1f}"), ("truncation_rate", "truncated", "{:.1%}")):
        lines.append(label.ljust(12) + "".join(fmt.format(s.get(key, 0.0)).rjust(width) for s in summaries))
    lines.append("problems".ljust(12) + "".join(str(s.get("problems", 0)).rjust(width) for s in summaries))
    return "\n".join(lines)
