"""Pruning old checkpoints survives a kill in the middle: it never leaves a half-deleted step_N behind."""

from areal_agents.trainers.checkpoint import checkpoints, prune_checkpoints


def make(root, name, complete=True):
    d = root / "checkpoints" / name
    (d / "model").mkdir(parents=True)
    (d / "model" / "model.safetensors").write_bytes(b"x")
    if complete:
        (d / "trainer_state.pt").write_bytes(b"x")
    return d


def test_prune_keeps_the_newest_and_clears_what_a_killed_prune_left(tmp_path):
    for step in (1, 2, 3, 4):
        make(tmp_path, f"step_{step}")
    make(tmp_path, "step_0.tmp", complete=False)  # a prune (or a save) killed halfway, earlier
    make(tmp_path, "step_1.tmp", complete=False)  # in the way of step_1's rename
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_4"]
    assert [p.name for p in checkpoints(tmp_path)] == ["step_3", "step_4"]
    prune_checkpoints(tmp_path, 0)  # 0 keeps all
    assert [p.name for p in checkpoints(tmp_path)] == ["step_3", "step_4"]
