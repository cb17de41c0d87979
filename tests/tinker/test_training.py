"""TinkerTrainer: Tinker's losses on the trainer's adapters (hand-computed values), gradients that add up until
optim_step, AdamW with per-call params, independent adapters on one base, checkpoints, snapshots served by
HFEngine with the trainer's logprobs, and client mistakes named by field."""

import asyncio
import math

import pytest
import torch

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.errors import TinkerUserError
from areal_agents.models import load_model
from areal_agents.tinker.sampler import SampleParams, ServedAdapters, Snapshot
from areal_agents.tinker.training import TinkerTrainer

A, B = "s:train:0", "s:train:1"
TOKENS = [[5, 6, 7, 8, 9], [11, 12, 13]]
TARGETS = [[6, 7, 8, 9, 20], [12, 13, 30]]  # the client's shift; the last targets are arbitrary tokens


def datums(**per_token) -> list:
    """The two datums, each input given as one list per datum (``per_token[key][i]``)."""
    out = []
    for i, (tokens, targets) in enumerate(zip(TOKENS, TARGETS)):
        inputs = {"target_tokens": torch.tensor(targets)}
        inputs.update({k: torch.tensor(v[i], dtype=torch.float32) for k, v in per_token.items()})
        out.append((tokens, inputs))
    return out


def ce_datums() -> list:
    return datums(weights=[[1.0, 1.0, 0.5, 2.0, 1.0], [1.0, 0.0, 1.0]])


def reference_logprobs(tiny_dir) -> list[torch.Tensor]:
    """log p(target_t | tokens <= t) by a plain forward of the base, one datum at a time (a fresh adapter has
    B = 0: it is the base exactly)."""
    lm = load_model(tiny_dir)
    with torch.no_grad():
        return [
            lm(torch.tensor([t])).logits[0].float().log_softmax(-1).gather(-1, torch.tensor(y)[:, None])[:, 0]
            for t, y in zip(TOKENS, TARGETS)
        ]


def grads(trainer: TinkerTrainer, model_id: str) -> list[torch.Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trainer.models[model_id].adapter.parameters()
    ]


def weights(trainer: TinkerTrainer, model_id: str) -> dict[str, torch.Tensor]:
    return trainer.models[model_id].adapter.tensors()


def logprobs(trainer: TinkerTrainer, model_id: str) -> list[torch.Tensor]:
    return trainer.forward_backward(model_id, ce_datums(), "cross_entropy", forward_only=True).logprobs


@pytest.fixture
def trainer(tiny_dir):
    t = TinkerTrainer()
    t.create_model(A, str(tiny_dir), rank=4, seed=1)
    return t


def test_cross_entropy_is_the_weighted_sum_of_minus_logprobs(trainer, tiny_dir):
    weights_ = [[1.0, -0.5, 0.0, 2.0, 1.0], [0.25, 1.0, -1.0]]  # negative weights too (forward_backward_custom)
    out = trainer.forward_backward(A, datums(weights=weights_), "cross_entropy")
    ref = reference_logprobs(tiny_dir)
    for i in range(2):
        torch.testing.assert_close(out.logprobs[i], ref[i], atol=1e-5, rtol=0)
        assert out.logprobs[i].dtype == out.elementwise_loss[i].dtype == torch.float32
        torch.testing.assert_close(out.elementwise_loss[i], -ref[i] * torch.tensor(weights_[i]), atol=1e-5, rtol=0)
    expected = sum(float((-ref[i] * torch.tensor(weights_[i])).sum()) for i in range(2))
    assert out.metrics == {"loss:sum": pytest.approx(expected, abs=1e-4)}


# sampler logprobs q = lp - delta, so the ratio r = exp(lp - q) = exp(delta) whatever the model says
DELTA = [[0.5, -0.5, 0.0, 0.1, -0.1], [0.5, -0.5, 0.3]]
ADV = [[1.0, -1.0, 2.0, 0.0, -2.0], [-1.0, 1.0, 0.5]]
R = [[math.exp(d) for d in row] for row in DELTA]  # 1.6487, 0.6065, 1, 1.1052, 0.9048 | 1.6487, 0.6065, 1.3499


