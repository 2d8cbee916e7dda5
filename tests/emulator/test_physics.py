"""Emulator physics: cold and warm starts, CPU share, bandwidth on the context, CLI options."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import math
import re
import time

import pytest

from dorylus.emulator.physics import AWS_LIKE, MB_PER_VCPU, Physics, cpu_stretch_s
from dorylus.emulator.server import add_arguments, physics_from_args, serve
from dorylus.errors import ConfigError

from .test_server import CODE_DIR, H, boto_client


def invoke(client, function: str, event=None, **kwargs) -> tuple[dict, object, float]:
    """-> (emulator headers, decoded payload, client wall seconds)."""
    start = time.monotonic()
    r = client.invoke(FunctionName=function, Payload=json.dumps(event or {}), **kwargs)
    wall = time.monotonic() - start
    return r, json.loads(r["Payload"].read()), wall


def headers(response) -> dict:
    return response["ResponseMetadata"]["HTTPHeaders"]


# -- Physics itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("start_latency_ms", -1), ("cold_start_ms", -0.5), ("keep_warm_s", -1),
    ("bandwidth_mbps", -10), ("cold_start_ms", math.nan), ("keep_warm_s", math.inf),
    ("bandwidth_mbps", "fast"), ("cpu_share", 1),
])
def test_bad_physics_is_a_value_error(field, value):
    with pytest.raises(ValueError, match=f"physics: {field} must be"):
        Physics(**{field: value})


def test_physics_derived_figures():
    assert Physics().bandwidth_bytes_per_s is None
    assert Physics(bandwidth_mbps=8).bandwidth_bytes_per_s == 1e6
    assert Physics().vcpus(1024) is None
    assert Physics(cpu_share=True).vcpus(MB_PER_VCPU) == 1.0
    assert Physics(cpu_share=True).vcpus(885) == pytest.approx(0.5, abs=1e-3)
    assert Physics(cpu_share=True).vcpus(10240) == pytest.approx(10240 / 1769)
    assert Physics(cpu_share=True).vcpus(20000) == 6.0
    assert AWS_LIKE.cpu_share and AWS_LIKE.cold_start_ms > AWS_LIKE.start_latency_ms > 0
    assert 300 <= AWS_LIKE.cold_start_ms <= 1000 and 500 <= AWS_LIKE.bandwidth_mbps <= 600
    assert 300 <= AWS_LIKE.keep_warm_s <= 900


def test_cpu_stretch():
    assert cpu_stretch_s(1.0, 1.0, None) == 0.0
    assert cpu_stretch_s(1.0, 1.0, 0.5) == pytest.approx(1.0)  # single thread at half a vCPU
    assert cpu_stretch_s(0.2, 1.0, 0.5) == pytest.approx(0.2)  # mostly waiting: its CPU part
    assert cpu_stretch_s(1.0, 1.0, 1.5) == 0.0  # more than it used: cannot speed up
    assert cpu_stretch_s(4.0, 1.0, 2.0) == pytest.approx(1.0)  # 4 threads on 2 vCPUs: 2 s
    assert cpu_stretch_s(0.0, 1.0, 0.25) == 0.0


# -- through the HTTP API ---------------------------------------------------------------------

def test_cold_then_warm_then_cold_after_keep_warm():
    physics = Physics(cold_start_ms=300, keep_warm_s=0.5)
    with serve(functions={"noop": f"{H}:noop"}, concurrency=2, memory_mb=128, timeout_s=5,
               code_dirs=[CODE_DIR], physics=physics) as server:
        client = boto_client(server)
        cold, _, cold_wall = invoke(client, "noop", LogType="Tail")
        warm, _, warm_wall = invoke(client, "noop")  # same worker, just used: warm
        assert headers(cold)["x-dorylus-cold-start"] == "true"
        assert headers(warm)["x-dorylus-cold-start"] == "false"
        assert cold_wall >= 0.3 and int(headers(cold)["x-dorylus-billed-ms"]) >= 300  # billed
        assert "Init Duration: " in base64.b64decode(cold["LogResult"]).decode()
        assert int(headers(warm)["x-dorylus-billed-ms"]) < 200 and warm_wall < cold_wall
        assert server.stats()["cold_starts"] == 1
        time.sleep(0.7)  # past keep_warm_s: the sandbox has gone cold
        again, _, again_wall = invoke(client, "noop")
        assert headers(again)["x-dorylus-cold-start"] == "true"
        assert again_wall >= 0.3 and int(headers(again)["x-dorylus-billed-ms"]) >= 300
        stats = server.stats()
        assert stats["cold_starts"] == 2 and stats["invocations"] == 3
        assert stats["physics"] == dataclasses.asdict(physics)
        server.reset_stats()
        assert server.stats()["cold_starts"] == 0


def test_overlapping_calls_start_cold_on_fresh_workers():
    """Two calls in flight at once need two sandboxes: both are cold starts."""
    with serve(functions={"sleep": f"{H}:sleep"}, concurrency=2, memory_mb=128, timeout_s=5,
               code_dirs=[CODE_DIR], physics=Physics(cold_start_ms=100)) as server:
        client = boto_client(server)
        for _ in range(2):
            client.invoke(FunctionName="sleep", InvocationType="Event",
                          Payload=json.dumps({"seconds": 0.3}))
        deadline = time.monotonic() + 10
        while server.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats()["cold_starts"] == 2
        r, _, _ = invoke(client, "sleep", {"seconds": 0})
        assert headers(r)["x-dorylus-cold-start"] == "false"


@pytest.fixture(scope="module")
def half_vcpu():
    """885 MB buys half a vCPU."""
    with serve(functions={"spin": f"{H}:spin"}, concurrency=1, memory_mb=885, timeout_s=10,
               code_dirs=[CODE_DIR], physics=Physics(cpu_share=True)) as server:
        yield server


def test_cpu_share_stretches_cpu_bound_calls(half_vcpu):
    client = boto_client(half_vcpu)
    invoke(client, "spin", {"cpu_s": 0.01})  # the import, outside the measured call
    r, run, _ = invoke(client, "spin", {"cpu_s": 0.3})
    duration_s = float(headers(r)["x-dorylus-duration-ms"]) / 1000
    share = 885 / 1769
    expected_stretch = run["cpu_s"] * (1 / share - 1)  # ~ the CPU time again
    assert duration_s >= 1.6 * run["cpu_s"]
    assert duration_s >= run["wall_s"] + 0.95 * expected_stretch
    assert duration_s <= run["wall_s"] + expected_stretch + 0.5
    assert int(headers(r)["x-dorylus-billed-ms"]) >= 1000 * duration_s  # the stretch is billed


def test_cpu_share_of_a_vcpu_or_more_does_not_stretch():
    with serve(functions={"spin": f"{H}:spin"}, concurrency=1, memory_mb=1769, timeout_s=10,
               code_dirs=[CODE_DIR], physics=Physics(cpu_share=True)) as server:
        client = boto_client(server)
        invoke(client, "spin", {"cpu_s": 0.01})
        r, run, _ = invoke(client, "spin", {"cpu_s": 0.2})
        duration_s = float(headers(r)["x-dorylus-duration-ms"]) / 1000
        assert duration_s < run["wall_s"] + 0.1


def test_bandwidth_is_on_the_context_and_physics_wins_over_start_latency():
    functions = {"bandwidth": f"{H}:bandwidth"}
    with serve(functions=functions, concurrency=1, memory_mb=128, timeout_s=5,
               code_dirs=[CODE_DIR], start_latency_ms=2000,
               physics=Physics(bandwidth_mbps=8)) as server:
        client = boto_client(server)
        _, value, wall = invoke(client, "bandwidth")
        assert value == 1e6  # 8 Mbit/s in bytes/s
        assert wall < 2 and server.stats()["start_latency_ms"] == 0  # physics wins
    with serve(functions=functions, concurrency=1, memory_mb=128, timeout_s=5,
               code_dirs=[CODE_DIR]) as server:
        _, value, _ = invoke(boto_client(server), "bandwidth")
        assert value is None


# -- CLI ---------------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_physics_options():
    assert physics_from_args(parse()) == Physics()
    assert physics_from_args(parse("--start-latency-ms", "5")) == Physics(start_latency_ms=5)
    assert physics_from_args(parse("--aws-like")) == AWS_LIKE
    assert physics_from_args(parse("--aws-like", "--cold-start-ms", "0", "--no-cpu-share")) == \
        dataclasses.replace(AWS_LIKE, cold_start_ms=0, cpu_share=False)
    assert physics_from_args(parse("--cold-start-ms", "300", "--keep-warm-s", "1",
                                   "--bandwidth-mbps", "100", "--cpu-share")) == \
        Physics(cold_start_ms=300, keep_warm_s=1, bandwidth_mbps=100, cpu_share=True)


@pytest.mark.parametrize("argv, message", [
    (("--cold-start-ms", "-1"), "--cold-start-ms must be a finite number >= 0, got -1"),
    (("--keep-warm-s", "inf"), "--keep-warm-s must be a finite number >= 0, got inf"),
    (("--bandwidth-mbps", "nan"), "--bandwidth-mbps must be a finite number >= 0, got nan"),
    (("--start-latency-ms", "-3"), "--start-latency-ms must be a finite number >= 0, got -3"),
])
def test_bad_physics_options_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        physics_from_args(parse(*argv))
