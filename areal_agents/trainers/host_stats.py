"""A step's statistics brought from the device to the host in one transfer.

Reading a CUDA tensor on the host (``float(t)``, ``.item()``, ``.tolist()``, ``bool(t)``, boolean
indexing) waits for every kernel queued before it: one such read per statistic per micro-batch stalls
the GPU between forward and ``backward`` a dozen times. The loss functions return their statistics as
0-dim tensors instead, and the trainer reads them all at the end of its micro-batches:

    rows = [{"loss": loss.detach(), "tokens": mask.sum()} for loss, mask in steps]
    floats = to_host(rows)  # [{"loss": 0.25, "tokens": 7.0}, ...]: one host sync for all of them
"""

from __future__ import annotations

import torch

__all__ = ["to_host"]


def to_host(rows: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """Each row with its 0-dim tensors as Python floats, read in one transfer (a float value stays as it is).

    Each is what ``float(t)`` gives: the tensors are cast to float64 on their device first, exact for
    float32 and bfloat16 values and for counts below 2**53. They must all be on one device."""
    tensors = [v.detach().reshape(()).double() for row in rows for v in row.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [{k: next(values) if isinstance(v, torch.Tensor) else v for k, v in row.items()} for row in rows]
