"""Evaluation harness: datasets run through the training envs and engines, scored as papers report."""

from areal_agents.eval.metrics import maj_at_k, pass_at_k
from areal_agents.eval.runner import EvalSettings, evaluate_dataset, run_eval, summarize

__all__ = ["EvalSettings", "evaluate_dataset", "maj_at_k", "pass_at_k", "run_eval", "summarize"]
