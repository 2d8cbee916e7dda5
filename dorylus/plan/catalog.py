"""What the planner prices: machines (EC2 instance types, their GPUs, Lambda) and workloads.

Tables are data with their sources. Hourly prices are not here: they live once, in
:data:`dorylus.cost.DEFAULT_PRICES`; a machine here without a price there is refused.

* :data:`INSTANCES`: vCPUs, memory, baseline network bandwidth and GPUs of EC2 instance types.
  Sources: aws.amazon.com/ec2/instance-types and docs.aws.amazon.com/ec2/latest/instancetypes
  (compute optimized, general purpose, memory optimized, accelerated computing: "Network
  specifications", baseline bandwidth; an "up to N Gbps" type sustains only its baseline).
* :data:`GPUS`: memory, memory bandwidth and float32 throughput (without TF32) from NVIDIA's
  datasheets (V100 SXM2, T4, A10G, A100 SXM4 40 GB, H100 SXM5 80 GB, H200 SXM 141 GB).
* Lambda: CPU share and per-call figures from :mod:`dorylus.emulator.physics` (measured on AWS,
  sources there); the account's default concurrency quota, 1,000 (AWS Lambda quotas page).
* :data:`SPOT_DISCOUNTS`: typical spot savings per instance family from the AWS EC2 Spot
  Instance Advisor (not fetched: documented typical figures, marked as such, with their date).
* :data:`WORKLOADS`: the Dorylus paper's graphs (Thorpe et al., "Dorylus: Affordable, Scalable,
  and Accurate GNN Training with Distributed CPU Servers and Serverless Threads", OSDI 2021,
  Table 3: vertices, edges, features, labels); Reddit as the ``synthetic-reddit`` preset has it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dorylus.cost import DEFAULT_PRICES, PriceTable
from dorylus.emulator.physics import AWS_LIKE, MAX_VCPUS, MB_PER_VCPU
from dorylus.errors import ConfigError

GIB = 1024 ** 3


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    memory_gb_per_s: float  # HBM/GDDR bandwidth, GB/s (1e9 bytes)
    fp32_tflops: float      # dense float32, no TF32 (sync mode stays exact)


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("V100", 16, 900, 15.7),
    Gpu("T4", 16, 320, 8.1),
    Gpu("A10G", 24, 600, 31.2),
    Gpu("A100-40GB", 40, 1555, 19.5),
    Gpu("H100", 80, 3350, 67.0),
    Gpu("H200", 141, 4800, 67.0),
)}


def gpu_of(device_name: str) -> Gpu | None:
    """The :data:`GPUS` entry of a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> H100), or None."""
    upper = device_name.upper()
    for key, pattern in (("H200", "H200"), ("H100", "H100"), ("A100-40GB", "A100"), ("V100", "V100"),
                         ("A10G", "A10G"), ("T4", "T4")):
        if pattern in upper:
            return GPUS[key]
    return None


@dataclass(frozen=True)
class Instance:
    """An EC2 instance type. ``cores`` = vCPUs / 2: two vCPUs are one core's hyperthreads, and
    sparse and dense kernels gain little from the second thread of a core."""

    name: str
    vcpus: int
    memory_gib: float
    network_gbps: float  # baseline, both directions
    gpu: str | None = None
    gpus: int = 0

    @property
    def cores(self) -> float:
        return self.vcpus / 2

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbps * 1e9 / 8


INSTANCES: dict[str, Instance] = {i.name: i for i in (
    Instance("c5.xlarge", 4, 8, 1.25), Instance("c5.2xlarge", 8, 16, 2.5), Instance("c5.4xlarge", 16, 32, 5),
    Instance("c5.9xlarge", 36, 72, 10),
    Instance("c5n.xlarge", 4, 10.5, 5), Instance("c5n.2xlarge", 8, 21, 10), Instance("c5n.4xlarge", 16, 42, 15),
    Instance("c5n.9xlarge", 36, 96, 50),
    Instance("m5.xlarge", 4, 16, 1.25), Instance("m5.2xlarge", 8, 32, 2.5),
    Instance("r5.xlarge", 4, 32, 1.25), Instance("r5.2xlarge", 8, 64, 2.5), Instance("r5.4xlarge", 16, 128, 5),
    Instance("p3.2xlarge", 8, 61, 2.5, "V100", 1), Instance("p3.8xlarge", 32, 244, 10, "V100", 4),
    Instance("g4dn.xlarge", 4, 16, 5, "T4", 1),
    Instance("g5.xlarge", 4, 16, 2.5, "A10G", 1), Instance("g5.2xlarge", 8, 32, 5, "A10G", 1),
    Instance("g5.4xlarge", 16, 64, 8, "A10G", 1),
    Instance("p4d.24xlarge", 96, 1152, 400, "A100-40GB", 8), Instance("p5.48xlarge", 192, 2048, 3200, "H100", 8),
)}


def instance(name: str, prices: PriceTable = DEFAULT_PRICES, gpu: bool = False) -> Instance:
    """The instance type ``name``, which must also be in the price table (and have a GPU when
    ``gpu``); ConfigError naming the known ones otherwise."""
    known = sorted(n for n, i in INSTANCES.items() if n in prices.ec2_hour_usd and (i.gpu is not None or not gpu))
    found = INSTANCES.get(name)
    if found is None or name not in prices.ec2_hour_usd or (gpu and found.gpu is None):
        raise ConfigError(f"plan: {'GPU ' if gpu else ''}instance type {name!r} is not in the planner's table; "
                          f"known: {', '.join(known)}")
    return found


@dataclass(frozen=True)
class LambdaFigures:
    """AWS Lambda as the planner sees it: ``start_s`` per call (not billed), each call's own
    network ``bytes_per_s``, and a CPU share of ``memory_mb / 1769`` vCPUs (at most 6)."""

    start_s: float = AWS_LIKE.start_latency_ms / 1000
    bytes_per_s: float = AWS_LIKE.bandwidth_mbps * 1e6 / 8
    account_concurrency: int = 1000

    @staticmethod
    def vcpus(memory_mb: int) -> float:
        return min(memory_mb / MB_PER_VCPU, MAX_VCPUS)


LAMBDA = LambdaFigures()


@dataclass(frozen=True)
class Workload:
    """A graph to train on: ``edges`` directed (an undirected edge counts twice); ``A_hat`` has
    ``edges + vertices`` entries (self-loops)."""

    name: str
    vertices: int
    edges: int
    features: int
    classes: int
    source: str

    @property
    def nnz(self) -> int:
        return self.edges + self.vertices


PAPER = "Thorpe et al., Dorylus, OSDI 2021, Table 3"
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("reddit", 232_965, 114_615_892, 602, 41, "Reddit (Hamilton et al. 2017); the synthetic-reddit preset"),
    Workload("amazon", 9_430_088, 231_594_310, 300, 25, PAPER),
    Workload("friendster", 65_608_366, 3_612_134_270, 32, 50, PAPER),
)}


# ----------------------------------------------------------------------------- spot


@dataclass(frozen=True)
class SpotDiscount:
    """A family's typical spot saving over on-demand, as a fraction (0.6: spot costs 40% of the
    on-demand price), with where the figure comes from and when."""

    family: str
    saving: float
    source: str
    as_of: str


# TYPICAL figures, not measured or fetched here (no network): the "Savings over On-Demand" column
# of the AWS EC2 Spot Instance Advisor (aws.amazon.com/ec2/spot/instance-advisor), Linux,
# us-east-1, for the family's 2xlarge (or smallest listed) size, read as the low end of the range
# it usually shows; spot prices move with supply and differ by zone, so the saving of a real run
# is what its bill says. Check the advisor (or `aws ec2 describe-spot-price-history`) before
# relying on one, and pass --spot-saving to use your own.
SPOT_SOURCE = "AWS EC2 Spot Instance Advisor, savings over on-demand, Linux us-east-1 (typical, not fetched)"
SPOT_AS_OF = "2025"
SPOT_DISCOUNTS: dict[str, SpotDiscount] = {d.family: d for d in (
    SpotDiscount("c5", 0.60, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("c5n", 0.62, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("m5", 0.60, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("r5", 0.65, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("p3", 0.70, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("g4dn", 0.60, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("g5", 0.55, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("p4d", 0.60, SPOT_SOURCE, SPOT_AS_OF),
    SpotDiscount("p5", 0.50, SPOT_SOURCE, SPOT_AS_OF),
)}


def spot_discount(instance_type: str) -> SpotDiscount:
    """The :data:`SPOT_DISCOUNTS` entry of ``instance_type``'s family (``c5n.2xlarge`` -> c5n);
    ConfigError naming the known families otherwise."""
    family = instance_type.split(".", 1)[0]
    found = SPOT_DISCOUNTS.get(family)
    if found is None:
        raise ConfigError(f"plan: no spot discount for instance family {family!r} ({instance_type}); known: "
                          f"{', '.join(SPOT_DISCOUNTS)} (or give --spot-saving)")
    return found
