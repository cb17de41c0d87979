"""A `ChatAgent` whose every request samples from one fixed seed (``SamplingParams.seed``): a row's tokens then
depend only on its prompt and the weights, not on what shares the engine's batch, so two runs of the same
config roll out the same trajectories (``rollout.agent=seeded_agent:SeededChatAgent``)."""

from dataclasses import replace

from areal_agents.agents import ChatAgent


class SeededChatAgent(ChatAgent):
    def __init__(self, engine, tokenizer, sampling, **kwargs):
        super().__init__(engine, tokenizer, replace(sampling, seed=0), **kwargs)