def sampler_datums(tiny_dir) -> list:
    ref = reference_logprobs(tiny_dir)
    return datums(logprobs=[(ref[i] - torch.tensor(DELTA[i])).tolist() for i in range(2)], advantages=ADV)


def test_importance_sampling_is_minus_ratio_times_advantage(trainer, tiny_dir):
    out = trainer.forward_backward(A, sampler_datums(tiny_dir), "importance_sampling")
    # -r A: -1.6487, 0.6065, -2, 0, 1.8097 | 1.6487, -0.6065, -0.6750
    hand = [[-1.6487213, 0.6065307, -2.0, 0.0, 1.8096748], [1.6487213, -0.6065307, -0.6749294]]
    for i in range(2):
        torch.testing.assert_close(out.elementwise_loss[i], torch.tensor(hand[i]), atol=1e-4, rtol=0)
    assert out.metrics["loss:sum"] == pytest.approx(sum(map(sum, hand)), abs=1e-4)


def test_ppo_clips_the_ratio_on_the_side_the_advantage_favours(trainer, tiny_dir):
    out = trainer.forward_backward(A, sampler_datums(tiny_dir), "ppo")
    # -min(r A, clip(r, 0.8, 1.2) A): r=1.65,A=1 -> 1.2 clips; r=0.61,A=-1 -> min(-0.61,-0.8)=-0.8;
    # r=1,A=2 -> 2; A=0 -> 0; r=0.905,A=-2 -> -1.81 (inside) | r=1.65,A=-1 -> -1.65 (unclipped side);
    # r=0.61,A=1 -> min(0.61, 0.8)=0.61; r=1.35,A=0.5 -> min(0.675, 0.6)=0.6
    hand = [[-1.2, 0.8, -2.0, 0.0, 1.8096748], [1.6487213, -0.6065307, -0.6]]
    for i in range(2):
        torch.testing.assert_close(out.elementwise_loss[i], torch.tensor(hand[i]), atol=1e-4, rtol=0)
    narrow = trainer.forward_backward(
        A, sampler_datums(tiny_dir), "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, forward_only=True
    )
    # first datum's first three: min(1.65, 1.1) -> -1.1; min(-0.61, -0.9) -> 0.9; r=1 -> -2
    torch.testing.assert_close(narrow.elementwise_loss[0][:3], torch.tensor([-1.1, 0.9, -2.0]), atol=1e-4, rtol=0)


def grads_of(trainer, loss_fn, data, config=None) -> list[torch.Tensor]:
    """The gradients one forward_backward adds, from zero (then zeroed again)."""
    trainer.forward_backward(A, data, loss_fn, config)
    out = grads(trainer, A)
    trainer.models[A].adapter.peft.zero_grad(set_to_none=True)
    return out


