"""Micro-batches: the type in its own module (batching and packing do not import each other), and
`per_trajectory` cutting a micro-batch-shaped score back into trajectories."""

import ast
from pathlib import Path

import pytest
import torch

from areal_agents.trainers import batching, microbatch, packing
from areal_agents.types import Trajectory


def _trajs() -> list[Trajectory]:
    return [
        Trajectory([5, 6, 7, 8], [0, 1, 1, 1], [0.0, -1.0, -2.0, -3.0], [-1, 0, 0, 0]),
        Trajectory([5, 6, 9], [0, 1, 1], [0.0, -1.5, -2.5], [-1, 0, 0]),
        Trajectory([11, 12, 13, 14, 15, 16], [0, 0, 1, 1, 1, 1], [0.0] * 6, [-1] * 6),
    ]


def _imports(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


def test_packing_and_the_micro_batch_type_do_not_import_batching():
    assert "areal_agents.trainers.batching" not in _imports(packing) | _imports(microbatch)
    assert not {m for m in _imports(microbatch) if m.startswith("areal_agents.")}


def test_the_old_names_still_resolve_to_the_one_type():
    assert batching.MicroBatch is microbatch.MicroBatch and batching.spread is microbatch.spread
    assert packing.SharedPrompts is microbatch.SharedPrompts
    (mb,) = batching.make_micro_batches(_trajs(), 64, pack=True)
    assert isinstance(mb, microbatch.MicroBatch)


@pytest.mark.parametrize("pack, share", [(False, False), (True, False), (True, True)])
def test_per_trajectory_cuts_a_score_back_into_each_trajectory(pack, share):
    trajs = _trajs()

    def score(mb):  # the token ids themselves, laid out like the micro-batch
        return mb.input_ids.float()

    # budget 8: several micro-batches (trajectory order is not micro-batch order)
    out = batching.per_trajectory(score, trajs, 8, pad_token_id=0, pack=pack, share_prompts=share)
    assert [o.tolist() for o in out] == [[float(x) for x in t.input_ids] for t in trajs]


def test_spread_lays_per_trajectory_values_out_like_the_micro_batch():
    trajs = _trajs()
    (mb,) = batching.make_micro_batches(trajs, 64, pack=True)
    values = [torch.full((len(t),), float(i + 1)) for i, t in enumerate(trajs)]
    laid = microbatch.spread(mb, values)
    for (row, a, b), i in zip(mb.slices, mb.index):
        assert torch.equal(laid[row, a:b], values[i])
