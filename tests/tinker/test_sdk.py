"""The unmodified ``tinker`` SDK (0.38) against a real ``areal-agents serve-tinker`` process on a tiny Qwen3,
training in its own process and on two FSDP2 ranks: the basic loop (LoRA client, tokenizer, forward_backward +
optim_step with the loss going down, a sampler from the trained weights, save_state and a resumed client
scoring the same), and client mistakes that fail at once with the SDK's own errors (issue 49's acceptance)."""

import numpy as np
import pytest
import tinker
import torch  # pyproject's dev extra
from tinker import types

from areal_agents.models.tiny import save_tiny_model
from tests.tinker.tinker_process import CLIENT_ENV, serve_tinker

pytestmark = pytest.mark.process  # ~6 s a server: in the default run, so CI runs the SDK's loop
BASE = "tiny-q"
TEXTS = ["hello world, this is a test", "the quick brown fox jumps"]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-fsdp2-ranks"])
def server(request, tmp_path_factory, monkeypatch_module):
    """``serve-tinker`` on a fresh tiny Qwen3 checkpoint, training in its own process or on two FSDP2 ranks
    (gloo); the SDK's env points at it."""
    root = tmp_path_factory.mktemp("tinker")
    with serve_tinker(root, {BASE: save_tiny_model(root / "base", family="qwen3")}, request.param) as url:
        for key, value in {"TINKER_BASE_URL": url, **CLIENT_ENV}.items():
            monkeypatch_module.setenv(key, value)
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def service_client(server):
    with tinker.ServiceClient() as client:  # its close finishes the session on the server
        yield client


def datums(tokenizer) -> list:
    """Each text as next-token prediction: input tokens[:-1], targets tokens[1:], weight 1."""
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    return out


def test_the_basic_loop_trains_samples_saves_and_resumes(service_client):
    training = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    data = datums(tokenizer)
    losses = []
    for _ in range(5):
        out = training.forward_backward(data, "cross_entropy").result(timeout=60)
        training.optim_step(types.AdamParams(learning_rate=3e-3)).result(timeout=60)
        losses.append(out.metrics["loss:sum"])
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
            len(d.model_input.to_ints()) for d in data
        ]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("hello"))
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    result = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=60)
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)

    path = training.save_state("c1").result(timeout=60).path
    assert path.startswith("tinker://") and path.endswith("/weights/c1")
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    before = training.forward(data, "cross_entropy").result(timeout=60).loss_fn_outputs
    after = resumed.forward(data, "cross_entropy").result(timeout=60).loss_fn_outputs
    for a, b in zip(before, after):
        np.testing.assert_allclose(a["logprobs"].tolist(), b["logprobs"].tolist(), atol=1e-5)


def test_a_loss_input_of_the_wrong_length_fails_its_future_at_once(service_client):
    training = service_client.create_lora_training_client(base_model=BASE, rank=4).result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.RequestFailedError, match="target_tokens"):
        training.forward_backward([bad], "cross_entropy").result(timeout=30)


def test_an_unknown_base_model_is_a_bad_request(service_client):
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        service_client.create_lora_training_client(base_model="nope", rank=8).result(timeout=30)


def test_a_custom_loss_runs_on_the_client_over_the_servers_cross_entropy(service_client):
    """forward_backward_custom: the SDK scores with forward, takes the loss's gradient on the client and sends it
    back as cross_entropy weights (negative ones included); the gradient is the same as the built-in loss's."""
    custom = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    builtin = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    data = datums(custom.get_tokenizer())

    def minus_half_sum(data_, logprobs):  # = cross_entropy with weights 0.5, built from the logprobs
        loss = -0.5 * sum(lp.sum() for lp in logprobs)
        return loss, {"custom:sum": float(loss.detach())}

    half = [types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "weights": [0.5] * len(
        d.loss_fn_inputs["weights"].tolist())}) for d in data]  # fmt: skip
    out = custom.forward_backward_custom(data, minus_half_sum).result(timeout=60)
    assert out.metrics["custom:sum"] > 0
    builtin.forward_backward(half, "cross_entropy").result(timeout=60)
    for client in (custom, builtin):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    a, b = (c.forward(data, "cross_entropy").result(timeout=60).loss_fn_outputs for c in (custom, builtin))
    for x, y in zip(a, b):
        torch.testing.assert_close(
            torch.tensor(x["logprobs"].tolist()), torch.tensor(y["logprobs"].tolist()), atol=1e-4, rtol=0
        )