def test_cispo_and_dro_are_tinkers_formulas_values_and_gradients(trainer, tiny_dir):
    """cispo: -sg(clip(r, 0, 4)) lp A; dro: -(lp A - beta/2 (lp - q)^2). Their gradients equal cross_entropy's
    with per-token weights clip(r) A and A - beta (lp - q): the clipped ratio carries no gradient of its own."""
    trainer.forward_backward(A, ce_datums(), "cross_entropy")
    trainer.optim_step(A, learning_rate=1e-2)  # B != 0: every adapter matrix gets a gradient
    data = sampler_datums(tiny_dir)
    lp = logprobs(trainer, A)  # the same tokens and targets as ``data``
    q = [d[1]["logprobs"] for d in data]
    adv = [d[1]["advantages"] for d in data]
    ratio = [torch.exp(lp[i] - q[i]).clamp(0.0, 4.0) for i in range(2)]
    cispo = trainer.forward_backward(A, data, "cispo", forward_only=True)
    for i in range(2):
        torch.testing.assert_close(cispo.elementwise_loss[i], -ratio[i] * lp[i] * adv[i], atol=1e-5, rtol=0)
    dro = trainer.forward_backward(A, data, "dro", {"beta": 0.5}, forward_only=True)
    for i in range(2):
        hand = -(lp[i] * adv[i] - 0.25 * (lp[i] - q[i]) ** 2)
        torch.testing.assert_close(dro.elementwise_loss[i], hand, atol=1e-5, rtol=0)

    def as_ce(weights):
        return [(tokens, {"target_tokens": x["target_tokens"], "weights": w}) for (tokens, x), w in zip(data, weights)]

    pairs = [
        (
            grads_of(trainer, "cispo", data),
            grads_of(trainer, "cross_entropy", as_ce([r * a for r, a in zip(ratio, adv)])),
        ),
        (
            grads_of(trainer, "dro", data, {"beta": 0.5}),
            grads_of(trainer, "cross_entropy", as_ce([a - 0.5 * (p - x) for a, p, x in zip(adv, lp, q)])),
        ),
    ]
    for ours, reference in pairs:
        for g, h in zip(ours, reference):
            torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-4)
    narrow = trainer.forward_backward(A, data, "cispo", {"clip_high_threshold": 1.1}, forward_only=True)
    torch.testing.assert_close(narrow.elementwise_loss[0][0], -1.1 * lp[0][0] * adv[0][0], atol=1e-5, rtol=0)


def test_unpublished_losses_and_a_missing_beta_are_refused_by_name(trainer, tiny_dir):
    for loss_fn, match in (("stable_reinforce", "stability records"), ("gspo", "clipping defaults")):
        with pytest.raises(TinkerUserError, match=f"loss_fn: {loss_fn} is not served .*importance_sampling"):
            trainer.forward_backward(A, sampler_datums(tiny_dir), loss_fn)
        with pytest.raises(TinkerUserError, match=match):
            trainer.forward_backward(A, sampler_datums(tiny_dir), loss_fn)
    with pytest.raises(TinkerUserError, match="loss_fn_config.beta: dro needs it"):
        trainer.forward_backward(A, sampler_datums(tiny_dir), "dro")
    with pytest.raises(TinkerUserError, match="loss_fn: unsupported"):
        trainer.forward_backward(A, sampler_datums(tiny_dir), ["ppo"])


def test_gradients_add_up_over_calls_until_optim_step(trainer):
    trainer.forward_backward(A, ce_datums(), "cross_entropy")
    trainer.optim_step(A, learning_rate=1e-2)  # B != 0 from here: every adapter matrix gets a gradient
    one, two = ce_datums()
    first = trainer.forward_backward(A, [one], "cross_entropy")
    alone = grads(trainer, A)
    second = trainer.forward_backward(A, [two], "cross_entropy")
    summed = grads(trainer, A)
    before = weights(trainer, A)
    trainer.optim_step(A, learning_rate=0.0)  # zeroes the gradients, moves nothing
    assert all(p.grad is None for p in trainer.models[A].adapter.parameters())
    both = trainer.forward_backward(A, [one, two], "cross_entropy")
    together = grads(trainer, A)
    assert all(torch.equal(before[k], v) for k, v in weights(trainer, A).items())
    assert any(not torch.allclose(a, s) for a, s in zip(alone, summed)), "the second call added to the first"
    for s, t in zip(summed, together):
        torch.testing.assert_close(s, t, atol=1e-5, rtol=1e-4)
    assert both.metrics["loss:sum"] == pytest.approx(first.metrics["loss:sum"] + second.metrics["loss:sum"], abs=1e-4)


def test_forward_only_builds_no_gradient(trainer):
    trainer.forward_backward(A, ce_datums(), "cross_entropy", forward_only=True)
    assert all(p.grad is None for p in trainer.models[A].adapter.parameters())


