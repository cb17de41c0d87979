"""Weight-group names never repeat across trainer processes (issue 50, item 3): a server keeps the groups it
joined by name, and a restarted trainer's counter starts again at 1 while the running servers still hold the
old trainer's groups."""

import itertools

from areal_agents.engines import broadcast_sync


def test_a_restarted_trainer_names_its_first_group_unlike_the_one_before(monkeypatch):
    monkeypatch.setattr(broadcast_sync, "_groups", itertools.count(1))  # a fresh trainer process
    first = broadcast_sync.group_name()
    monkeypatch.setattr(broadcast_sync, "_groups", itertools.count(1))  # ... restarted: its counter starts again
    again = broadcast_sync.group_name()
    assert first.startswith("areal_weights_1_") and again.startswith("areal_weights_1_")
    assert first != again, "a restarted trainer's first group takes the name its predecessor's servers hold"


def test_group_names_in_one_process_are_distinct_and_numbered():
    names = [broadcast_sync.group_name() for _ in range(100)]
    assert len(set(names)) == 100
    numbers = [int(name.split("_")[2]) for name in names]
    assert numbers == sorted(numbers) and len(set(numbers)) == 100
