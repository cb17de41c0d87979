"""Long outputs in training (`trainers/overlong.py`): the truncated fraction of real episodes, DAPO's soft
overlong punishment at its boundaries, overlong filtering in the PPO update, and a budget past the model's
context stopping a run before its first rollout."""

import asyncio
import dataclasses
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_agents.agents import ChatAgent
from areal_agents.cli import main
from areal_agents.config import PPOConfig, TrainConfig, load_config
from areal_agents.engines import HFEngine
from areal_agents.envs import LocalEnvPool
from areal_agents.errors import ConfigError
from areal_agents.models import load_model
from areal_agents.models.loading import check_max_new_tokens, model_context
from areal_agents.trainers.overlong import (
    is_truncated,
    longest_turn,
    overlong_penalties,
    overlong_penalty,
    truncated_fraction,
)
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.trainers.ppo_batch import prepare_batch
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.types import SamplingParams, Trajectory


class RecordingEngine(HFEngine):
    """The real engine, also keeping every response it returned, by request id."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.responses = {}

    async def agenerate(self, request):
        response = await super().agenerate(request)
        self.responses[request.rid] = response
        return response


def _episodes(model, tokenizer):
    """Real episodes of the tiny model on Arithmetic-v0: two end each turn on a stop token, one stops at its
    token budget, one runs out of context after a turn that ended on a stop token. With the engine's
    responses, by request id."""
    engine = RecordingEngine(model, seed=0)
    every_token = list(range(len(tokenizer)))
    stop = SamplingParams(max_new_tokens=4, stop_token_ids=every_token)  # one token, stop reason "stop"
    long = SamplingParams(max_new_tokens=3, temperature=0.0)
    prompt = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "7+8="}], add_generation_prompt=True, return_dict=False
        )
    )
    plays = [
        ("stop0", ChatAgent(engine, tokenizer, stop, max_turns=1)),
        ("stop1", ChatAgent(engine, tokenizer, stop, max_turns=1)),
        ("length", ChatAgent(engine, tokenizer, long, max_turns=1)),
        ("context", ChatAgent(engine, tokenizer, stop, max_turns=3, max_total_tokens=prompt + 8)),
    ]
    out = []
    for episode_id, agent in plays:
        env = LocalEnvPool("inline").make("areal_agents/Arithmetic-v0", digits=1, max_turns=3)
        out += asyncio.run(agent.run_episode(env, seed=3, episode_id=episode_id))
    return out, engine.responses


@pytest.fixture
def episodes(model, tokenizer):
    return _episodes(model, tokenizer)


def test_truncation_is_read_from_the_engines_stop_reasons_and_the_agents_context(episodes):
    trajs, responses = episodes
    by_id = {t.episode_id: t for t in trajs}
    assert sorted(by_id) == ["context", "length", "stop0", "stop1"] and len(trajs) == 4
    # what the engine and the agent really did: the premises of the test
    assert responses["length/t0"].stop_reason == "length" and len(responses["length/t0"].output_tokens) == 3
    assert all(r.stop_reason == "stop" for rid, r in responses.items() if not rid.startswith("length"))
    assert by_id["context"].metadata["context_exhausted"] and by_id["context"].metadata["stop_reasons"] == ["stop"]
    assert not by_id["stop0"].metadata["context_exhausted"] and not by_id["length"].metadata["context_exhausted"]
    assert [is_truncated(by_id[e]) for e in ("stop0", "stop1", "length", "context")] == [False, False, True, True]
    assert truncated_fraction(trajs) == 0.5
    assert truncated_fraction([by_id["stop0"], by_id["length"], by_id["stop1"]]) == pytest.approx(1 / 3)
    assert truncated_fraction([]) == 0.0


def test_a_turn_cut_by_max_turns_is_not_truncated(model, tokenizer):
    """Running out of turns is not running out of tokens: overlong filtering leaves such episodes in."""
    stop = SamplingParams(max_new_tokens=4, stop_token_ids=list(range(len(tokenizer))))
    agent = ChatAgent(RecordingEngine(model, seed=0), tokenizer, stop, max_turns=2)
    env = LocalEnvPool("inline").make("areal_agents/Arithmetic-v0", digits=2, max_turns=5)
    (traj,) = asyncio.run(agent.run_episode(env, seed=3, episode_id="e"))
    assert traj.metadata["truncated_by_agent"] and traj.metadata["stop_reasons"] == ["stop", "stop"]
    assert not traj.metadata["context_exhausted"] and not is_truncated(traj)


@pytest.mark.parametrize(
    "length, penalty",
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0), (101, -1.0), (10_000, -1.0)],
)
def test_soft_overlong_penalty_at_its_boundaries(length, penalty):
    """DAPO eq. 13 with Lmax = 100, a buffer of K = 20 and a factor of 1: flat to Lmax - K, a linear ramp to
    -1 at Lmax, -1 beyond; the factor scales it."""
    assert overlong_penalty(length, 100, 20, 1.0) == pytest.approx(penalty, abs=1e-12)
    assert overlong_penalty(length, 100, 20, 0.5) == pytest.approx(penalty / 2, abs=1e-12)


def test_soft_overlong_penalty_off_and_whole_budget_buffer():
    assert all(overlong_penalty(n, 100, 0, 1.0) == 0.0 for n in (0, 99, 100, 500))  # buffer 0: off
    assert overlong_penalty(0, 100, 100, 1.0) == 0.0 and overlong_penalty(50, 100, 100, 2.0) == -1.0
    with pytest.raises(ValueError, match=r"overlong_buffer: expects 0 to max_new_tokens \(100\) tokens, got 101"):
        overlong_penalty(10, 100, 101, 1.0)


def test_a_multi_turn_episode_is_measured_by_its_longest_turn(model, tokenizer):
    """L is the longest generated turn (each turn has its own budget), read off the loss mask; the segments
    of one episode share it."""
    engine = RecordingEngine(model, seed=1)
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=[tokenizer.convert_tokens_to_ids(c) for c in "05"])
    agent = ChatAgent(engine, tokenizer, sampling, max_turns=4)
    env = LocalEnvPool("inline").make("areal_agents/Arithmetic-v0", digits=2, max_turns=4)
    (traj,) = asyncio.run(agent.run_episode(env, seed=0, episode_id="e"))
    lengths = [len(r.output_tokens) for r in engine.responses.values()]
    assert len(lengths) > 1 and len(set(lengths)) > 1  # turns of different lengths
    assert longest_turn(traj) == max(lengths) < sum(lengths)
    # a second segment of the same episode (as when a template rewrites history) shares the episode's L
    short = dataclasses.replace(traj, input_ids=[5, 6, 7], loss_mask=[0, 1, 0], logprobs=[0.0] * 3, versions=[0] * 3)
    other = dataclasses.replace(short, episode_id="other")
    rival = dataclasses.replace(short, agent_id="rival")  # another agent of the same episode: its own turns
    budget = max(lengths)  # the longest turn sits exactly at Lmax: the full penalty
    assert overlong_penalties([traj, short, other, rival], budget, 2, 1.0) == [-1.0, -1.0, 0.0, 0.0]


def _grouped(trajs, rewards):
    return [dataclasses.replace(t, reward=r, group_id="g") for t, r in zip(trajs, rewards)]


def test_filtering_trains_no_loss_on_truncated_trajectories_and_keeps_them_in_the_baseline(episodes, model):
    trajs = _grouped(episodes[0], [0.0, 1.0, 0.25, 0.5])  # stop0, stop1, length, context
    kept = prepare_batch(model, trajs, PPOConfig(), temperature=1.0, pad_token_id=0)
    cfg = PPOConfig(overlong_filtering=True)
    filtered = prepare_batch(model, trajs, cfg, temperature=1.0, pad_token_id=0)
    assert [t.episode_id for t in kept.trajectories] == ["stop0", "stop1", "length", "context"]
    assert [t.episode_id for t in filtered.trajectories] == ["stop0", "stop1"]
    # the group's mean and std still count the truncated two: the others' advantages do not move
    for a, b in zip(filtered.advantages, kept.advantages[:2]):
        assert torch.equal(a, b) and a.abs().sum() > 0
    assert filtered.counts["overlong_filtered"] == 2.0 and "overlong_filtered" not in kept.counts
    assert filtered.counts["loss_tokens"] == sum(t.num_generated for t in trajs[:2])


def test_filtering_is_the_update_of_a_zeroed_loss_mask(episodes, tiny_dir):
    """Leaving truncated trajectories out after advantages takes the step that zeroing their loss mask
    would (DAPO masks their loss), and a different one from training on them."""
    trajs = _grouped(episodes[0], [0.0, 1.0, 0.25, 0.5])

    def step(batch, cfg):
        model = load_model(tiny_dir)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stats = ppo_update(model, optimizer, scheduler, batch, cfg, temperature=1.0, pad_token_id=0)
        return [p.detach() for p in model.parameters()], stats

    def masked(t):
        if not is_truncated(t):
            return t
        return dataclasses.replace(t, loss_mask=[0] * len(t), logprobs=[0.0] * len(t), versions=[-1] * len(t))

    filtered, stats = step(trajs, PPOConfig(overlong_filtering=True, max_grad_norm=1e9))
    zeroed, _ = step([masked(t) for t in trajs], PPOConfig(max_grad_norm=1e9))
    trained_on, _ = step(trajs, PPOConfig(max_grad_norm=1e9))
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(filtered, zeroed))
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(filtered, trained_on))
    assert stats["overlong_filtered_trajectories"] == 2.0 and stats["trained_trajectories"] == 2.0


def test_the_soft_penalty_is_shaped_with_the_rewards_before_advantages(episodes, model):
    """Equal env rewards, different lengths: the penalty alone gives the group its variance; it is added
    before reward_bias and reward_scale, and a streamed update applies it as the whole batch does."""
    trajs = _grouped(episodes[0], [1.0] * 4)  # stop0, stop1: 1 token; length: 3 tokens; context: 1 token
    assert [longest_turn(t) for t in trajs] == [1, 1, 3, 1]
    flat = prepare_batch(model, trajs, PPOConfig(), temperature=1.0, pad_token_id=0)
    assert flat.trajectories == []  # all rewards equal: a zero-variance group
    cfg = PPOConfig(overlong_buffer=2, overlong_penalty=0.5, advantage="dr_grpo", reward_scale=2.0, reward_bias=1.0)
    shaped = prepare_batch(model, trajs, cfg, temperature=1.0, pad_token_id=0, max_new_tokens=3)
    # penalties: L = 3 at Lmax = 3 gives -0.5; L = 1 = Lmax - K gives 0. Shaped: (r + p + 1) * 2
    rewards = [4.0, 4.0, 3.0, 4.0]
    mean = sum(rewards) / 4
    for adv, r, t in zip(shaped.advantages, rewards, trajs):
        assert torch.allclose(adv, torch.tensor(t.loss_mask, dtype=torch.float) * (r - mean))
    assert shaped.counts["overlong_penalty_sum"] == -0.5 and shaped.counts["overlong_scored"] == 4.0
    with pytest.raises(ValueError, match=r"ppo.overlong_buffer: .* needs max_new_tokens"):
        prepare_batch(model, trajs, cfg, temperature=1.0, pad_token_id=0)


def test_a_streamed_update_applies_overlong_shaping_as_the_whole_batch(episodes, tiny_dir):
    cfg = PPOConfig(overlong_buffer=2, overlong_filtering=True, max_grad_norm=1e9)
    first = _grouped(episodes[0], [1.0, 0.0, 1.0, 0.0])
    second = [dataclasses.replace(t, group_id="h", episode_id=f"h/{t.episode_id}") for t in first[::-1]]
    whole, parts = load_model(tiny_dir), load_model(tiny_dir)
    sgd = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (whole, parts)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for o in sgd]
    kw = dict(temperature=1.0, pad_token_id=0, max_new_tokens=3)
    whole_stats = ppo_update(whole, sgd[0], schedules[0], first + second, cfg, **kw)
    update = StreamedUpdate(parts, sgd[1], schedules[1], cfg, **kw)
    update.add(first)
    update.add(second)
    parts_stats = update.finish()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(whole.parameters(), parts.parameters()))
    for key in ("overlong_penalty_mean", "overlong_filtered_trajectories", "trained_trajectories", "loss"):
        assert parts_stats[key] == pytest.approx(whole_stats[key], rel=1e-5), key
    assert whole_stats["overlong_filtered_trajectories"] == 4.0 and whole_stats["overlong_penalty_mean"] == -0.25


def test_config_validates_the_overlong_fields():
    cfg = load_config(TrainConfig, None, [])
    assert not cfg.ppo.overlong_filtering and cfg.ppo.overlong_buffer == 0  # both off by default
    with pytest.raises(ConfigError, match=r"config key ppo.overlong_buffer: expects a value >= 0, got -1"):
        load_config(TrainConfig, None, ["ppo.overlong_buffer=-1"])
    with pytest.raises(ConfigError, match=r"config key ppo.overlong_penalty: expects a value >= 0, got -0.5"):
        load_config(TrainConfig, None, ["ppo.overlong_penalty=-0.5"])
    with pytest.raises(ConfigError, match=r"ppo.overlong_buffer: expects at most rollout.max_new_tokens \(8\), got 9"):
        load_config(TrainConfig, None, ["rollout.max_new_tokens=8", "ppo.overlong_buffer=9"])
    assert (
        load_config(TrainConfig, None, ["rollout.max_new_tokens=8", "ppo.overlong_buffer=8"]).ppo.overlong_buffer == 8
    )


def test_a_budget_past_the_models_context_stops_train_sft_and_eval_before_they_start(tmp_path, tiny_dir, capsys):
    assert model_context(tiny_dir) == 512  # the tiny model's max_position_embeddings
    check_max_new_tokens(512, tiny_dir, "rollout.max_new_tokens")  # up to the context: allowed
    config = tmp_path / "rl.yaml"
    config.write_text(f"run_dir: {tmp_path / 'rl'}\nmodel: {{path: {tiny_dir}}}\nrollout: {{max_new_tokens: 513}}\n")
    assert main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        f"rollout.max_new_tokens: 513 tokens is more than the model's context, 512 positions "
        f"(max_position_embeddings in {tiny_dir / 'config.json'}); set rollout.max_new_tokens to at most 512"
    ) in err
    assert not (tmp_path / "rl").exists()  # stopped before the run directory, let alone a rollout
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}) + "\n"
    )
    config.write_text(f"run_dir: {tmp_path / 'sft'}\nmodel: {{path: {tiny_dir}}}\ndata: {data}\nmax_new_tokens: 600\n")
    assert main(["sft", str(config), "--no-progress"]) == 2
    assert "max_new_tokens: 600 tokens is more than the model's context, 512 positions" in capsys.readouterr().err
    assert not (tmp_path / "sft").exists()
    out = tmp_path / "eval"
    assert (
        main(["eval", "--dataset", "aime24", "--model", str(tiny_dir), "--max-new-tokens", "1000", "--out", str(out)])
        == 2
    )
    assert "max_new_tokens (--max-new-tokens): 1000 tokens is more than the model's context" in capsys.readouterr().err
    assert not out.exists()


STOPS_ON_DIGITS = """
from dataclasses import replace

