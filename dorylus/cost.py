"""Dollars for a run: Lambda duration and requests, EC2 server time, and value = 1 / (time x cost).

Prices are data, in one table, so that updating them (or pricing another region) is one edit:

    lambda   = billed_gb_s * price_per_gb_s[architecture] + requests * price_per_request
    servers  = sum over instance types of count * seconds / 3600 * hourly_price
    value    = 1 / (seconds * dollars)          # higher is better (performance per dollar)

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


# Source: AWS Lambda pricing (aws.amazon.com/lambda/pricing) and Amazon EC2 On-Demand pricing
# (aws.amazon.com/ec2/pricing/on-demand), us-east-1, Linux, as listed in mid-2026 (these list
# prices have not changed since the instance types launched). Check them before quoting.
US_EAST_1 = PriceTable(
    region="us-east-1",
    as_of="2026-06",
    source="aws.amazon.com/lambda/pricing, aws.amazon.com/ec2/pricing/on-demand",
    lambda_gb_s_usd={"x86_64": 0.0000166667, "arm64": 0.0000133334},
    lambda_request_usd=0.20 / 1_000_000,
    ec2_hour_usd={
        # compute-optimized: graph servers
        "c5.xlarge": 0.17, "c5.2xlarge": 0.34, "c5.4xlarge": 0.68,
        "c5n.xlarge": 0.216, "c5n.2xlarge": 0.432, "c5n.4xlarge": 0.864,
        # general purpose and memory-optimized: parameter servers, big partitions
        "m5.xlarge": 0.192, "m5.2xlarge": 0.384, "r5.xlarge": 0.252, "r5.2xlarge": 0.504,
        # GPU: the gpu backend
        "p3.2xlarge": 3.06, "g4dn.xlarge": 0.526, "g5.xlarge": 1.006,
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
