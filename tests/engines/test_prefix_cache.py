import torch

from areal_agents.engines.hf.prefix_cache import PrefixCache


def block(rows, width, heads=2, dim=3, layers=2, start=0.0):
    """Rows whose cached keys are numbered, right-aligned in ``width`` columns (left padding)."""
    keys, mask = [], torch.zeros(len(rows), width, dtype=torch.long)
    for i, tokens in enumerate(rows):
        mask[i, width - len(tokens) :] = 1
    for layer in range(layers):
        keys.append(
            start
            + layer
            + torch.arange(len(rows) * heads * width * dim, dtype=torch.float).view(len(rows), heads, width, dim)
        )
    return keys, [k + 0.5 for k in keys], mask


def test_find_returns_the_longest_proper_prefix():
    cache = PrefixCache(max_tokens=20)
    keys, values, mask = block([(1, 2), (1, 2, 3, 4)], width=5)
    cache.add(keys, values, mask, [(1, 2), (1, 2, 3, 4)])
    assert cache.find((1, 2, 3, 4, 5)).length == 4
    assert cache.find((1, 2, 3, 9)).length == 2
    assert cache.find((1, 2, 3, 4)).length == 2  # a context equal to a stored row still needs one token run
    assert cache.find((7, 1, 2)) is None


def test_gather_right_aligns_rows_from_several_blocks_and_skips_misses():
    cache = PrefixCache(max_tokens=20)
    a = block([(1, 2, 3)], width=4)  # one leading padding column: trimmed when stored
    b = block([(5,), (6, 7)], width=2, start=100.0)
    cache.add(*a, [(1, 2, 3)])
    cache.add(*b, [(5,), (6, 7)])
    hits = [cache.find((6, 7, 8)), None, cache.find((1, 2, 3, 4))]
    keys, values, mask = cache.gather(hits)
    assert mask.tolist() == [[0, 1, 1], [0, 0, 0], [1, 1, 1]]
    for layer in range(2):
        assert torch.equal(keys[layer][0, :, 1:], b[0][layer][1])
        assert torch.equal(keys[layer][2], a[0][layer][0, :, 1:])
        assert torch.equal(values[layer][2], a[1][layer][0, :, 1:])
        assert not keys[layer][1].any()


def test_oldest_blocks_are_evicted_past_max_tokens_and_clear_empties():
    cache = PrefixCache(max_tokens=5)
    cache.add(*block([(1,), (2,)], 1), [(1,), (2,)])
    cache.add(*block([(3,), (4, 5)], 2), [(3,), (4, 5)])  # 4 columns with the padding: the first block goes
    assert len(cache) == 4 and cache.find((1, 9)) is None and cache.find((3, 9)).length == 1
    cache.add(*block([(6,) * 6], 6), [(6,) * 6])  # larger than the whole cache: not stored
    assert len(cache) == 4 and cache.find((6,) * 7) is None
    cache.clear()
    assert len(cache) == 0 and cache.find((3, 9)) is None
    disabled = PrefixCache(max_tokens=0)
    disabled.add(*block([(1,)], 1), [(1,)])
    assert len(disabled) == 0


def test_entries_are_keyed_by_adapter_and_dropped_with_it():
    cache = PrefixCache(max_tokens=20)
    cache.add(*block([(1, 2)], 2), [(1, 2)], adapter="a1")
    cache.add(*block([(1, 2, 3)], 3), [(1, 2, 3)])  # the base model's
    assert cache.find((1, 2, 3, 4), "a1").length == 2  # a1 finds its own row, not the base model's longer one
    assert cache.find((1, 2, 3, 4)).length == 3 and cache.find((1, 2, 9)) is None  # the base never sees a1's
    assert cache.find((1, 2, 9), "a2") is None
    cache.drop("a1")
    assert len(cache) == 3 and cache.find((1, 2, 3), "a1") is None and cache.find((1, 2, 3, 4)).length == 3
