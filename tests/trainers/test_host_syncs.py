"""The trainer reads its micro-batches' stats on the host once per optimizer step, not once per micro-batch
(on CUDA each read waits for the device): counted on the CPU with `tests.host_syncs`."""

import pytest
import torch

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers import ppo
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.optim import make_optimizer
from tests.host_syncs import count_host_syncs
from tests.trainers.test_ppo_update import _groups, _sgd

# the one read: `host_stats.to_host`'s (the packed layout; a padded one adds transformers' own check of the
# position ids, one per forward)
MAX_SYNCS_PER_STEP = 1


def _syncs_per_step(monkeypatch, tiny_dir, **kwargs) -> list[tuple[int, int]]:
    """(micro-batches, host syncs) of each optimizer step's `accumulate` in one `ppo_update`."""
    seen = []
    accumulate = ppo.accumulate

    def counted(model, mbs, *args, **kw):
        with count_host_syncs() as syncs:
            accumulate(model, mbs, *args, **kw)
        seen.append((len(mbs), syncs.total, dict(syncs.calls)))

    monkeypatch.setattr(ppo, "accumulate", counted)
    cfg = PPOConfig(max_grad_norm=1e9, **kwargs)
    model = load_model(tiny_dir)
    optimizer, scheduler = _sgd(model)
    critic = critic_optimizer = None
    if cfg.advantage == "gae":
        critic = ValueModel(load_model(tiny_dir).get_decoder())
        critic_optimizer, _ = make_optimizer(critic, 1e-3, 0.0, 0)
    reference = load_model(tiny_dir) if cfg.kl_coef > 0 else None
    trajectories = [t for group in _groups() for t in group]
    ppo.ppo_update(
        model, optimizer, scheduler, trajectories, cfg, temperature=1.0, pad_token_id=0,
        generator=torch.Generator().manual_seed(0), ref_model=reference, critic=critic,
        critic_optimizer=critic_optimizer, policy_version=0,
    )  # fmt: skip
    return seen


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(kl_coef=0.1, dual_clip=2.0, behav_imp_weight_cap=3.0, num_minibatches=2),
        dict(advantage="gae"),
        dict(behav_seq_ratio_min=0.5, behav_seq_ratio_max=2.0),
    ],
)
def test_a_step_reads_its_stats_once_however_many_micro_batches(monkeypatch, tiny_dir, kwargs):
    many = _syncs_per_step(monkeypatch, tiny_dir, micro_batch_tokens=16, **kwargs)
    few = _syncs_per_step(monkeypatch, tiny_dir, micro_batch_tokens=4096, **kwargs)
    assert max(n for n, *_ in many) >= 3 and max(n for n, *_ in few) == 1
    for n, total, calls in many + few:
        assert total <= MAX_SYNCS_PER_STEP, f"{n} micro-batches: {calls}"
