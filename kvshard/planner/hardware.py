"""A GPU as the roofline sees it: memory, bandwidth, peak rates and links."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvshard.planner.errors import PlanError

GIB = 2**30

REQUIRED_CUSTOM_FIELDS = ("hbm_gib", "hbm_tbps", "bf16_tflops", "nvlink_gbps")


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU. Link bandwidths are per GPU and per direction,
    which is what a ring collective can use (the datasheets quote both directions)."""

    name: str
    hbm_gib: float
    hbm_tbps: float
    bf16_tflops: float
    fp8_tflops: float
    nvlink_gbps: float  # 0: no NVLink, GPUs talk over PCIe
    network_gbps: float  # scale-out NIC per GPU, for groups that span nodes
    pcie_gbps: float
    gpus_per_node: int
    source: str = ""

    def __post_init__(self) -> None:
        for field_name in ("hbm_gib", "hbm_tbps", "bf16_tflops", "fp8_tflops", "network_gbps", "pcie_gbps"):
            value = getattr(self, field_name)
            if not (value > 0 and math.isfinite(value)):  # nan and inf would fill the plan with nan
                raise PlanError(f"GPU {self.name}: --{field_name.replace('_', '-')} must be positive, got {value}")
        if not (0 <= self.nvlink_gbps < math.inf) or self.gpus_per_node < 1:
            raise PlanError(f"GPU {self.name}: --nvlink-gbps must be a number of at least 0 and --gpus-per-node "
                            "at least 1")

    @property
    def has_nvlink(self) -> bool:
        return self.nvlink_gbps > 0

    def link_gbps(self, group_size: int) -> float:
        """Bandwidth a collective over `group_size` contiguous ranks gets: NVLink (or
        PCIe without it) inside a node, the NIC once the group spans nodes."""
        if group_size > self.gpus_per_node:
            return self.network_gbps
        return self.nvlink_gbps if self.has_nvlink else self.pcie_gbps
