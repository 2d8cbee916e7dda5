"""Seeded fault injection: FaultPlan's draw, and each fault kind through the HTTP API."""

from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import boto3
import pytest
from botocore.config import Config

from dorylus.emulator.faults import FAULT_KINDS, FaultPlan
from dorylus.emulator.server import add_arguments, faults_from_args, serve
from dorylus.errors import ConfigError

from .test_server import CLIENT_KW, CODE_DIR, H, boto_client

N = 10_000


def payload(task: int, attempt: int = 0) -> bytes:
    return json.dumps({"task": task, "attempt": attempt, "seconds": 0.1}).encode()


# -- FaultPlan ---------------------------------------------------------------------------------

def test_choose_is_deterministic_and_seeded():
    plan = FaultPlan(raise_fraction=0.1, crash_fraction=0.1, hang_fraction=0.1,
                     straggle_fraction=0.1, seed=7)
    first = [plan.choose(payload(i)) for i in range(500)]
    assert first == [FaultPlan(**vars(plan)).choose(payload(i)) for i in range(500)]
    assert set(first) == {None, *FAULT_KINDS}
    other_seed = [FaultPlan(**{**vars(plan), "seed": 8}).choose(payload(i)) for i in range(500)]
    assert other_seed != first


def test_choose_respects_the_fractions():
    fractions = {"raise": 0.05, "crash": 0.1, "hang": 0.02, "straggle": 0.2}
    plan = FaultPlan(**{f"{kind}_fraction": value for kind, value in fractions.items()}, seed=1)
    chosen = [plan.choose(payload(i)) for i in range(N)]
    for kind, fraction in fractions.items():
        assert chosen.count(kind) / N == pytest.approx(fraction, abs=0.01), kind
    assert chosen.count(None) / N == pytest.approx(1 - sum(fractions.values()), abs=0.015)
    everything = FaultPlan(crash_fraction=1.0)
    assert {everything.choose(payload(i)) for i in range(100)} == {"crash"}


def test_attempts_get_independent_draws():
    plan = FaultPlan(raise_fraction=0.3, seed=3)
    first = [plan.choose(payload(i, attempt=0)) == "raise" for i in range(N)]
    second = [plan.choose(payload(i, attempt=1)) == "raise" for i in range(N)]
    failed_first = [b for a, b in zip(first, second) if a]
    assert len(failed_first) / N == pytest.approx(0.3, abs=0.02)
    # A relaunch of a call that failed fails again with the base rate, not always.
    assert sum(failed_first) / len(failed_first) == pytest.approx(0.3, abs=0.04)


def test_an_all_zero_plan_costs_nothing(monkeypatch):
    plan = FaultPlan(seed=5)
    assert not plan.active

    def no_hashing(self, payload):
        raise AssertionError("an inactive plan must not hash")

    monkeypatch.setattr(FaultPlan, "draw", no_hashing)
    assert all(plan.choose(payload(i)) is None for i in range(100))


@pytest.mark.parametrize("kwargs, message", [
    ({"raise_fraction": -0.1}, "raise_fraction must be a number in [0, 1]"),
    ({"hang_fraction": 1.5}, "hang_fraction must be a number in [0, 1]"),
    ({"crash_fraction": 0.6, "straggle_fraction": 0.6}, "sum to 1.2, more than 1"),
    ({"straggle_factor": 0.5}, "straggle_factor must be a finite number >= 1"),
    ({"seed": 1.5}, "seed must be an integer"),
])
def test_bad_plans_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FaultPlan(**kwargs)


# -- through the HTTP API ---------------------------------------------------------------------

PLAN = FaultPlan(raise_fraction=0.2, crash_fraction=0.2, hang_fraction=0.2,
                 straggle_fraction=0.2, straggle_factor=4.0, seed=11)


def payload_for(kind: str | None) -> bytes:
    """The first task payload to which PLAN gives ``kind``."""
    return next(p for p in map(payload, range(1000)) if PLAN.choose(p) == kind)


@pytest.fixture(scope="module")
def faulty():
    with serve(functions={"sleep": f"{H}:sleep"}, concurrency=2, memory_mb=512, timeout_s=1.0,
               code_dirs=[CODE_DIR], faults=PLAN) as server:
        yield server


@pytest.fixture
def client(faulty):
    client = boto_client(faulty)
    client.invoke(FunctionName="sleep", Payload=payload_for(None))  # both imports done
    faulty.reset_stats()
    yield client
    client.close()


def call(client, kind: str | None) -> tuple[dict, dict, float]:
    start = time.monotonic()
    r = client.invoke(FunctionName="sleep", Payload=payload_for(kind))
    wall = time.monotonic() - start
    return r, json.loads(r["Payload"].read()), wall


def test_injected_raise_is_a_function_error(faulty, client):
    r, body, _ = call(client, "raise")
    assert r["FunctionError"] == "Unhandled"
    assert body["errorType"] == "InjectedFault" and "injected" in body["errorMessage"]
    assert r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-fault"] == "raise"
    stats = faulty.stats()
    assert stats["faults.raise"] == 1 and stats["errors"] == 1
    assert stats["fault_plan"]["seed"] == 11


