"""Host values to the device without a host wait: one pinned copy per step, queued on the stream.

`copy_parts` sends several lists in one copy and returns a view per list. Each view starts on a
16-byte boundary: Triton compiles a kernel once per pointer alignment (16-byte aligned or not), so
views at offsets that depend on the lengths before them (a step's token count, its decode rows) made
a new compile, hundreds of milliseconds on the engine thread, the first time a step's counts fell
the other way.
"""

from __future__ import annotations

import torch

_ALIGN_BYTES = 16


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        # A copy from pinned memory, queued on the stream: the host does not wait for it.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_parts(parts: list[list[int]] | list[list[float]], dtype: torch.dtype,
               device: torch.device | str) -> list[torch.Tensor]:
    """The lists as views of one device tensor, in order, each 16-byte aligned."""
    per = max(1, _ALIGN_BYTES // dtype.itemsize)
    padded = [-(-len(p) // per) * per for p in parts]
    flat = [v for p, n in zip(parts, padded) for v in (*p, *[0] * (n - len(p)))]
    on_cuda = torch.device(device).type == "cuda"
    host = torch.tensor(flat, dtype=dtype, pin_memory=on_cuda)
    whole = host.to(device, non_blocking=True) if on_cuda else host.to(device)
    return [v[: len(p)] for v, p in zip(whole.split(padded), parts)]
