"""What this machine has: a CUDA device (the `cuda` marker's skip) and an NVIDIA driver."""

from __future__ import annotations


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def nvml_driver_present() -> bool:
    """Whether NVML (nvidia-ml-py and an NVIDIA driver) answers on this machine."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()
