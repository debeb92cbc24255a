"""Accelerators and clusters the planner knows: datasheet numbers plus the cluster's shape.

Every number here is a datasheet (or list-price) figure, not a measurement; the planner turns them
into time through stated efficiency factors (see docs/plan.md). Units are SI: FLOP/s, bytes
(1 GB = 1e9 bytes, the unit of the ZeRO paper and of GPU datasheets), bytes/s, watts, USD.
Bandwidths are per GPU and per direction, which is what a ring collective is limited by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import ConfigError

# Matmul efficiency: the share of the datasheet peak that the calibration runs' matmuls reached
# (docs/plan.md, "Calibration"). Hopper-class parts run further from their peak than A100 (their
# peak assumes boost clocks the power limit does not sustain under dense bf16 GEMMs); B200 and MI300X
# take the Hopper figure for want of published runs to calibrate on.
A100_MATMUL = 0.75
H100_MATMUL = 0.66


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense (no structured sparsity) bf16 tensor-core peak
    memory: float  # HBM capacity, bytes
    hbm_bw: float  # HBM bandwidth, bytes/s
    intra_bw: float  # within a node (NVLink / Infinity Fabric), per GPU per direction, bytes/s
    inter_bw: float  # between nodes (one 400G-class NIC per GPU unless noted), bytes/s
    price: float  # default USD per GPU-hour (rough 2025 cloud on-demand level; override it)
    power: float  # board power (TDP), watts
    # Share of the bf16 peak that large training matmuls reach on this part (calibrated, docs/plan.md).
    matmul_efficiency: float = H100_MATMUL
    gpus_per_node: int = 8


GB = 1e9
# Alpha-beta cost of a ring collective (NCCL's own model, src/graph/tuning.cc, Ring/Simple protocol):
# a fixed launch latency per collective plus one per ring step, by the link the step crosses.
NCCL_BASE_LATENCY = 8.4e-6  # seconds per collective
NCCL_STEP_LATENCY = {"intra": 3.4e-6, "inter": 14e-6}  # seconds per ring step: NVLink, network
# Sources: NVIDIA H100/H200/A100/B200 and AMD MI300X datasheets. NVLink numbers are the advertised
# bidirectional totals halved (H100/H200 NVLink4 900 GB/s, A100 NVLink3 600 GB/s, B200 NVLink5
# 1.8 TB/s); MI300X: 7 Infinity Fabric links of 64 GB/s each way. Inter-node: 400 Gb/s (50 GB/s)
# per GPU (NDR InfiniBand / 400G RoCE), 200 Gb/s (HDR) for A100 systems.
GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM 80GB", 989.4e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 2.50, 700, H100_MATMUL),
    "h200": GPU("H200 SXM 141GB", 989.4e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 3.50, 700, H100_MATMUL),
    "a100": GPU("A100 SXM 80GB", 312e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB, 1.50, 400, A100_MATMUL),
    "b200": GPU("B200 180GB", 2.25e15, 180 * GB, 7.7e12, 900 * GB, 50 * GB, 5.00, 1000, H100_MATMUL),
    "mi300x": GPU("MI300X 192GB", 1307.4e12, 192 * GB, 5.3e12, 448 * GB, 50 * GB, 2.50, 750, H100_MATMUL),
}
ALIASES = {"h100-sxm": "h100", "h100sxm": "h100", "a100-80gb": "a100", "a100-80g": "a100", "mi300": "mi300x"}


def find_gpu(name: str) -> GPU:
    key = name.lower().replace(" ", "").replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ConfigError("gpu", f"unknown accelerator {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


@dataclass
class ClusterConfig:
    """A homogeneous cluster. Zero-valued overrides take the GPU table's defaults."""

    gpu: str = "h100"
    gpus_per_node: int = 8
    n_nodes: int = 1
    intra_bw: float = 0.0  # bytes/s per GPU per direction; 0: the GPU's NVLink figure
    inter_bw: float = 0.0  # bytes/s per GPU per direction; 0: the GPU's NIC figure
    price: float = 0.0  # USD per GPU-hour; 0: the GPU's default
    # Share of link peak that NCCL-class ring collectives reach (bus bandwidth / link bandwidth).
    comm_efficiency: float = 0.8
    # Share of the dense bf16 peak that the model's large matmuls reach; 0: the GPU's calibrated
    # figure. MFU can never exceed it; everything else (bubbles, exposed communication,
    # recomputation) is modelled on top.
    matmul_efficiency: float = 0.0
    # The same for the attention kernels (flash attention runs further from peak than plain GEMMs).
    attention_efficiency: float = 0.5
    # Share of a data- or context-parallel collective's time that overlapping compute hides: the
    # rest slows the compute it runs beside (NCCL kernels take SMs and HBM bandwidth from it).
    overlap_efficiency: float = 0.8
    # Share of HBM the planner lets a candidate use: the rest is the CUDA context, NCCL buffers and
    # the caching allocator's fragmentation.
    memory_fraction: float = 0.92
    spec: GPU = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.spec = find_gpu(self.gpu)
        for key in ("gpus_per_node", "n_nodes"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("intra_bw", "inter_bw", "price"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0 (0 takes the GPU default), got {getattr(self, key)}")
        if self.matmul_efficiency == 0:
            self.matmul_efficiency = self.spec.matmul_efficiency
        keys = ("comm_efficiency", "matmul_efficiency", "attention_efficiency", "overlap_efficiency", "memory_fraction")
        for key in keys:
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {getattr(self, key)}")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.n_nodes

    @property
    def peak_flops(self) -> float:
        return self.spec.bf16_flops

    @property
    def usable_memory(self) -> float:
        return self.spec.memory * self.memory_fraction

    @property
    def intra(self) -> float:
        return (self.intra_bw or self.spec.intra_bw) * self.comm_efficiency

    @property
    def inter(self) -> float:
        return (self.inter_bw or self.spec.inter_bw) * self.comm_efficiency

    @property
    def gpu_hour_price(self) -> float:
        return self.price or self.spec.price

    def describe(self) -> str:
        return (
            f"{self.n_nodes} x {self.gpus_per_node} {self.spec.name} = {self.world} GPUs; "
            f"bf16 peak {self.peak_flops / 1e12:.0f} TFLOP/s, {self.spec.memory / GB:.0f} GB HBM; "
            f"links {self.intra / GB:.0f} GB/s in-node, {self.inter / GB:.0f} GB/s across nodes "
            f"(after comm_efficiency {self.comm_efficiency})"
        )