def test_lr_zero_moves_nothing_and_steps_lower_the_cross_entropy(trainer):
    start = weights(trainer, A)
    trainer.forward_backward(A, ce_datums(), "cross_entropy")
    metrics = trainer.optim_step(A, learning_rate=0.0, weight_decay=0.1, grad_clip_norm=1.0)
    assert metrics["grad_norm:mean"] > 0 and all(":" in k for k in metrics)
    assert all(torch.equal(start[k], v) for k, v in weights(trainer, A).items())
    losses = []
    for _ in range(6):
        losses.append(trainer.forward_backward(A, ce_datums(), "cross_entropy").metrics["loss:sum"])
        trainer.optim_step(A, learning_rate=2e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01)
    assert losses[-1] < 0.9 * losses[0], losses


def test_two_adapters_on_one_base_train_independently(trainer, tiny_dir):
    trainer.create_model(B, str(tiny_dir), rank=8, seed=2, train_unembed=False)
    assert len(trainer.bases) == 1 and trainer.models[A].adapter.base is trainer.models[B].adapter.base
    b_before, a_before = logprobs(trainer, B), logprobs(trainer, A)
    for _ in range(3):
        trainer.forward_backward(A, ce_datums(), "cross_entropy")
        trainer.optim_step(A, learning_rate=2e-2)
    assert all(torch.equal(x, y) for x, y in zip(b_before, logprobs(trainer, B))), "B did not move"
    assert not all(torch.allclose(x, y) for x, y in zip(a_before, logprobs(trainer, A))), "A moved"
    assert all(p.grad is None for p in trainer.models[B].adapter.parameters())


def test_a_dropped_model_frees_its_adapter_and_the_others_go_on(trainer, tiny_dir):
    trainer.create_model(B, str(tiny_dir), rank=4, seed=2)
    peft = trainer.models[A].adapter.peft
    b_before = logprobs(trainer, B)
    logprobs(trainer, A)
    trainer.drop_model(A)  # the active adapter (its forward ran last)
    assert list(peft.peft_config) == [trainer.models[B].adapter.name]
    assert all(torch.equal(x, y) for x, y in zip(b_before, logprobs(trainer, B)))
    with pytest.raises(TinkerUserError, match="model_id: unknown"):
        logprobs(trainer, A)
    trainer.drop_model(B)  # the last one: the base goes too
    assert trainer.bases == {}
    trainer.create_model(A, str(tiny_dir), rank=4, seed=1)
    trainer.forward_backward(A, ce_datums(), "cross_entropy")
    trainer.optim_step(A, learning_rate=1e-2)


def test_save_and_load_give_the_same_model_and_optimizer(trainer, tmp_path):
    for _ in range(2):
        trainer.forward_backward(A, ce_datums(), "cross_entropy")
        trainer.optim_step(A, learning_rate=1e-2)
    trainer.save_state(A, tmp_path / "ckpt")
    trainer.save_state(A, tmp_path / "sampler", optimizer=False)
    trainer.load_state(tmp_path / "ckpt", B, with_optimizer=True)
    assert all(torch.equal(x, y) for x, y in zip(logprobs(trainer, A), logprobs(trainer, B)))
    for model_id in (A, B):  # the same step from the same Adam state: the same weights again
        trainer.forward_backward(model_id, ce_datums(), "cross_entropy")
        trainer.optim_step(model_id, learning_rate=1e-2)
    for x, y in zip(logprobs(trainer, A), logprobs(trainer, B)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert trainer.load_state(tmp_path / "sampler", "s:train:2", with_optimizer=False).spec.rank == 4
    with pytest.raises(TinkerUserError, match="without optimizer state"):
        trainer.load_state(tmp_path / "sampler", "s:train:3", with_optimizer=True)
    with pytest.raises(TinkerUserError, match="not a Tinker checkpoint"):
        trainer.load_state(tmp_path, "s:train:4", with_optimizer=False)


def sample_on_engine(trainer, tiny_dir, prompt, **params):
    """Serve A's snapshot on an HFEngine as ``sampler-1`` and sample from it (and the snapshot)."""
    snapshot = trainer.sampler_snapshot(A)

    async def run():
        engine = HFEngine(load_model(tiny_dir))
        try:
            await engine.set_lora_adapter("sampler-1", snapshot.tensors, snapshot.config)
            return await trainer.sample(engine, "sampler-1", snapshot, prompt, SampleParams(**params), 1, True)
        finally:
            engine.close()

    return asyncio.run(run()), snapshot


def test_a_snapshot_served_by_the_engine_samples_the_trainers_logprobs(trainer, tiny_dir):
    for _ in range(3):  # the adapter (head included) away from zero
        trainer.forward_backward(A, ce_datums(), "cross_entropy")
        trainer.optim_step(A, learning_rate=2e-2)
    prompt = [5, 6, 7]
    out, snapshot = sample_on_engine(trainer, tiny_dir, prompt, max_tokens=6, temperature=0.0)
    assert all("lora_" in k for k in snapshot.tensors), "LoRA matrices alone, though the head is adapted"
    assert any(".lm_head.lora_B" in k for k in snapshot.tensors)
    (seq,) = out.sequences
    assert len(seq.tokens) == 6 and seq.stop_reason == "length"
    full = prompt + seq.tokens
    ours = trainer.forward_backward(
        A,
        [(full[:-1], {"target_tokens": torch.tensor(full[1:]), "weights": torch.ones(len(full) - 1)})],
        "cross_entropy",
    ).logprobs[0]
    torch.testing.assert_close(torch.tensor(seq.logprobs), ours[len(prompt) - 1 :], atol=1e-4, rtol=0)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), ours[: len(prompt) - 1], atol=1e-5, rtol=0)
    trainer.optim_step(A, learning_rate=2e-2)  # the model moves on; the sampler's snapshot does not
    assert trainer.prompt_logprobs(snapshot, full) == pytest.approx([None, *ours.tolist()], abs=1e-5)


