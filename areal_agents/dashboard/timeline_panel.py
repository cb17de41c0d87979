"""The workers' timeline for the dashboard's heatmap and queue panels (issue 46 item 1 records it).

Until a run records a timeline, the panel says so: ``{"available": false, "why": ...}``.
"""

from __future__ import annotations

from typing import Any

from areal_agents.dashboard.runs import Run


def timeline(run: Run) -> dict[str, Any]:
    """The run's timeline as the page draws it, or why there is none."""
    return {"available": False, "why": f"{run.name} recorded no timeline (areal_agents.timeline is not in this build)"}
