"""Evaluation harness: datasets (or any env's reset seeds) run through the training envs, engines and
episode runner, scored as papers report."""

from areal_agents.eval.metrics import maj_at_k, pass_at_k
from areal_agents.eval.options import EvalOptions
from areal_agents.eval.problems import Problem, ProblemSet, load_problems
from areal_agents.eval.runner import EvalSettings, evaluate_dataset, run_eval
from areal_agents.eval.summary import summarize

__all__ = [
    "EvalOptions",
    "EvalSettings",
    "Problem",
    "ProblemSet",
    "evaluate_dataset",
    "load_problems",
    "maj_at_k",
    "pass_at_k",
    "run_eval",
    "summarize",
]
