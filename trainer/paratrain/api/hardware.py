"""The accelerators paratrain knows by name: memory, peak FLOP/s and link bandwidths, from the vendors' datasheets.

The planner (`paratrain validate --explain --gpu NAME`) sizes layouts against them; perf.PEAK_FLOPS (MFU) reads its
peaks from here. Bandwidths are per GPU and direction, what a collective's ring can use: NVLink within a node where
the GPU has it (else PCIe), the node's network share across nodes (its NICs divided by its GPUs). They are defaults:
a cluster whose links differ should be measured, and the planner says its time is uncalibrated until a GPU run
(bench/gpu.sh) measures the compute efficiency the platform then states.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str  # what --gpu takes
    device_name: str  # a substring of torch.cuda.get_device_name() that identifies it
    memory_bytes: int
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    fp32_flops: float  # plain fp32 (TF32 tensor cores give half the bf16 peak)
    node_bytes_per_second: float  # within a node, per GPU and direction (NVLink, else PCIe)
    network_bytes_per_second: float  # across nodes, per GPU and direction
    memory_bytes_per_second: float = 2e12  # the device memory's (HBM) bandwidth: what the optimizer step streams
    gpus_per_node: int = 8
    # across topology domains (spec.scheduling.topology: over the spine), per GPU and direction; 0: half the
    # network's (a 2:1 oversubscribed spine), where the platform's planner.crossDomainBandwidth says nothing
    cross_domain_bytes_per_second: float = 0.0
    # the fraction of its dense peak a step's matmuls reach, as measured on this cluster (bench/gpu.sh prints it;
    # the platform's planner.computeEfficiency states it); 0: the planner's uncalibrated prior
    compute_efficiency: float = 0.0
    # GPUs one NVLink fabric joins across nodes (a GB200 NVL72 rack: 72); 0: a node's. Used only where the job is
    # placed by an NVLink-domain label (NVLINK_DOMAIN_LABELS), which the operator then reads the domains' size from.
    nvlink_gpus: int = 0
    # the most ranks one domain of the job's spec.scheduling.topology.level holds, from the nodes' labels (the
    # operator counts them); 0: unknown. What a group spanning more crosses domains at, where ranksPerDomain is unset.
    domain_gpus: int = 0
    # What a collective (all-reduce, all-gather, reduce-scatter) and a pipeline's send cost whatever their size: the
    # launch, the ranks' synchronisation and the protocol's latency (the α of an α-β model; the bandwidths above are
    # the β). Priors for NCCL's small messages within a node; bench/planner.py measures gloo's on a CPU.
    collective_seconds: float = 20e-6
    send_seconds: float = 10e-6

    @property
    def cross_domain(self) -> float:
        return self.cross_domain_bytes_per_second or self.network_bytes_per_second / 2

    def flops(self, precision: str, tf32: bool) -> float:
        """The peak a job's matmuls can reach in `precision` (fp32 with spec.tf32: TF32 tensor cores)."""
        if precision in ("bf16", "fp16"):
            return self.peak_flops
        return self.peak_flops / 2 if tf32 and self.fp32_flops < self.peak_flops / 2 else self.fp32_flops


# Node labels whose domains are NVLink domains spanning nodes: GPU Feature Discovery's clique (the NVLink fabric's
# cluster UUID and clique ID, on multi-node NVLink systems) and Topograph's accelerator domain.
NVLINK_DOMAIN_LABELS = ("nvidia.com/gpu.clique", "network.topology.nvidia.com/accelerator")

