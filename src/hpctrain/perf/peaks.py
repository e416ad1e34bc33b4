"""Dense tensor-core peaks of common data-centre GPUs, to put a measured matrix-multiply rate in proportion.

Numbers are the vendors' datasheet figures *without* structured sparsity (the datasheets print the sparse
figure, twice these, first), per GPU, at boost clock. A dense 8192^3 bf16 GEMM reaches roughly 60-80% of
them on a healthy GPU; far less points at a throttled, power-capped or shared GPU, or at a slow path (a dtype
without tensor cores). Keyed by the name torch.cuda.get_device_name reports, first match wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    gpu: str
    """The table's name for the GPU."""
    dtype: str
    """The dtype of the peak: 'bf16', or 'fp16' for GPUs without bf16 tensor cores (V100)."""
    tflops: float
    """Dense peak, TFLOP/s."""


# (pattern on torch.cuda.get_device_name, table name, dtype, dense TFLOP/s). More specific patterns first:
# 'H100 PCIe' before 'H100', 'A100' before 'A10'.
PEAKS: list[tuple[str, str, str, float]] = [
    (r"GH200", "GH200", "bf16", 989.0),
    (r"H200 NVL", "H200 NVL", "bf16", 835.5),
    (r"H200", "H200 SXM", "bf16", 989.0),
    (r"H100 NVL", "H100 NVL", "bf16", 835.5),
    (r"H100 PCIe", "H100 PCIe", "bf16", 756.0),
    (r"H100", "H100 SXM", "bf16", 989.0),  # "NVIDIA H100 80GB HBM3"
    (r"B200", "B200", "bf16", 2250.0),
    (r"A100", "A100", "bf16", 312.0),  # SXM4 and PCIe alike
    (r"\bA30\b", "A30", "bf16", 165.0),
    (r"\bA10\b", "A10", "bf16", 125.0),
    (r"L40S", "L40S", "bf16", 362.0),
    (r"\bL40\b", "L40", "bf16", 181.0),
    (r"\bL4\b", "L4", "bf16", 121.0),
    (r"V100S", "V100S PCIe", "fp16", 130.0),
    (r"V100-PCIE|V100 PCIe", "V100 PCIe", "fp16", 112.0),
    (r"V100", "V100 SXM2", "fp16", 125.0),
]


def dense_peak(device_name: str) -> Peak | None:
    """The dense tensor-core peak of the GPU called device_name, or None when it is not in the table."""
    for pattern, gpu, dtype, tflops in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return Peak(gpu, dtype, tflops)
    return None


def describe(measured_tflops: float, device_name: str, dtype: str) -> str:
    """'62% of the H100 SXM's dense bf16 peak (989 TFLOP/s)', or why there is no comparison."""
    peak = dense_peak(device_name)
    if peak is None:
        return f"peak unknown for {device_name!r}"
    if peak.dtype != dtype:
        return f"measured in {dtype}; the {peak.gpu}'s table peak is for {peak.dtype} ({peak.tflops:g} TFLOP/s)"
    return f"{measured_tflops / peak.tflops:.0%} of the {peak.gpu}'s dense {peak.dtype} peak ({peak.tflops:g} TFLOP/s)"
