"""A `ChatAgent` whose episodes wait a while before they start, every third prompt much longer (a long answer):
younger groups overtake older ones, and a run's episodes are in flight at any moment
(``rollout.agent=slow_prompts_agent:SlowPromptsAgent``; tests/chaos/test_resume_exact.py)."""

import asyncio
import random

from areal_agents.agents import ChatAgent


class SlowPromptsAgent(ChatAgent):
    async def run_episode(self, env, *, seed, episode_id):
        try:
            await asyncio.sleep(random.Random(episode_id).uniform(0.0, 0.1) + (0.4 if seed % 3 == 0 else 0.0))
        except BaseException:  # cancelled while waiting: the env closes as the episode would close it
            await env.aclose()
            raise
        return await super().run_episode(env, seed=seed, episode_id=episode_id)
