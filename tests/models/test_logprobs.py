"""`tempered_log_softmax`: the one temperature-scaled log-softmax of the engine and the trainer."""

import math

import pytest
import torch

from areal_agents.models.logprobs import chunked_token_logprobs, tempered_log_softmax, tempered_token_logprobs


def test_hand_computed_value_at_a_temperature():
    # logits [2, 0, ln 2] / T=0.5 -> [4, 0, 2 ln 2]; exp -> [e^4, 1, 4]; log p(0) = 4 - ln(e^4 + 5)
    logits = torch.tensor([2.0, 0.0, math.log(2.0)])
    out = tempered_log_softmax(logits, 0.5)
    assert out[0].item() == pytest.approx(4.0 - math.log(math.exp(4.0) + 5.0), abs=1e-6)
    assert out[2].item() == pytest.approx(math.log(4.0) - math.log(math.exp(4.0) + 5.0), abs=1e-6)
    assert tempered_token_logprobs(logits[None], torch.tensor([2]), 0.5).item() == out[2].item()


def test_zero_temperature_counts_as_one_and_a_tensor_gives_one_per_row():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    plain = torch.log_softmax(logits, -1)
    assert torch.equal(tempered_log_softmax(logits, 0.0), plain)  # greedy: T = 1
    rows = tempered_log_softmax(logits, torch.tensor([0.0, 1.0, 0.5]))
    assert torch.equal(rows[0], plain[0]) and torch.equal(rows[1], plain[1])
    assert torch.equal(rows[2], torch.log_softmax(logits[2] / 0.5, -1))


def test_half_precision_logits_are_taken_in_float32():
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = tempered_log_softmax(logits, 0.7)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.log_softmax(logits.float() / 0.7, -1))


@pytest.mark.parametrize("grad", [False, True])
def test_chunks_give_the_values_and_gradients_of_one_pass(grad):
    """Chunks of 3 over 10 rows (the last one short), checkpointed when gradients flow."""
    gen = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(4, 11)
    hidden = torch.randn(10, 4, generator=gen, requires_grad=grad)
    tokens = torch.randint(0, 11, (10,), generator=gen)
    whole = tempered_token_logprobs(head(hidden), tokens, 0.8)
    chunked = chunked_token_logprobs(hidden, head, tokens, 0.8, chunk_tokens=3)
    assert torch.allclose(chunked, whole, atol=1e-6)
    if grad:
        (g_whole,) = torch.autograd.grad(whole.sum(), hidden)
        (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
        assert torch.allclose(g_chunked, g_whole, atol=1e-6)
    assert chunked_token_logprobs(hidden[:0], head, tokens[:0], 1.0).shape == (0,)


def test_rows_score_a_repeating_layout_without_expanding_it():
    """Shared prompts score each trajectory token from a row of a shorter run (``rows``); the same values
    and gradients as expanding the hidden states first."""
    gen = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(4, 11)
    hidden = torch.randn(6, 4, generator=gen, requires_grad=True)
    rows = torch.tensor([0, 1, 2, 3, 0, 1, 2, 4, 5, 5])
    tokens = torch.randint(0, 11, (10,), generator=gen)
    expanded = tempered_token_logprobs(head(hidden.index_select(0, rows)), tokens, 0.8)
    chunked = chunked_token_logprobs(hidden, head, tokens, 0.8, chunk_tokens=3, rows=rows)
    assert torch.allclose(chunked, expanded, atol=1e-6)
    (g_expanded,) = torch.autograd.grad(expanded.sum(), hidden)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    assert torch.allclose(g_chunked, g_expanded, atol=1e-6)
