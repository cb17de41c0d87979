"""A step's batch taken from the rollout controller and trained on by each policy (its own agents' share): the
whole batch at once, or streamed, a policy's forward and backward fed the groups as they finish and one optimizer
step at the end (``ppo.stream_updates``). The recipe (`areal_agents.trainers.rl_recipe`) calls `take_and_train`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from areal_agents.errors import ConfigError
from areal_agents.rollout.controller import Group, RolloutController
from areal_agents.timeline import timeline
from areal_agents.trainers.interrupt import Interrupt
from areal_agents.trainers.policy import SHARED
from areal_agents.trainers.policy_api import TrainablePolicy
from areal_agents.types import Trajectory


@dataclass
class TrainedBatch:
    """A step's batch and the updates on it."""

    groups: list[Group]  # in prompt order
    stats: dict[str, dict[str, float]]  # each policy's update stats, by name
    rollout_end: float  # `time.perf_counter` when its last group was taken
    waited: float  # seconds the trainer sat idle for groups


async def take_and_train(
    controller: RolloutController,
    policies: dict[str, TrainablePolicy],
    generator: torch.Generator,
    interrupt: Interrupt,
    stream: bool,
) -> TrainedBatch:
    """Take a batch and update each policy on its share."""
    if stream:
        return await _streamed_update(controller, policies, generator, interrupt)
    t0 = time.perf_counter()
    with timeline().span("driver", "rollout_wait", keep=True):
        groups = await controller.get_batch()
    interrupt.hold()  # the update starts: a signal now waits for the step's end
    t1 = time.perf_counter()
    stats = {}
    with timeline().span("driver", "update", keep=True):
        for name, batch in _route(trajectories_of(groups), policies).items():  # each on its own agents' data
            stats[name] = await policies[name].update(batch, generator)
    return TrainedBatch(groups, stats, rollout_end=t1, waited=t1 - t0)


async def _streamed_update(
    controller: RolloutController,
    policies: dict[str, TrainablePolicy],
    generator: torch.Generator,
    interrupt: Interrupt,
) -> TrainedBatch:
    """Take a batch and train on it, feeding each policy's update the groups taken so far whenever it is
    free (``ppo.stream_updates``): its forward/backward runs while the batch's last groups generate."""
    taken: asyncio.Queue[Group | None] = asyncio.Queue()
    last_taken, waited = 0.0, 0.0

    async def take() -> None:
        nonlocal last_taken
        try:
            async for group in controller.stream_batch():
                taken.put_nowait(group)
            last_taken = time.perf_counter()
        finally:
            taken.put_nowait(None)  # the end, or the controller's error (re-raised by ``await feeder``)

    feeder = asyncio.ensure_future(take())
    groups: list[Group] = []
    try:
        end = False
        while not end:
            idle = time.perf_counter()
            with timeline().span("driver", "rollout_wait", keep=True):
                part = [await taken.get()]  # at once if groups are waiting
            waited += time.perf_counter() - idle
            while not taken.empty():
                part.append(taken.get_nowait())
            end = part[-1] is None
            part = [g for g in part if g is not None]
            groups += part
            routed = _route(trajectories_of(part), policies).items() if part else ()
            with timeline().span("driver", "update", keep=True, part=True):
                await asyncio.gather(*(policies[name].update_part(b) for name, b in routed if b))
        await feeder
    finally:
        feeder.cancel()
    interrupt.hold()  # the optimizer steps: a signal now waits for the step's end
    with timeline().span("driver", "update", keep=True):
        stats = {name: await policy.finish_update(generator) for name, policy in policies.items()}
    return TrainedBatch(sorted(groups, key=lambda g: g.index), stats, rollout_end=last_taken, waited=waited)


def trajectories_of(groups: list[Group]) -> list[Trajectory]:
    return [t for g in groups for t in g.trajectories]


def _route(trajectories: list[Trajectory], policies: dict[str, TrainablePolicy]) -> dict[str, list[Trajectory]]:
    """Trajectories by the policy that trains on them: all to the shared one, or by agent id."""
    if SHARED in policies:
        return {SHARED: trajectories}
    out: dict[str, list[Trajectory]] = {name: [] for name in policies}
    for t in trajectories:
        if t.agent_id not in out:
            raise ConfigError(
                f"policies: agent {t.agent_id!r} produced data but has no policy; policies: {sorted(out)}"
            )
        out[t.agent_id].append(t)
    return out