def test_served_adapters_load_once_and_never_let_a_running_one_go(trainer, tiny_dir):
    """Concurrent first samples of a sampler load its adapter once (they raced into loading it again, and the
    evictions then unloaded a name twice); past the limit the oldest idle adapter goes, a running one stays."""
    snapshot = trainer.sampler_snapshot(A)
    params = SampleParams(max_tokens=3, temperature=1.0, stop=[])  # not even EOS: three tokens each

    async def one(adapters, name, engine):
        async with adapters.use(name, snapshot) as served:
            return await trainer.sample(engine, served, snapshot, [5, 6, 7], params, 1)

    async def run():
        engine = HFEngine(load_model(tiny_dir))
        adapters = ServedAdapters(engine, limit=2)
        try:
            outs = await asyncio.gather(*(one(adapters, "s0", engine) for _ in range(8)))
            assert all(len(o.sequences[0].tokens) == 3 for o in outs) and engine.lora_adapters() == ["s0"]
            async with adapters.use("s1", snapshot):  # s1 runs while s2 and s3 come
                await one(adapters, "s2", engine)
                assert adapters.names() == ["s1", "s2"], "s0 was idle: it went"
                await one(adapters, "s3", engine)
                assert adapters.names() == ["s1", "s3"], "s1 is running: the idle s2 went instead"
            async with adapters.use("s4", snapshot), adapters.use("s5", snapshot):
                assert adapters.names() == ["s4", "s5"]
                async with adapters.use("s6", snapshot):  # both others running: the cap gives
                    assert adapters.names() == ["s4", "s5", "s6"]
            async with adapters.use("base", Snapshot(str(tiny_dir))) as bare:
                assert bare is None
            await adapters.drop("s5")
            await adapters.drop("s5")  # not loaded: nothing
            assert engine.lora_adapters() == sorted(adapters.names()) == ["s4", "s6"]
        finally:
            engine.close()

    asyncio.run(run())


