"""The optimizer's learning-rate schedule and the activation-checkpointing switch."""

import pytest
import torch

from areal_agents.trainers.optim import lr_factor, make_optimizer


@pytest.mark.parametrize(
    "schedule, after_warmup",
    [
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [1.0, 0.8535534, 0.5, 0.1464466, 0.0]),
    ],
)
def test_lr_schedules_warm_up_then_decay_to_zero_at_the_end(schedule, after_warmup):
    got = [lr_factor(s, warmup_steps=2, schedule=schedule, total_steps=6) for s in range(7)]
    assert got[:2] == [0.5, 1.0]
    assert got[2:] == pytest.approx(after_warmup)


def test_scheduler_follows_the_factor(model):
    optimizer, scheduler = make_optimizer(model, 1.0, 0.0, 0, "linear", total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_unknown_schedule_names_the_field(model):
    with pytest.raises(ValueError, match="lr_schedule"):
        make_optimizer(model, 1.0, 0.0, 0, "step")


def test_activation_checkpointing_gives_the_same_gradients(tiny_dir):
    from areal_agents.models import load_model

    ids = torch.randint(3, 50, (2, 24))
    grads = []
    for checkpointing in (False, True):
        m = load_model(tiny_dir)
        if checkpointing:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