# In match order for device_name (so "H100 PCIe" before "H100", "L40S" before "L4", "GB200" before "B200").
ACCELERATORS = (
    # Blackwell: NVLink 5 (1.8 TB/s both ways), 400 Gb/s a GPU (ConnectX-7). GB200 NVL72: 4 GPUs a compute tray, 18
    # trays on one NVLink fabric; dense bf16 2.5 PFLOP/s a GPU (GB200's), 2.25 (HGX B200's); HBM3e 8 TB/s.
    Accelerator("GB200-186GB", "GB200", 186 * GiB, 2.5e15, 80e12, 900 * GB, 50 * GB, 8e12, gpus_per_node=4,
                nvlink_gpus=72),
    Accelerator("B200-180GB", "B200", 180 * GiB, 2.25e15, 75e12, 900 * GB, 50 * GB, 8e12),
    Accelerator("H100-PCIe-80GB", "H100 PCIe", 80 * GiB, 756e12, 51e12, 64 * GB, 25 * GB, 2.0e12),
    Accelerator("H100-NVL-94GB", "H100 NVL", 94 * GiB, 835e12, 60e12, 64 * GB, 50 * GB, 3.9e12),
    Accelerator("H100-80GB", "H100", 80 * GiB, 989e12, 67e12, 450 * GB, 50 * GB, 3.35e12),  # SXM: NVLink 4, 8 x 400 Gb/s
    Accelerator("H200-NVL-141GB", "H200 NVL", 141 * GiB, 835e12, 60e12, 64 * GB, 50 * GB, 4.8e12),
    Accelerator("H200-141GB", "H200", 141 * GiB, 989e12, 67e12, 450 * GB, 50 * GB, 4.8e12),  # SXM
    Accelerator("A100-80GB", "A100", 80 * GiB, 312e12, 19.5e12, 300 * GB, 25 * GB, 2.04e12),  # SXM: NVLink 3, 200 Gb/s
    Accelerator("A100-40GB", "A100", 40 * GiB, 312e12, 19.5e12, 300 * GB, 25 * GB, 1.56e12),
    Accelerator("L40S-48GB", "L40S", 48 * GiB, 362e12, 91.6e12, 32 * GB, 12.5 * GB, 0.864e12),  # PCIe 4, 100 Gb/s a node
    Accelerator("L4-24GB", "L4", 24 * GiB, 121e12, 30.3e12, 32 * GB, 12.5 * GB, 0.3e12),
    Accelerator("V100-32GB", "V100", 32 * GiB, 125e12, 15.7e12, 150 * GB, 12.5 * GB, 0.9e12),  # fp16 (no bf16)
)
BY_NAME = {a.name: a for a in ACCELERATORS}
# A CPU rank, for planning local runs: an order of magnitude, not a datasheet (gloo over shared memory).
# Its collective and send costs: a 4 KiB all-reduce and a send between two gloo ranks on this 2-core machine; where
# local ranks share cores, a collective waits for each one's turn (4 ranks on 2 cores: 5-6 ms, not 0.45).
CPU = Accelerator("cpu", "cpu", 0, 1e11, 1e11, 5 * GB, 1 * GB, 10 * GB, gpus_per_node=1, collective_seconds=0.45e-3,
                  send_seconds=0.12e-3)


def accelerator(name: str) -> Accelerator:
    """The catalogue's entry for `name` (case-insensitive); ValueError naming the known ones."""
    found = {a.name.lower(): a for a in ACCELERATORS}.get(name.lower())
    if found is None:
        raise ValueError(f"{name!r} is not a GPU paratrain knows: one of {', '.join(BY_NAME)}")
    return found


def by_device_name(name: str, memory_bytes: int | None = None) -> Accelerator | None:
    """The catalogue's entry for a GPU named so (torch.cuda.get_device_name(), or GPU Feature Discovery's
    nvidia.com/gpu.product label, whose dashes stand for spaces), the one nearest `memory_bytes` where one name
    comes in several sizes (A100 40 and 80 GB), with that memory; None where the catalogue has no such GPU."""
    spaced = name.replace("-", " ")
    first = next((a for a in ACCELERATORS if a.device_name in spaced), None)
    if first is None:
        return None
    sizes = [a for a in ACCELERATORS if a.device_name == first.device_name]
    if memory_bytes is None:
        return first
    nearest = min(sizes, key=lambda a: abs(a.memory_bytes - memory_bytes))
    return replace(nearest, memory_bytes=memory_bytes)