from areal_agents.agents import ChatAgent


class StopsOnDigits(ChatAgent):
    \"\"\"A ChatAgent whose turns also end on a digit: some stop on their own, some at max_new_tokens.\"\"\"

    def __init__(self, engine, tokenizer, sampling, **kwargs):
        digits = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
        super().__init__(engine, tokenizer, replace(sampling, stop_token_ids=digits), **kwargs)
"""


def test_a_training_run_logs_the_truncated_fraction_of_its_trajectories(tmp_path, tiny_dir, monkeypatch):
    """Each step's rollout/truncated_fraction and the update's overlong stats are those of the trajectories
    it trained on (dumped), and the summary's is the run's."""
    (tmp_path / "stops_on_digits.py").write_text(STOPS_ON_DIGITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "rl"
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run}", f"model.path={tiny_dir}", "steps=2", "eval.num_problems=1",
            "eval.env_kwargs={split: test}", "env.kwargs={digits: 1, max_turns: 1}", "rollout.batch_size=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.agent=stops_on_digits:StopsOnDigits",
            "rollout.dump_trajectories=true", "ppo.filter_zero_variance_groups=false", "ppo.overlong_filtering=true",
            "ppo.overlong_buffer=3", "ppo.overlong_penalty=0.5",
        ],
    )  # fmt: skip
    summary = run_train(cfg, progress=False)
    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    total, truncated, mixed = 0, 0, False
    for step in (1, 2):
        rows = (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()
        trajs = [Trajectory(**json.loads(row)) for row in rows]
        flags = [is_truncated(t) for t in trajs]
        total, truncated, mixed = total + len(trajs), truncated + sum(flags), mixed or 0 < sum(flags) < len(trajs)

        def logged(key, step=step):
            return next(e.value for e in scalars.Scalars(key) if e.step == step)

        assert logged("rollout/truncated_fraction") == pytest.approx(sum(flags) / len(trajs))
        assert logged("train/overlong_filtered_trajectories") == sum(flags)
        assert logged("train/trained_trajectories") == len(trajs) - sum(flags)
        penalties = overlong_penalties(trajs, 6, 3, 0.5)
        assert logged("train/overlong_penalty_mean") == pytest.approx(sum(penalties) / len(trajs), abs=1e-6)
    assert mixed  # some trajectories truncated and some not: the checks above tell them apart
    assert summary["truncated_fraction"] == pytest.approx(truncated / total)
    assert json.loads((run / "summary.json").read_text())["truncated_fraction"] == summary["truncated_fraction"]
