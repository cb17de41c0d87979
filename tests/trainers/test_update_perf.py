"""An update's perf figures: the model FLOPs (MFU's numerator) counted by hand, with attention's width heads x
head dim (not the hidden size) and a shared prompt counted once, as computed; and the memory peak, reset
per update."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM

from areal_agents.config import PPOConfig
from areal_agents.models import load_model
from areal_agents.trainers import ppo
from areal_agents.trainers.batching import make_micro_batches
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
    tally.work |= {"trained_tokens": 400.0, "computed_tokens": 400.0, "attended": float(attended)}
    assert tally.perf(lm, PPOConfig(), None)["model_flops"] == want


def _group() -> list[Trajectory]:
    """A prompt of 4 tokens and two completions of 3 and 2: 13 tokens as trajectories, 9 with the prompt once."""
    prompt = [5, 6, 7, 8]
    return [
        Trajectory(prompt + done, [0] * 4 + [1] * len(done), [0.0] * 4 + [-1.0] * len(done),
                   [-1] * 4 + [0] * len(done), reward=reward, group_id="g", episode_id=f"g/{reward}")
        for done, reward in (([9, 10, 11], 1.0), ([12, 13], 0.0))
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("share", "tokens", "attended"),
    [
        # each trajectory whole: 7 + 6 tokens; 7 * 8 / 2 + 6 * 7 / 2 = 28 + 21 positions
        (False, 13, 49),
        # the prompt once (4 * 5 / 2 = 10), then each completion all of the prompt and causally itself:
        # 3 * 4 + 3 * 4 / 2 = 18 and 2 * 4 + 2 * 3 / 2 = 11
        (True, 9, 10 + 18 + 11),
    ],
)
def test_a_micro_batch_counts_what_the_model_computes(share, tokens, attended):
    (mb,) = make_micro_batches(_group(), 4096, pad_token_id=0, pack=True, share_prompts=share)
    assert (mb.computed_tokens, mb.attended) == (tokens, attended)
    assert (mb.padding().computed_tokens, mb.padding().attended) == (0, 0)  # a rank's zero-loss copy: not counted


def test_padding_of_a_padded_layout_is_not_counted():
    (mb,) = make_micro_batches(_group(), 4096, pad_token_id=0, pack=False)
    assert mb.input_ids.numel() == 14 and (mb.computed_tokens, mb.attended) == (13, 49)


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def test_an_update_with_shared_prompts_counts_the_prompt_once(tiny_dir):
    model = load_model(tiny_dir)
    cfg = PPOConfig(packing=True, share_prompts=True)
    stats = ppo.ppo_update(model, *_sgd(model), _group(), cfg, temperature=1.0, pad_token_id=0)
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    width = config.num_attention_heads * (config.head_dim or config.hidden_size // config.num_attention_heads)
    assert stats["trained_tokens"] == 13 and stats["computed_tokens"] == 9
    assert stats["model_flops"] == 6 * parameters * 9 + 12 * config.num_hidden_layers * width * 39


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
