"""Accelerators: dense bf16 peak FLOP/s, HBM capacity and HBM bandwidth per chip.

The planner sizes for them and the trainer reports MFU against their peaks; nothing here imports
the rest of the library.

Figures are the vendors' per-chip specifications (dense, no structured sparsity). Sources:

* NVIDIA A100: "NVIDIA A100 Tensor Core GPU" datasheet (SXM 80GB: 312 TFLOPS BF16, 2,039 GB/s).
* NVIDIA H100: "NVIDIA H100 Tensor Core GPU" datasheet (SXM: 989 TFLOPS BF16 dense, 80 GB HBM3,
  3.35 TB/s; PCIe: 756 TFLOPS, 80 GB HBM2e, 2.0 TB/s). The datasheet's 1,979 is with sparsity.
* NVIDIA H200: "NVIDIA H200 Tensor Core GPU" product brief (SXM: same compute as H100 SXM, 141 GB
  HBM3e, 4.8 TB/s).
* NVIDIA B200: "NVIDIA DGX B200" datasheet (1,440 GB HBM3e and 64 TB/s for 8 GPUs: 180 GB and
  8 TB/s each) and the HGX B200 figures (2.25 PFLOPS dense BF16 per GPU).
* NVIDIA L4: "NVIDIA L4 Tensor Core GPU" datasheet (121 TFLOPS BF16 dense, 24 GB, 300 GB/s).
* Google TPU v4, v5e, v5p, v6e (Trillium): Cloud TPU "System Architecture" pages per version
  (v4: 275 TFLOPS, 32 GiB, 1,228 GB/s; v5e: 197 TFLOPS, 16 GB, 819 GB/s; v5p: 459 TFLOPS,
  95 GB, 2,765 GB/s; v6e: 918 TFLOPS, 32 GB, 1,640 GB/s).
* AMD MI300X: "AMD Instinct MI300X" datasheet (1,307.4 TFLOPS BF16 dense, 192 GB HBM3, 5.3 TB/s).

Link bandwidth (what a tensor-parallel all-reduce moves per direction, per GPU) for the NVLink
parts: half the datasheets' bidirectional NVLink figures (A100 SXM 600 GB/s, H100 and H200 SXM
900 GB/s, B200 1.8 TB/s); unknown (None) for the others, whose serving plans then leave the
all-reduce time out and say so.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Device:
  name: str
  peak_bf16_flops: float  # dense bf16 FLOP/s per chip
  hbm_bytes: int  # device memory per chip
  hbm_bytes_per_s: float  # device memory bandwidth per chip
  aliases: tuple[str, ...] = ()  # other spellings, e.g. jax's device_kind
  link_bytes_per_s: float | None = None  # interconnect bandwidth per direction per chip


_GB = 10**9
_GIB = 2**30

DEVICES: dict[str, Device] = {
  d.name: d
  for d in (
    Device("A100", 312e12, 80 * _GB, 2039e9, ("A100-SXM", "A100-SXM4-80GB", "A100 80GB"), 300e9),
    Device("A100-40GB", 312e12, 40 * _GB, 1555e9, ("A100-SXM4-40GB",), 300e9),
    Device("H100", 989e12, 80 * _GB, 3.35e12, ("H100-SXM", "H100 80GB HBM3", "H800"), 450e9),
    Device("H100-PCIe", 756e12, 80 * _GB, 2.0e12, ("H100 PCIe",)),
    Device("H200", 989e12, 141 * _GB, 4.8e12, ("H200-SXM", "NVIDIA H200"), 450e9),
    Device("B200", 2250e12, 180 * _GB, 8.0e12, ("NVIDIA B200",), 900e9),
    Device("L4", 121e12, 24 * _GB, 300e9, ("NVIDIA L4",)),
    Device("MI300X", 1307.4e12, 192 * _GB, 5.3e12, ("AMD Instinct MI300X",)),
    Device("TPU v4", 275e12, 32 * _GIB, 1228e9, ("v4", "TPU-v4")),
    Device("TPU v5e", 197e12, 16 * _GB, 819e9, ("v5e", "TPU-v5e", "TPU v5 lite", "v5litepod")),
    Device("TPU v5p", 459e12, 95 * _GB, 2765e9, ("v5p", "TPU-v5p", "TPU v5")),
    Device("TPU v6e", 918e12, 32 * _GB, 1640e9, ("v6e", "TPU-v6e", "TPU v6 lite", "Trillium")),
  )
}


def _key(name: str) -> str:
  return "".join(ch for ch in name.lower() if ch.isalnum())


_BY_KEY = {_key(alias): d for d in DEVICES.values() for alias in (d.name, *d.aliases)}


def get_device(name: str) -> Device:
  """The device called `name` (case, spaces and dashes ignored: "h100", "tpu-v5e", "v5p").

  Raises ValueError naming the value and the known devices.
  """
  device = _BY_KEY.get(_key(str(name)))
  if device is None:
    raise ValueError(f"--device={name!r} is not a known device; allowed: {', '.join(DEVICES)}")
  return device


def match_device_kind(device_kind: str) -> Device | None:
  """The table entry for a jax `device_kind` string ("NVIDIA H100 80GB HBM3", "TPU v5 lite")."""
  kind = _key(device_kind)
  # Longest alias first: "TPU v5 lite" must not match "TPU v5" (v5p).
  for alias, device in sorted(_BY_KEY.items(), key=lambda kv: -len(kv[0])):
    if alias in kind:
      return device
  return None
