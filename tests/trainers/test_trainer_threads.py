"""How many intra-op threads the trainer thread takes when ``ppo.cpu_threads`` is 0."""

import pytest

from areal_agents.config import TrainConfig
from areal_agents.trainers import policy
from areal_agents.trainers.policy import trainer_threads


@pytest.mark.parametrize(
    "staleness, backend, engine_threads, expected",
    [
        (0, "hf", 1, 4),  # synchronous: updates never overlap decoding, all cores
        (2, "hf", 1, 3),  # async with an in-process engine: leave it its thread
        (2, "hf", 3, 1),
        (2, "hf", 8, 1),  # never fewer than one
        (2, "hf", 0, 4),  # engine on torch's default: nothing to leave
        (2, "serve-model", 1, 4),  # the engine lives in other processes
    ],
)
def test_trainer_threads(monkeypatch, staleness, backend, engine_threads, expected):
    monkeypatch.setattr(policy, "DEFAULT_CPU_THREADS", 4)
    cfg = TrainConfig()
    cfg.rollout.max_staleness, cfg.engine.backend, cfg.engine.cpu_threads = staleness, backend, engine_threads
    assert trainer_threads(cfg) == expected