def test_sampling_stops_at_token_ids_and_strings(trainer, tiny_dir):
    prompt = [5, 6, 7]
    (seq,) = sample_on_engine(trainer, tiny_dir, prompt, max_tokens=6, temperature=0.0)[0].sequences
    stop_at = seq.tokens[2]
    cut = seq.tokens.index(stop_at) + 1
    (by_id,) = sample_on_engine(trainer, tiny_dir, prompt, max_tokens=6, temperature=0.0, stop=[stop_at])[0].sequences
    assert (by_id.tokens, by_id.stop_reason) == (seq.tokens[:cut], "stop")
    assert by_id.logprobs == pytest.approx(seq.logprobs[:cut], abs=1e-6)
    text = trainer_decode(tiny_dir, seq.tokens[:cut])
    (by_str,) = sample_on_engine(trainer, tiny_dir, prompt, max_tokens=6, temperature=0.0, stop=text[-1])[0].sequences
    assert by_str.stop_reason == "stop" and text[-1] in trainer_decode(tiny_dir, by_str.tokens)
    assert text[-1] not in trainer_decode(tiny_dir, by_str.tokens[:-1]), "cut right after the stop string"


def trainer_decode(tiny_dir, tokens):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir)).decode(tokens)


def bad(datum: int, key: str, value) -> list:
    d = ce_datums()
    d[datum][1][key] = value
    return d


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (
            lambda t: t.forward_backward(A, bad(1, "weights", torch.ones(4)), "cross_entropy"),
            "data[1].loss_fn_inputs.weights",
        ),
        (lambda t: t.forward_backward(A, [([5, 999], ce_datums()[0][1])], "cross_entropy"), "data[0].model_input"),
        (
            lambda t: t.forward_backward(A, bad(0, "target_tokens", torch.tensor([1, 2, 3, 4, 101])), "cross_entropy"),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            lambda t: t.forward_backward(A, bad(0, "target_tokens", torch.zeros(5)), "cross_entropy"),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (lambda t: t.forward_backward(A, ce_datums(), "cross_entropyy"), "loss_fn"),
        (lambda t: t.forward_backward(A, ce_datums(), "importance_sampling"), "data[0].loss_fn_inputs.logprobs"),
        (lambda t: t.forward_backward(A, ce_datums(), "ppo", {"clip_ratio": 0.2}), "loss_fn_config.clip_ratio"),
        (
            lambda t: t.forward_backward(A, bad(0, "weights", torch.full((5,), math.nan)), "cross_entropy"),
            "data[0].loss_fn_inputs.weights",
        ),
        (lambda t: t.forward_backward("s:train:7", ce_datums(), "cross_entropy"), "model_id"),
        (lambda t: t.forward_backward(A, [], "cross_entropy"), "data"),
        (lambda t: t.optim_step(A, beta1=1.0), "adam_params.beta1"),
        (lambda t: t.optim_step(A, learning_rate=-1.0), "adam_params.learning_rate"),
        (lambda t: t.create_model(B, t.models[A].spec.base_dir, rank=0), "lora_config.rank"),
        (lambda t: t.create_model(B, t.models[A].spec.base_dir, 4, None, False, False, False), "lora_config"),
        (lambda t: t.create_model(A, t.models[A].spec.base_dir, rank=4), "model_id"),
        (lambda t: SampleParams(max_tokens=0), "sampling_params.max_tokens"),
        (lambda t: SampleParams(max_tokens=4, stop=[1, "x"]), "sampling_params.stop"),
    ],
)
def test_client_mistakes_name_their_field(trainer, call, field):
    with pytest.raises(TinkerUserError) as err:
        call(trainer)
    assert str(err.value).startswith(field), err.value


def test_a_failed_request_leaves_the_gradients_as_they_were(trainer, tiny_dir):
    trainer.forward_backward(A, ce_datums(), "cross_entropy")
    before = grads(trainer, A)
    trainer.micro_batch_tokens = 5  # one datum per micro-batch: the first goes backward before the second fails
    ref = reference_logprobs(tiny_dir)
    huge = datums(logprobs=[ref[0].tolist(), [-1e30] * 3], advantages=ADV)  # exp(lp - q) overflows
    with pytest.raises(TinkerUserError, match="NaN or infinite"):
        trainer.forward_backward(A, huge, "importance_sampling")
    assert all(torch.equal(x, y) for x, y in zip(before, grads(trainer, A)))
