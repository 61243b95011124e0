"""Peak FLOP/s of common GPUs, looked up by device name, for the model FLOPs utilisation.

MFU is achieved FLOP/s over the device's peak for the precision the model computes in.
`Config.peak_flops` wins when set; otherwise the NVML (or torch.cuda) device name is
matched below. A device or precision not listed has no peak: MFU is not exported and a
notice says so once. CPUs have no default (their peak depends on cores, clocks, ISA).

Figures are dense (no 2:4 sparsity) tensor-core throughput, FLOP/s, from NVIDIA's
datasheets; where a datasheet prints only the sparse figure, half of it:
- H100 SXM5 / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (2023): FP32 67 / 51 /
  60 TF; TF32 989 / 756 / 835 TF sparse; BF16 and FP16 1,979 / 1,513 / 1,671 TF sparse.
- H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (2024): as H100 SXM / NVL.
- A100 40GB and 80GB, SXM and PCIe: "NVIDIA A100 Tensor Core GPU" datasheet (2021): FP32
  19.5 TF; TF32 156 TF; BF16 and FP16 312 TF (dense figures printed).
- L4: "NVIDIA L4 Tensor Core GPU" datasheet (2023): FP32 30.3 TF; TF32 120 TF sparse;
  BF16 and FP16 242 TF sparse.
- L40S: "NVIDIA L40S GPU" datasheet (2023): FP32 91.6 TF; TF32 366 TF sparse; BF16 and
  FP16 733 TF sparse.
- A10: "NVIDIA A10 Tensor Core GPU" datasheet (2021): FP32 31.2 TF; TF32 62.5 TF; BF16 and
  FP16 125 TF. The A10G (AWS G5) has no NVIDIA datasheet; AWS does not publish per-precision
  figures either, so it is left unknown rather than guessed: set Config.peak_flops.
- V100 SXM2 / PCIe / V100S: "NVIDIA Tesla V100 GPU" datasheet (2020): FP32 15.7 / 14 /
  16.4 TF; FP16 tensor 125 / 112 / 130 TF; no BF16 or TF32 (fp32 then runs at FP32 rate).
- RTX 4090 and RTX 3090: "NVIDIA Ada GPU Architecture" whitepaper (v2.01, table 2) and
  "NVIDIA Ampere GA102 GPU Architecture" whitepaper (table 9): FP16/BF16 tensor with FP32
  accumulate (what PyTorch uses) 165.2 / 71 TF; TF32 82.6 / 35.6 TF; FP32 82.6 / 35.6 TF.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

T = 1e12


class Peak(NamedTuple):
    bf16: float | None  # also fp16: equal on every GPU listed
    tf32: float | None  # fp32 matmuls with TF32 allowed
    fp32: float


# (pattern on the upper-cased device name, peak); the first match wins, so narrower first
_PEAKS: tuple[tuple[str, Peak], ...] = (
    (r"H100.*PCIE", Peak(1513 / 2 * T, 756 / 2 * T, 51 * T)),
    (r"H100.*NVL", Peak(1671 / 2 * T, 835 / 2 * T, 60 * T)),
    (r"H100", Peak(1979 / 2 * T, 989 / 2 * T, 67 * T)),  # SXM5 ("H100 80GB HBM3")
    (r"H200.*NVL", Peak(1671 / 2 * T, 835 / 2 * T, 60 * T)),
    (r"H200", Peak(1979 / 2 * T, 989 / 2 * T, 67 * T)),
    (r"A100", Peak(312 * T, 156 * T, 19.5 * T)),
    (r"L40S", Peak(733 / 2 * T, 366 / 2 * T, 91.6 * T)),
    (r"\bL4\b", Peak(242 / 2 * T, 120 / 2 * T, 30.3 * T)),
    (r"\bA10\b", Peak(125 * T, 62.5 * T, 31.2 * T)),
    (r"V100S", Peak(None, None, 16.4 * T)),
    (r"V100.*PCIE", Peak(None, None, 14 * T)),
    (r"V100", Peak(None, None, 15.7 * T)),
    (r"RTX 4090", Peak(165.2 * T, 82.6 * T, 82.6 * T)),
    (r"RTX 3090", Peak(71 * T, 35.6 * T, 35.6 * T)),
)

# V100's fp16 tensor-core peak (no bf16): fp16 differs from bf16 only there
_FP16_ONLY = {"V100S": 130 * T, "V100.*PCIE": 112 * T, "V100": 125 * T}


def lookup(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of `device_name` for `precision` ("bf16", "fp16", "tf32", "fp32"), or None
    when the device or the precision is not known."""
    name = device_name.upper()
    for pattern, peak in _PEAKS:
        if re.search(pattern, name):
            if precision == "fp16":
                return _FP16_ONLY.get(pattern, peak.bf16)
            if precision == "bf16":
                return peak.bf16
            if precision == "tf32":
                return peak.tf32 if peak.tf32 is not None else peak.fp32
            if precision == "fp32":
                return peak.fp32
            return None
    return None


def precision_of(dtype: torch.dtype, device_type: str) -> str | None:
    """The precision a model's matmuls run in: its autocast dtype when autocast is on for
    `device_type`, else `dtype` (its parameters'); fp32 counts as tf32 when TF32 matmuls
    are allowed. None for other dtypes (fp64, fp8, integers)."""
    if device_type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        tf32 = (
            torch.backends.cuda.matmul.allow_tf32
            or torch.get_float32_matmul_precision() != "highest"
        )
        return "tf32" if tf32 and device_type == "cuda" else "fp32"
    return None


def device_name(device: torch.device) -> str | None:
    """The device's name as NVML reports it ("NVIDIA H100 80GB HBM3"); None off CUDA.
    Read through torch.cuda, which reports the same name and, unlike an NVML index, honours
    CUDA_VISIBLE_DEVICES."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)
