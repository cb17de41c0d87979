"""What an RL run's checkpoint holds besides each policy's weights and train state (`RunState`: where the
run stands in its prompts, the sampling generator, the episode ledger, the held-out accuracy curve so far,
the policy version), and how a run's checkpoint is written (`save_run`) and read back (`RunState.restore`).

Layout inside ``checkpoints/step_N/`` (see `areal_agents.trainers.checkpoint`): ``model/`` and the train
state at the top of ``trainer_state.pt`` for the shared policy; ``policies/NAME/model/`` and
``trainer_state.pt["policies"][NAME]`` for each of several.

Example::

    run = RunState.restore(seed=1, state=load_trainer_state(ckpt))
    path = save_run(run_dir, run.first_step, policies, tokenizer, run.snapshot(controller.cursor, 3), keep=3)

Where the run stands in its prompts is a `DataCursor`: ``data_position`` (the lowest unconsumed prompt),
``consumed`` (the prompts above it already consumed: at ``max_staleness`` >= 1 groups finish out of order)
and ``in_flight`` (prompt -> policy version at submission, for the groups submitted and not consumed). A
resume submits exactly the prompts not consumed, in order, so none is trained twice or skipped; the
episodes the checkpoint had in flight count as cancelled (their groups run again from the start). A
checkpoint from before these keys resumes as it did: from ``data_position``, its running episodes taken out
of the ledger's submitted count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from areal_agents.rollout.controller import DataCursor
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.trainers.checkpoint import prune_checkpoints, save_checkpoint
from areal_agents.trainers.policy import SHARED
from areal_agents.trainers.policy_api import TrainablePolicy


@dataclass
class RunState:
    """A run's position: its next step, where it stands in its prompts, its sampling generator, its ledger."""

    first_step: int
    data: DataCursor
    generator: torch.Generator
    ledger: RolloutLedger
    accuracy_before: float | None = None  # measured before step 1 (None: not yet)
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out accuracy), step 0 first

    def record_accuracy(self, step: int, accuracy: float) -> None:
        """A held-out evaluation after ``step`` (0: before training) joins the curve, replacing any of this
        step or later (a resumed run's evaluation of its checkpoint's step, or of a shorter run's end)."""
        if step == 0:
            self.accuracy_before = accuracy
        self.accuracy_curve = [p for p in self.accuracy_curve if p[0] < step] + [(step, accuracy)]

    @classmethod
    def restore(cls, seed: int, state: dict[str, Any] | None) -> RunState:
        """A new run's start (``state`` None), or the position a checkpoint's ``state`` saved. The groups it had
        in flight run again: their episodes count as cancelled (running, or ended well: ``in_flight_accepted``);
        a checkpoint without ``in_flight`` (older) takes its running episodes out of the submitted count."""
        generator = torch.Generator().manual_seed(seed)
        if state is None:
            return cls(1, DataCursor(), generator, RolloutLedger())
        generator.set_state(state["generator"])
        ledger = RolloutLedger(**{k: v for k, v in state["ledger"].items() if k != "running"})
        data = DataCursor(
            state["data_position"],
            tuple(state.get("consumed", ())),
            dict(state.get("in_flight", {})),
            state.get("in_flight_accepted", 0),
        )
        if "in_flight" in state:
            ledger.cancelled += state["ledger"]["running"]
            ledger.cancel(data.in_flight_accepted)
        else:
            ledger.submitted -= state["ledger"]["running"]
        before = state["accuracy_before"]
        # a checkpoint written before the curve was kept holds only the accuracy before training
        curve = [tuple(p) for p in state.get("accuracy_curve", [(0, before)] if before is not None else [])]
        return cls(state["step"] + 1, data, generator, ledger, before, curve)

    def snapshot(self, data_position: DataCursor | int, version: int) -> dict[str, Any]:
        """What a checkpoint of the step just finished holds besides the policies. ``data_position``: the
        controller's `cursor` (an int: that position, nothing consumed above it, nothing in flight)."""
        data = data_position if isinstance(data_position, DataCursor) else DataCursor(data_position)
        return {
            "data_position": data.position,
            "consumed": list(data.consumed),
            "in_flight": dict(data.in_flight),
            "in_flight_accepted": data.in_flight_accepted,
            "generator": self.generator.get_state(),
            "accuracy_before": self.accuracy_before,
            "accuracy_curve": list(self.accuracy_curve),
            "version": version,
            "ledger": self.ledger.counts(),
        }


def restore_policies(policies: dict[str, TrainablePolicy], ckpt: Path) -> None:
    """Each policy's train state from the checkpoint ``ckpt``, read where the policy trains, with the config's
    rates (an allowed change of ``ppo.lr``, ``critic_lr`` or ``weight_decay`` takes effect)."""
    for name, policy in policies.items():
        policy.load_train_state(ckpt / "trainer_state.pt", None if name == SHARED else name)


def model_dir(name: str) -> str:
    """Where a policy's model lives inside a checkpoint."""
    return "model" if name == SHARED else f"policies/{name}/model"


def save_run(
    run_dir: Path,
    step: int,
    policies: dict[str, TrainablePolicy],
    tokenizer: PreTrainedTokenizerBase,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Checkpoint step ``step``: each policy's model and train state (written where they live), and ``extra``
    (`RunState.snapshot`); keep the newest ``keep`` checkpoints (0: all). Its path."""
    models = {model_dir(name): p.save_checkpoint for name, p in policies.items()}  # LoRA: the adapter
    states = [
        functools.partial(p.save_train_state, key=None if name == SHARED else name) for name, p in policies.items()
    ]
    path = save_checkpoint(run_dir, step, models, tokenizer, extra, states)
    prune_checkpoints(run_dir, keep)
    return path
