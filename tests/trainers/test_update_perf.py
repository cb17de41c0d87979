"""An update's perf figures: the memory peak, reset per update."""

import pytest
import torch

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers import ppo
from areal_agents.types import Trajectory


def _group() -> list[Trajectory]:
    """A prompt of 4 tokens and two completions of 3 and 2: 13 tokens as trajectories, 9 with the prompt once."""
    prompt = [5, 6, 7, 8]
    return [
        Trajectory(prompt + done, [0] * 4 + [1] * len(done), [0.0] * 4 + [-1.0] * len(done),
                   [-1] * 4 + [0] * len(done), reward=reward, group_id="g", episode_id=f"g/{reward}")
        for done, reward in (([9, 10, 11], 1.0), ([12, 13], 0.0))
    ]  # fmt: skip


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_update_starts_the_memory_peak_afresh(tiny_dir, monkeypatch, streamed):
    reset = []
    monkeypatch.setattr(ppo, "reset_peak_memory", reset.append)
    model = load_model(tiny_dir)
    if streamed:
        update = ppo.StreamedUpdate(model, *_sgd(model), PPOConfig(), temperature=1.0, pad_token_id=0)
        update.add(_group())
        update.finish()
    else:
        ppo.ppo_update(model, *_sgd(model), _group(), PPOConfig(), temperature=1.0, pad_token_id=0)
    assert reset == [torch.device("cpu")]
