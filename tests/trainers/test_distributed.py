"""Data-parallel shares: token-balanced, padded to equal counts. (Two FSDP2 ranks against one process: test_fsdp.py.)"""

import random

from areal_agents.trainers.batching import make_micro_batches
from areal_agents.trainers.distributed import DataParallel
from areal_agents.types import Trajectory


def _batch() -> list[Trajectory]:
    """8 groups of 4 (each sharing its prompt) with mixed lengths and rewards (some zero-variance groups)."""
    rng = random.Random(0)
    out = []
    for g in range(8):
        prompt_ids = [rng.randint(5, 60) for _ in range(rng.randint(3, 12))]
        for e in range(4):
            prompt, gen = len(prompt_ids), rng.randint(1, 20)
            ids = prompt_ids + [rng.randint(5, 60) for _ in range(gen)]
            mask = [0] * prompt + [1] * gen
            logp = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(gen)]
            versions = [-1] * prompt + [0] * gen
            reward = 1.0 if g % 3 == 0 else float(rng.random() < 0.5)
            out.append(Trajectory(ids, mask, logp, versions, reward, f"g{g}", episode_id=f"g{g}/e{e}"))
    return out


def test_share_balances_tokens_covers_every_micro_batch_and_pads_to_equal_counts():
    trajs = _batch()
    mbs = make_micro_batches(trajs, 64, pad_token_id=0)
    shares = [DataParallel(r, 3).share(mbs) for r in range(3)]
    real = [[mb for mb in s if mb.index] for s in shares]
    assert sorted(id(mb) for s in real for mb in s) == sorted(id(mb) for mb in mbs)  # each exactly once
    loads = [sum(mb.input_ids.numel() for mb in s) for s in real]
    assert max(loads) - min(loads) <= max(mb.input_ids.numel() for mb in mbs)
    # every rank runs as many forward/backward passes (FSDP2's collectives); the padding trains nothing
    assert len({len(s) for s in shares}) == 1
    pads = [mb for s in shares for mb in s if not mb.index]
    assert len(pads) == 3 * len(shares[0]) - len(mbs)
    assert all(mb.num_loss_tokens == 0 and mb.attended == 0 for mb in pads)


def test_one_rank_shares_everything_unpadded():
    mbs = make_micro_batches(_batch(), 64, pad_token_id=0)
    assert sorted(map(id, DataParallel(0, 1).share(mbs))) == sorted(map(id, mbs))
