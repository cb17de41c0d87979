"""distinct_seeds: an env with too few distinct problems names the config key and the fix."""

import asyncio

import pytest

from areal_agents.errors import ArealAgentsError
from areal_agents.rollout.held_out import distinct_seeds


class FewProblemsEnv:
    """An env whose first observation takes ``problems`` values: seed % problems."""

    def __init__(self, problems: int) -> None:
        self.problems = problems

    async def areset(self, seed=None, options=None):
        return f"problem {seed % self.problems}", {}

    async def aclose(self):
        pass


def test_distinct_seeds_are_the_first_seed_of_each_problem():
    assert asyncio.run(distinct_seeds(lambda: FewProblemsEnv(3), 3, start=5)) == [5, 6, 7]


@pytest.mark.parametrize("problems, yields", [(1, "only 1 distinct problem (in"), (2, "only 2 distinct problems (in")])
def test_too_few_distinct_problems_name_eval_num_problems_and_the_fix(problems, yields):
    with pytest.raises(ArealAgentsError) as e:
        asyncio.run(distinct_seeds(lambda: FewProblemsEnv(problems), 10))
    message = str(e.value)
    assert message.startswith(f"eval.num_problems=10, but the env yields {yields} seeds 0 to ")
    assert f"set eval.num_problems={problems} or fewer" in message
