"""An update's perf figures: the model FLOPs (MFU's numerator) counted by hand, with attention's width heads x
head dim (not the hidden size); and the memory peak, reset per update."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers import ppo
from areal_agents.trainers.distributed import attention_width, lm_flops, model_flops
from areal_agents.types import Trajectory

# Qwen/Qwen3-0.6B's config.json (transformers' Qwen3 shapes)
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    attention_bias=False,
)


def test_attention_width_is_heads_times_head_dim():
    assert attention_width(Qwen3Config(**QWEN3_0_6B)) == 16 * 128  # twice its hidden size
    assert attention_width(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=None)) == 64


def test_qwen3_0_6b_flops_by_hand():
    with torch.device("meta"):  # the shapes alone: no 0.6B weights in memory
        lm = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B))
    # parameters: the embedding (tied to the head, counted once) 151936 x 1024; per layer q 1024 x 2048,
    # k and v 1024 x 1024 each (8 kv heads x 128), o 2048 x 1024, q/k norms 128 each, two RMSNorms 1024 each,
    # gate/up/down 3 x 1024 x 3072; then the final norm 1024
    layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 2 * 128 + 2 * 1024 + 3 * 1024 * 3072
    parameters = 151936 * 1024 + 28 * layer + 1024
    assert parameters == 596_049_920
    # two sequences of 100 and 300 tokens: 400 tokens, attending 100 * 101 / 2 + 300 * 301 / 2 positions;
    # attention per position 12 x 28 layers x (16 heads x 128)
    attended = 100 * 101 // 2 + 300 * 301 // 2
    want = 6 * parameters * 400 + 12 * 28 * 2048 * attended
    assert lm_flops(lm, 400, attended) == want
    assert model_flops(400, parameters, 28, 2048, attended) == want
    tally = ppo._Tally(critic=False)  # what an update reports from the same work
    tally.work |= {"trained_tokens": 400.0, "attended": float(attended)}
    assert tally.perf(lm, PPOConfig(), None)["model_flops"] == want


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
