import torch
import torch.nn.functional as F
from test_hf_engine import tiny_llama

from areal_agents.engines.hf.segmented_attention import SEGMENTED_SDPA, SegmentedKV, segmented_sdpa


class Attention(torch.nn.Module):
    num_key_value_groups = 2


def test_segments_of_different_widths_attend_as_one_padded_batch():
    """Rows in two segments (widths 5 and 9, some columns masked): the same outputs as sdpa over one cache
    in which the narrower segment is left-padded to the wider one."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(5, heads, 1, dim)
    widths, rows = (9, 5), (slice(0, 3), slice(3, 5))
    keys = [torch.randn(r.stop - r.start, kv_heads, w, dim) for r, w in zip(rows, widths)]
    values = [torch.randn_like(k) for k in keys]
    attends = [torch.rand(r.stop - r.start, w) < 0.7 for r, w in zip(rows, widths)]
    for a in attends:
        a[:, -1] = True  # the step's own column
    masks = [torch.zeros(a.shape).masked_fill(~a, float("-inf"))[:, None, None, :] for a in attends]
    out, weights = segmented_sdpa(
        Attention(), q, SegmentedKV(keys, list(rows), masks), SegmentedKV(values, list(rows), masks), None, scaling=0.3
    )

    def pad(x):
        return F.pad(x, (0, 0, 9 - x.shape[2], 0))

    k, v = torch.cat([pad(x) for x in keys]), torch.cat([pad(x) for x in values])
    mask = torch.cat([F.pad(a, (9 - a.shape[1], 0)) for a in attends])[:, None, None, :]
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    assert weights is None and out.shape == (5, 1, heads, dim)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)


def test_ordinary_tensors_are_plain_sdpa():
    """Prefill, padded batches and generate: the same outputs as a model left on stock sdpa."""
    model = tiny_llama(num_key_value_heads=2).eval()
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        greedy = model.generate(ids[1:], max_new_tokens=5, do_sample=False)
        model.set_attn_implementation(SEGMENTED_SDPA)
        out = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(greedy, model.generate(ids[1:], max_new_tokens=5, do_sample=False))
    assert torch.allclose(out[mask.bool()], ref[mask.bool()], atol=1e-6)
