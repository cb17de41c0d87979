"""An eval run's summary: avg@n, pass@k, maj@k over problems, response length, truncation rate (by the
engine's stop reason), per-difficulty breakdowns; and its console table."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from areal_agents.eval.metrics import maj_at_k, pass_at_k, report_ks


def print_summary(summary: dict[str, Any], title: str = "") -> None:
    """The headline metrics as a console table (rich), then the breakdowns."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in summary:
        if k.startswith(("avg@", "pass@", "maj@")):
            table.add_row(k, f"{100 * summary[k]:.1f}%")
    table.add_row("mean tokens", f"{summary.get('mean_tokens', 0.0):.1f}")
    table.add_row("truncated", f"{100 * summary.get('truncation_rate', 0.0):.1f}%")
    table.add_row("problems / samples", f"{summary.get('problems', 0)} / {summary.get('samples', 0)}")
    console = Console()
    if title:  # its own line: a table's title wraps to the (narrow) table, cutting a model path mid-word
        console.print(title, markup=False, highlight=False, soft_wrap=True)
    console.print(table)
    for key, groups in summary.items():
        if key.startswith("by_"):
            sub = Table(title=key.removeprefix("by_"))
            sub.add_column(key.removeprefix("by_"))
            sub.add_column("problems", justify="right")
            sub.add_column("accuracy", justify="right")
            for name, row in groups.items():
                acc = next(v for k, v in row.items() if k.startswith("avg@"))
                sub.add_row(name, str(row["problems"]), f"{100 * acc:.1f}%")
            console.print(sub)
    for note in summary.get("notes", []):
        console.print(f"note: {note}")


def summarize(records: list[dict[str, Any]], n: int, breakdown: tuple[str, ...] = ()) -> dict[str, Any]:
    """avg@n, pass@k and maj@k (k = 1, 2, 4, ..., n) over problems, response length, truncation rate."""
    by_problem: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_problem[r["index"]].append(r)
    problems = [sorted(v, key=lambda r: r["sample"]) for _, v in sorted(by_problem.items())]
    if not problems:
        return {"problems": 0, "samples": 0}
    out: dict[str, Any] = {"problems": len(problems), "samples": len(records), "n": n}
    out[f"avg@{n}"] = _mean([_mean([s["correct"] for s in p]) for p in problems])
    for k in report_ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(len(p), sum(s["correct"] for s in p), k) for p in problems if len(p) >= k])
        answers = [[s["answer"] for s in p] for p in problems]
        if any(a is not None for p in answers for a in p):  # code has no answer to vote on
            correct = [[s["correct"] for s in p] for p in problems]
            out[f"maj@{k}"] = _mean([maj_at_k(a, c, k) for a, c in zip(answers, correct)])
    out["mean_tokens"] = _mean([r["tokens"] for r in records])
    out["truncation_rate"] = _mean([r["finish_reason"] == "length" for r in records])
    for key in breakdown:
        groups: dict[str, list[float]] = defaultdict(list)
        for p in problems:
            if key in p[0]:
                groups[str(p[0][key])].append(_mean([s["correct"] for s in p]))
        if groups:
            out[f"by_{key}"] = {g: {"problems": len(v), f"avg@{n}": _mean(v)} for g, v in sorted(groups.items())}
    return out


def _mean(values: list[float]) -> float:
    return float(sum(values)) / len(values) if values else 0.0
