"""Dollars for a run: Lambda duration and requests, EC2 server time, and value = 1 / (time x cost).

Prices are data, in one table, so that updating them (or pricing another region) is one edit:

    lambda   = billed_gb_s * price_per_gb_s[architecture] + requests * price_per_request
    servers  = sum over instance types of count * seconds / 3600 * hourly_price
    value    = 1 / (seconds * dollars)          # higher is better (performance per dollar)

A run's :class:`Pricing` (from its config: instance types, graph-server count, function memory)
splits an epoch's dollars into :data:`COMPONENTS` (functions, graph servers, parameter server);
:func:`epoch_metrics` gives the cost fields every line of ``metrics.jsonl`` carries, and the
planner (:mod:`dorylus.plan`) prices its predictions with the same class.

Server time is pro-rated per second without EC2's 60-second minimum per launch: the servers of a
run are assumed to live across many epochs. Lambda's free tier and its volume discounts (above 6
billion GB-s a month) are left out, as they do not belong to any one job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dorylus.errors import ConfigError


@dataclass(frozen=True)
class PriceTable:
    """On-demand list prices in USD for one region."""

    region: str
    as_of: str
    source: str
    lambda_gb_s_usd: dict[str, float] = field(default_factory=dict)  # by architecture
    lambda_request_usd: float = 0.0  # per request
    ec2_hour_usd: dict[str, float] = field(default_factory=dict)  # by instance type, Linux


# Sources, us-east-1, Linux, on-demand list prices as published in 2025 (check before quoting):
# * Lambda: aws.amazon.com/lambda/pricing: $0.0000166667 per GB-s (x86_64), $0.0000133334 (arm64),
#   first pricing tier; $0.20 per million requests.
# * EC2: aws.amazon.com/ec2/pricing/on-demand. CPU instances: unchanged since launch. P4d and P5:
#   the prices after AWS's June 2025 cut ("Announcing up to 45% price reduction for Amazon EC2
#   NVIDIA GPU-accelerated instances", aws.amazon.com/blogs, 2025-06-05: p4d.24xlarge $32.77 ->
#   $21.96, p5.48xlarge $98.32 -> $55.04 per hour).
US_EAST_1 = PriceTable(
    region="us-east-1",
    as_of="2025",
    source="aws.amazon.com/lambda/pricing, aws.amazon.com/ec2/pricing/on-demand, "
           "aws.amazon.com/blogs (2025-06 P4d/P5 price cut)",
    lambda_gb_s_usd={"x86_64": 0.0000166667, "arm64": 0.0000133334},
    lambda_request_usd=0.20 / 1_000_000,
    ec2_hour_usd={
        # compute-optimized: graph servers
        "c5.xlarge": 0.17, "c5.2xlarge": 0.34, "c5.4xlarge": 0.68, "c5.9xlarge": 1.53,
        "c5n.xlarge": 0.216, "c5n.2xlarge": 0.432, "c5n.4xlarge": 0.864, "c5n.9xlarge": 1.944,
        # general purpose and memory-optimized: parameter servers, big partitions
        "m5.xlarge": 0.192, "m5.2xlarge": 0.384, "r5.xlarge": 0.252, "r5.2xlarge": 0.504,
        "r5.4xlarge": 1.008,
        # GPU: the gpu backend (V100, T4, A10G, 8 x A100 40 GB, 8 x H100 80 GB)
        "p3.2xlarge": 3.06, "p3.8xlarge": 12.24, "g4dn.xlarge": 0.526,
        "g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.4xlarge": 1.624,
        "p4d.24xlarge": 21.96, "p5.48xlarge": 55.04,
    },
)
DEFAULT_PRICES = US_EAST_1


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"cost: {name} must be >= 0, got {value}")


def lambda_cost_usd(billed_gb_s: float, requests: int, prices: PriceTable = DEFAULT_PRICES,
                    architecture: str = "x86_64") -> float:
    """Duration charge for ``billed_gb_s`` GB-seconds plus the per-request fee."""
    _check_non_negative(billed_gb_s=billed_gb_s, requests=requests)
    try:
        per_gb_s = prices.lambda_gb_s_usd[architecture]
    except KeyError:
        raise ConfigError(f"cost: unknown Lambda architecture {architecture!r} in the "
                          f"{prices.region} price table; known: "
                          + ", ".join(sorted(prices.lambda_gb_s_usd))) from None
    return billed_gb_s * per_gb_s + requests * prices.lambda_request_usd


def server_cost_usd(instance_type: str, seconds: float, count: int = 1,
                    prices: PriceTable = DEFAULT_PRICES) -> float:
    """``count`` instances of ``instance_type`` running ``seconds`` each, pro-rated per second."""
    _check_non_negative(seconds=seconds, count=count)
    try:
        hourly = prices.ec2_hour_usd[instance_type]
    except KeyError:
        raise ConfigError(f"cost: unknown instance type {instance_type!r} in the {prices.region} "
                          f"price table ({prices.as_of}); known: "
                          + ", ".join(sorted(prices.ec2_hour_usd))) from None
    return count * seconds / 3600 * hourly


def value(seconds: float, dollars: float) -> float:
    """Performance per dollar, ``1 / (seconds * dollars)``: higher is better."""
    if not (seconds > 0 and dollars > 0):
        raise ValueError(f"cost: value needs positive time and cost, got {seconds} s, ${dollars}")
    return 1.0 / (seconds * dollars)


COMPONENTS = ("functions", "graph_servers", "param_server")


@dataclass(frozen=True)
class Pricing:
    """What one epoch of a run costs, by component::

        functions      = billed_gb_s * usd_per_gb_s + requests * usd_per_request
        graph_servers  = graph_servers * seconds / 3600 * hourly(graph_server_instance)
        param_server   = param_servers * seconds / 3600 * hourly(param_server_instance)
        cost_usd       = functions + graph_servers + param_server

    Each graph server is priced as one instance, whatever shares a machine locally: the run is
    priced as it would be deployed (one machine per partition, as in AWS mode).
    """

    graph_server_instance: str
    graph_servers: int
    param_server_instance: str
    param_servers: int
    lambda_memory_mb: int | None  # None: the run calls no functions
    architecture: str = "x86_64"
    prices: PriceTable = DEFAULT_PRICES

    def __post_init__(self) -> None:
        for instance in (self.graph_server_instance, self.param_server_instance):
            server_cost_usd(instance, 0.0, prices=self.prices)  # ConfigError naming an unknown type
        lambda_cost_usd(0.0, 0, self.prices, self.architecture)

    @classmethod
    def of_run(cls, config, parts: int | None) -> "Pricing":
        """The pricing of a run of ``config`` (a :class:`~dorylus.config.TrainConfig`) on ``parts``
        graph servers; a run without (the single-process reference, ``parts`` None) is one
        graph-server machine and no parameter server. Function calls are billed at the config's
        memory when its backend makes them (:attr:`graphserver.backends.RunBackend.calls_functions`)."""
        from graphserver.backends import backend_class

        single = parts is None
        return cls(graph_server_instance=config.graph_server_instance, graph_servers=1 if single else parts,
                   param_server_instance=config.param_server_instance, param_servers=0 if single else 1,
                   lambda_memory_mb=config.lambda_memory_mb if backend_class(config.backend).calls_functions
                   else None)

    def epoch_cost(self, seconds: float, billed_gb_s: float = 0.0, requests: int = 0) -> dict[str, float]:
        """Dollars of an epoch of ``seconds`` wall time with ``billed_gb_s`` and ``requests`` of
        function calls, by component (keys :data:`COMPONENTS`)."""
        return {
            "functions": lambda_cost_usd(billed_gb_s, requests, self.prices, self.architecture),
            "graph_servers": server_cost_usd(self.graph_server_instance, seconds, self.graph_servers, self.prices),
            "param_server": server_cost_usd(self.param_server_instance, seconds, self.param_servers, self.prices),
        }

    def to_dict(self) -> dict:
        """The instance types, counts and prices used, for ``summary.json``."""
        p = self.prices
        return {
            "region": p.region, "as_of": p.as_of, "source": p.source,
            "graph_server": {"instance": self.graph_server_instance, "count": self.graph_servers,
                             "usd_per_hour": p.ec2_hour_usd[self.graph_server_instance]},
            "param_server": {"instance": self.param_server_instance, "count": self.param_servers,
                             "usd_per_hour": p.ec2_hour_usd[self.param_server_instance]},
            "functions": None if self.lambda_memory_mb is None else {
                "architecture": self.architecture, "memory_mb": self.lambda_memory_mb,
                "usd_per_gb_s": p.lambda_gb_s_usd[self.architecture], "usd_per_request": p.lambda_request_usd},
        }


def epoch_metrics(pricing: Pricing, seconds: float, billed_gb_s: float = 0.0, requests: int = 0) -> dict:
    """The cost fields of one epoch's metrics: ``cost_usd``, ``cost_by_component_usd`` and
    ``value`` = 1 / (``seconds`` x ``cost_usd``)."""
    parts = pricing.epoch_cost(seconds, billed_gb_s, requests)
    total = sum(parts.values())
    return {"cost_usd": total, "cost_by_component_usd": parts,
            "value": value(seconds, total) if seconds > 0 and total > 0 else None}