def test_injected_crash_is_an_exit_error_and_the_pool_serves_on(faulty, client):
    r, body, _ = call(client, "crash")
    assert r["FunctionError"] == "Unhandled"
    assert body["errorType"] == "Runtime.ExitError" and "injected" in body["errorMessage"]
    r, body, _ = call(client, None)
    assert "FunctionError" not in r and body == {"slept": 0.1}
    assert "x-dorylus-fault" not in r["ResponseMetadata"]["HTTPHeaders"]
    stats = faulty.stats()
    assert stats["faults.crash"] == 1 and stats["errors"] == 1 and stats["invocations"] == 2


def test_injected_hang_times_out(faulty, client):
    r, body, wall = call(client, "hang")
    assert r["FunctionError"] == "Unhandled" and body["errorType"] == "Sandbox.Timedout"
    assert wall >= 1.0 and r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-billed-ms"] == "1000"
    assert faulty.stats()["faults.hang"] == 1
    r, body, _ = call(client, None)
    assert body == {"slept": 0.1}


def test_injected_straggler_is_slower_by_the_factor(faulty, client):
    r, body, wall = call(client, "straggle")
    assert "FunctionError" not in r and body == {"slept": 0.1}
    duration_ms = float(r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-duration-ms"])
    assert 0.9 * 400 <= duration_ms < 1000 and wall >= 0.36  # 0.1 s handler, factor 4
    stats = faulty.stats()
    assert stats["faults.straggle"] == 1 and stats["errors"] == 0
    assert {k: v for k, v in stats.items() if k.startswith("faults.")} == {
        "faults.raise": 0, "faults.crash": 0, "faults.hang": 0, "faults.straggle": 1}


def test_no_plan_means_no_fault_counters_move():
    with serve(functions={"sleep": f"{H}:sleep"}, concurrency=1, memory_mb=128, timeout_s=5,
               code_dirs=[CODE_DIR], faults=FaultPlan()) as server:
        client = boto_client(server)
        for task in range(5):
            r = client.invoke(FunctionName="sleep",
                              Payload=json.dumps({"task": task, "seconds": 0}))
            assert "FunctionError" not in r
        stats = server.stats()
        assert [stats[f"faults.{kind}"] for kind in FAULT_KINDS] == [0, 0, 0, 0]
        assert stats["invocations"] == 5 and stats["fault_plan"]["raise_fraction"] == 0


# -- CLI ---------------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fault_options():
    assert faults_from_args(parse()) is None
    assert faults_from_args(parse("--fault-seed", "3")) is None  # nothing to inject
    assert faults_from_args(parse("--fault-raise", "0.1", "--fault-crash", "0.2",
                                  "--fault-hang", "0.05", "--fault-straggle", "0.3",
                                  "--fault-straggle-factor", "5", "--fault-seed", "9")) == \
        FaultPlan(0.1, 0.2, 0.05, 0.3, 5.0, 9)


@pytest.mark.parametrize("argv, message", [
    (("--fault-raise", "1.5"), "--fault-raise must be a fraction in [0, 1], got 1.5"),
    (("--fault-hang", "-0.1"), "--fault-hang must be a fraction in [0, 1], got -0.1"),
    (("--fault-crash", "0.7", "--fault-straggle", "0.7"),
     "--fault-raise, --fault-crash, --fault-hang and --fault-straggle sum to 1.4; they must "
     "sum to at most 1"),
    (("--fault-straggle", "0.1", "--fault-straggle-factor", "0.5"),
     "--fault-straggle-factor must be a finite number >= 1, got 0.5"),
])
def test_bad_fault_options_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        faults_from_args(parse(*argv))


def test_cli_with_physics_and_faults():
    code = ("import argparse, sys\n"
            "from dorylus.emulator.server import add_arguments, run_from_args\n"
            "parser = argparse.ArgumentParser()\nadd_arguments(parser)\n"
            "sys.exit(run_from_args(parser.parse_args(sys.argv[1:])))\n")
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--port", "0", "--concurrency", "1", "--memory-mb", "256",
         "--function", f"sleep={H}:sleep", "--code-dir", CODE_DIR, "--aws-like",
         "--start-latency-ms", "0", "--cold-start-ms", "50", "--bandwidth-mbps", "80",
         "--fault-raise", "1", "--fault-seed", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(process.stderr.readline()), daemon=True).start()
        line = lines.get(timeout=30)
        url = re.search(r"http://\S+", line).group(0)
        client = boto3.client("lambda", endpoint_url=url, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 0}), **CLIENT_KW)
        r = client.invoke(FunctionName="sleep", Payload=payload(0))
        assert json.loads(r["Payload"].read())["errorType"] == "InjectedFault"
        with urllib.request.urlopen(f"{url}/emulator/stats", timeout=5) as response:
            stats = json.loads(response.read())
        assert stats["faults.raise"] == 1 and stats["cold_starts"] == 1
        assert stats["physics"] == {"start_latency_ms": 0.0, "cold_start_ms": 50.0,
                                    "keep_warm_s": 600.0, "bandwidth_mbps": 80.0,
                                    "cpu_share": True}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()
