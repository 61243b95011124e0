"""Which device a model runs on, in the words a platform team uses to find it.

"cpu", or on CUDA the GPU's UUID as NVML and dcgm-exporter spell it ("GPU-<uuid>"), so that a
rank whose NaN did not reproduce (a hardware suspect) can be matched to the GPU to drain.
Read once per profiler, never on the training thread's hot path.
"""

from __future__ import annotations

import torch


def device_name(devices: set[torch.device] | list[torch.device]) -> str:
    """The identity of the first accelerator among `devices`, else "cpu"."""
    for device in sorted(devices, key=str):
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:
                return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
            except Exception:  # an old driver or a fake device: the index still says which
                return f"cuda:{index}"
        if device.type != "cpu":
            return str(device)
    return "cpu"
