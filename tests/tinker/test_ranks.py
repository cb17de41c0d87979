"""serve-tinker's trainer on two FSDP2 ranks (gloo, two processes): the same logprobs, losses, gradient norms
and adapters as the single-process `TinkerTrainer` on the same requests (uneven shares: a rank runs a padding
micro-batch), a non-finite loss on one rank's share failing the request on every rank with the gradients as
they were, and training models added, saved, loaded and dropped on the sharded base."""

import pytest
import torch

from areal_agents.errors import TinkerUserError
from areal_agents.tinker.ranks import RankedTinkerTrainer
from areal_agents.tinker.training import TinkerTrainer

pytestmark = pytest.mark.process  # two rank processes, started once for the module (~6 s)
MICRO = 16  # tokens per micro-batch: the five datums make five micro-batches, three on one rank, two on the other
LENGTHS = (5, 9, 3, 12, 7)


@pytest.fixture(scope="module")
def ranks():
    trainer = RankedTinkerTrainer.spawn(2, "cpu", micro_batch_tokens=MICRO)
    yield trainer
    trainer.close()


def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 60, (n + 1,), generator=g).tolist() for n in LENGTHS]


def ce_datums() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (s[:-1], {"target_tokens": torch.tensor(s[1:]), "weights": torch.rand(len(s) - 1, generator=g)})
        for s in sequences()
    ]


def is_datums(behavior: float = -4.0, bad: int | None = None) -> list:
    """importance_sampling datums; datum ``bad``'s behavior logprobs are so low that its ratio overflows."""
    out = []
    for i, s in enumerate(sequences()):
        q = torch.full((len(s) - 1,), -200.0 if i == bad else behavior)
        inputs = {"target_tokens": torch.tensor(s[1:]), "logprobs": q, "advantages": torch.ones(len(s) - 1)}
        out.append((s[:-1], inputs))
    return out


def assert_same_adapter(a: TinkerTrainer | RankedTinkerTrainer, b: TinkerTrainer | RankedTinkerTrainer, model_id):
    ta, tb = a.sampler_snapshot(model_id).tensors, b.sampler_snapshot(model_id).tensors
    assert ta.keys() == tb.keys() and ta
    for key in ta:
        torch.testing.assert_close(ta[key], tb[key], atol=1e-5, rtol=1e-4)


def test_two_ranks_train_as_the_single_process(tiny_dir, ranks):
    single = TinkerTrainer(micro_batch_tokens=MICRO)
    both = (single, ranks)
    for trainer in both:
        trainer.create_model("a", str(tiny_dir), 4, seed=3)
    for _ in range(2):
        one, two = (t.forward_backward("a", ce_datums(), "cross_entropy") for t in both)
        for x, y in zip(one.logprobs + one.elementwise_loss, two.logprobs + two.elementwise_loss):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert one.metrics["loss:sum"] == pytest.approx(two.metrics["loss:sum"], rel=1e-5)
        norms = [t.optim_step("a", learning_rate=1e-2)["grad_norm:mean"] for t in both]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0
    assert_same_adapter(single, ranks, "a")
    tokens = sequences()[3]
    snapshot = ranks.sampler_snapshot("a")
    here, there = single.prompt_logprobs(snapshot, tokens), ranks.prompt_logprobs(snapshot, tokens)
    assert here[0] is None and there[0] is None
    torch.testing.assert_close(torch.tensor(here[1:]), torch.tensor(there[1:]), atol=1e-5, rtol=1e-5)


def test_a_non_finite_loss_on_one_ranks_share_fails_every_rank_and_keeps_the_gradients(tiny_dir, ranks):
    single = TinkerTrainer(micro_batch_tokens=MICRO)
    both = (single, ranks)
    for trainer in both:
        trainer.create_model("b", str(tiny_dir), 4, seed=5)
        trainer.forward_backward("b", is_datums(), "importance_sampling")  # gradients to keep
        with pytest.raises(TinkerUserError, match="NaN or infinite"):
            trainer.forward_backward("b", is_datums(bad=2), "importance_sampling")
        trainer.optim_step("b", learning_rate=1e-2)
    assert_same_adapter(single, ranks, "b")


def test_training_models_come_and_go_on_the_sharded_base(tiny_dir, ranks, tmp_path):
    ranks.create_model("c", str(tiny_dir), 2, train_mlp=False, train_unembed=False)  # attention alone
    ranks.create_model("d", str(tiny_dir), 8, seed=1)
    ranks.forward_backward("c", ce_datums(), "cross_entropy")
    ranks.optim_step("c", learning_rate=1e-2)
    ranks.save_state("c", tmp_path / "c")
    assert {p.name for p in (tmp_path / "c").iterdir()} >= {"adapter_config.json", "optimizer.pt"}

    single = TinkerTrainer(micro_batch_tokens=MICRO)
    single.load_state(tmp_path / "c", "c", with_optimizer=True)  # a rank's checkpoint, in the single process
    assert_same_adapter(single, ranks, "c")
    assert all("mlp" not in key for key in ranks.sampler_snapshot("c").tensors)

    ranks.load_state(tmp_path / "c", "e", with_optimizer=True)
    assert ranks.sampler_snapshot("e").tensors.keys() == ranks.sampler_snapshot("c").tensors.keys()
    ranks.drop_model("c")
    assert "c" not in ranks.models and {"d", "e"} <= set(ranks.models)
    with pytest.raises(TinkerUserError, match="unknown 'c'"):
        ranks.forward_backward("c", ce_datums(), "cross_entropy")
    out = ranks.forward_backward("d", ce_datums(), "cross_entropy", forward_only=True)
    assert len(out.logprobs) == len(LENGTHS)
