"""`PipeTransport` when a rank fails (two gloo ranks answering with a small endpoint of collectives): a rank
that dies stops every rank at once, one that raises while the others wait in a collective for it stops the
trainer after `stuck_after_s`, and one that raises after the collectives leaves the trainer usable. Never a
call that waits for good on ranks that cannot answer."""

import os
import time

import pytest

from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.trainer_process import PipeTransport, RankOptions, TrainerProcessError

pytestmark = pytest.mark.process  # two rank processes per test (~3 s each)


class Collectives:
    """Calls that each run one all-reduce, with rank 1 (or 0) failing before or after it."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp

    def call(self, method: str, args: tuple) -> float:
        if method == "die_on_1" and self.dp.rank == 1:
            os._exit(3)
        if method == "fail_on_1" and self.dp.rank == 1:
            raise ValueError("rank 1 failed before the collective")
        total = self.dp.sum({"x": 1.0})["x"]  # waits for every rank
        if method == "fail_on_0_after" and self.dp.rank == 0:
            raise ValueError("rank 0 failed after the collective")
        return total


def collectives(dp: DataParallel) -> tuple[Collectives, None]:
    return Collectives(dp), None


@pytest.fixture
def transport():
    t = PipeTransport.start("ranks", collectives, (), RankOptions(threads=1, device="cpu"), nproc=2)
    yield t
    t.close()


def test_an_error_after_the_collectives_leaves_the_trainer_usable(transport):
    assert transport.call("sum") == 2.0
    with pytest.raises(TrainerProcessError, match=r"\(rank 0\) failed in fail_on_0_after:(.|\n)*rank 0 failed after"):
        transport.call("fail_on_0_after")
    assert transport.call("sum") == 2.0


def test_a_rank_that_dies_stops_every_rank_at_once(transport):
    start = time.monotonic()
    with pytest.raises(TrainerProcessError, match=r"\(rank 1\) died during die_on_1 \(exit code 3\)"):
        transport.call("die_on_1")
    assert time.monotonic() - start < 60  # rank 0 was waiting in the all-reduce: not for gloo's 30-minute timeout
    assert not any(p.is_alive() for p in transport.processes)
    with pytest.raises(TrainerProcessError, match="is gone"):
        transport.call("sum")


def test_a_rank_error_that_leaves_the_others_in_a_collective_stops_the_trainer(transport):
    transport.stuck_after_s = 1.0
    with pytest.raises(
        TrainerProcessError, match=r"(?s)rank 1 failed before.*ranks 0 of trainer 'ranks' did not answer"
    ):
        transport.call("fail_on_1")
    assert not any(p.is_alive() for p in transport.processes)
    with pytest.raises(TrainerProcessError, match="is gone"):
        transport.call("sum")
