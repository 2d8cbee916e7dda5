"""The cost model: hand-computed dollars, and dollars from the emulator's billing counters."""

from __future__ import annotations

import math

import pytest

from dorylus.cost import (
    DEFAULT_PRICES,
    PriceTable,
    lambda_cost_usd,
    server_cost_usd,
    value,
)
from dorylus.errors import ConfigError


def test_price_table_is_us_east_1_list_prices():
    assert DEFAULT_PRICES.region == "us-east-1" and DEFAULT_PRICES.as_of and DEFAULT_PRICES.source
    assert DEFAULT_PRICES.lambda_gb_s_usd == {"x86_64": 0.0000166667, "arm64": 0.0000133334}
    assert DEFAULT_PRICES.lambda_request_usd * 1e6 == pytest.approx(0.20)
    for instance in ("c5.xlarge", "c5.2xlarge", "c5.4xlarge", "r5.xlarge", "p3.2xlarge",
                     "g4dn.xlarge", "g5.xlarge"):
        assert DEFAULT_PRICES.ec2_hour_usd[instance] > 0


def test_lambda_cost():
    # 2 million requests of 250 ms at 2048 MB: 2e6 * 0.25 s * 2 GB = 1e6 GB-s.
    assert lambda_cost_usd(1e6, 2_000_000) == pytest.approx(16.6667 + 0.40)
    assert lambda_cost_usd(1e6, 2_000_000, architecture="arm64") == pytest.approx(13.3334 + 0.40)
    assert lambda_cost_usd(0, 0) == 0
    with pytest.raises(ConfigError, match="unknown Lambda architecture 'sparc'.*arm64, x86_64"):
        lambda_cost_usd(1, 1, architecture="sparc")
    with pytest.raises(ValueError, match="billed_gb_s must be >= 0"):
        lambda_cost_usd(-1, 0)
    with pytest.raises(ValueError, match="billed_gb_s must be >= 0"):
        lambda_cost_usd(math.nan, 0)


def test_server_cost():
    assert server_cost_usd("c5.xlarge", 3600) == pytest.approx(0.17)
    assert server_cost_usd("p3.2xlarge", 1800, count=4) == pytest.approx(2 * 3.06)
    with pytest.raises(ConfigError,
                       match=r"unknown instance type 'c9.huge'.*c5\.xlarge.*g5\.xlarge"):
        server_cost_usd("c9.huge", 10)
    with pytest.raises(ValueError, match="count must be >= 0"):
        server_cost_usd("c5.xlarge", 10, count=-1)


def test_custom_price_table():
    prices = PriceTable(region="test-1", as_of="2000-01", source="made up",
                        lambda_gb_s_usd={"x86_64": 1.0}, lambda_request_usd=0.5,
                        ec2_hour_usd={"box": 36.0})
    assert lambda_cost_usd(2.0, 4, prices) == 2.0 + 2.0
    assert server_cost_usd("box", 100, 2, prices) == pytest.approx(2.0)


def test_value_is_inverse_of_time_times_cost():
    assert value(10.0, 0.5) == pytest.approx(0.2)
    # Half the time at the same cost is twice the value.
    assert value(5.0, 0.5) == pytest.approx(2 * value(10.0, 0.5))
    for seconds, dollars in ((0, 1), (1, 0), (-1, 1)):
        with pytest.raises(ValueError, match="positive time and cost"):
            value(seconds, dollars)


def test_cost_of_emulator_stats():
    """The emulator's counters feed lambda_cost_usd directly."""
    stats = {"billed_ms": 1500, "invocations": 3, "memory_mb": 2048}
    billed_gb_s = stats["billed_ms"] / 1000 * stats["memory_mb"] / 1024  # 3 GB-s
    assert lambda_cost_usd(billed_gb_s, stats["invocations"]) == pytest.approx(
        3 * 0.0000166667 + 3 * 0.20 / 1e6)
