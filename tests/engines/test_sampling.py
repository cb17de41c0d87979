"""`sample_tokens`: draws in proportion to the filtered distribution, behavior logprobs over the full one."""

import pytest
import torch

from areal_agents.engines.hf.sampling import sample_tokens, seeded_uniform


def draw(logits, temperature=1.0, top_p=1.0, top_k=0, n=40000, seed=0):
    """``n`` draws from one row of logits, as one batch of ``n`` identical rows."""
    rows = logits.expand(n, -1)
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype)  # noqa: E731
    return sample_tokens(
        rows, full(temperature, torch.float), full(top_p, torch.float), full(top_k, torch.long),
        torch.Generator().manual_seed(seed),
    )  # fmt: skip


def test_draws_follow_the_tempered_distribution_and_never_hit_a_zero_probability_token():
    logits = torch.tensor([[2.0, -float("inf"), 0.5, 1.0, -float("inf")]])
    tokens, logprobs = draw(logits, temperature=0.7)
    expected = torch.softmax(logits / 0.7, -1)[0]
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, expected.double(), atol=0.01)
    assert torch.allclose(logprobs, torch.log_softmax(logits / 0.7, -1)[0, tokens])


def test_top_k_and_top_p_restrict_the_draw_but_not_the_logprob():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = torch.softmax(logits, -1)[0]
    tokens, logprobs = draw(logits, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert abs(freq[0] - probs[0] / (probs[0] + probs[1])) < 0.01
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[0, tokens])  # the full vocabulary's
    tokens, _ = draw(logits, top_p=0.5)  # token 0 alone holds 64% of the mass
    assert set(tokens.tolist()) == {0}


def test_greedy_rows_take_the_argmax_and_a_seed_repeats_its_draws():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5, 0.0])
    args = (logits, temperature, torch.ones(6), torch.zeros(6, dtype=torch.long))
    tokens, _ = sample_tokens(*args, torch.Generator().manual_seed(3))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    again, _ = sample_tokens(*args, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)


def test_logits_that_are_not_finite_are_refused_with_their_rows():
    logits = torch.zeros(4, 10)
    logits[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[2\] are not finite"):
        sample_tokens(logits, torch.ones(4), torch.ones(4), torch.zeros(4, dtype=torch.long))


def test_the_behavior_logprob_is_the_trainers_tempered_log_softmax():
    """Engine and trainer call one function: at the same logits the importance ratio is exactly 1."""
    from areal_agents.models.logprobs import tempered_token_logprobs

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3])
    tokens, logprobs = sample_tokens(
        logits, temperature, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.Generator().manual_seed(0)
    )
    for row, t in enumerate(temperature.tolist()):
        expected = tempered_token_logprobs(logits[row], tokens[row], t)
        assert torch.equal(logprobs[row], expected)


def test_seeded_rows_draw_their_own_uniform_and_the_others_the_generator():
    # probabilities [0.25, 0.25, 0.5]: cumulative [0.25, 0.5, 1]; a draw u picks the first token whose
    # cumulative probability reaches u: 0.3 -> token 1, 0.8 -> token 2, 0.1 -> token 0
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5]])).expand(4, -1)
    ones, off = torch.ones(4), torch.zeros(4, dtype=torch.long)
    draws = torch.tensor([0.3, 0.8, 0.1, float("nan")], dtype=torch.float64)
    tokens, _ = sample_tokens(logits, ones, ones, off, torch.Generator().manual_seed(0), draws)
    assert tokens[:3].tolist() == [1, 2, 0]
    generators = [torch.Generator().manual_seed(s) for s in range(40)]
    unseeded = {int(sample_tokens(logits, ones, ones, off, g, draws)[0][3]) for g in generators}
    assert unseeded == {0, 1, 2}  # the NaN row draws from the generator


def test_seeded_uniform_is_a_fixed_function_of_seed_and_position():
    values = [seeded_uniform(seed, pos) for seed in range(50) for pos in range(50)]
    assert all(0 < v <= 1 for v in values) and len(set(values)) == len(values)
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(7, 4)
    assert abs(sum(values) / len(values) - 0.5) < 0.02  # spread over (0, 1]
