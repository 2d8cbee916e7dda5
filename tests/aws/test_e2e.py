"""The opt-in end-to-end tier: the Terraform example on a real AWS account, Cora in cluster mode.

    DORYLUS_AWS_E2E=1 pytest -m aws

Skipped (with the reason) unless AWS credentials are present, ``DORYLUS_AWS_E2E=1`` opts in,
and terraform, PyPI access (for the function's wheels) and ../shared/data/cora.npz are there.
The default suite (``-m 'not slow and not aws'``) and ``-m slow`` never select it.

What it does, in a temporary directory, each step with a timeout: builds the two artifacts
(``dorylus package-lambda``, the project wheel) and CURVE keys (``dorylus keys``), applies a copy
of ``terraform/examples`` under a unique name and bucket, partitions Cora into two parts and
uploads them, runs ``dorylus train --cluster`` for three epochs on the first parameter server
(through SSM Run Command: the servers have private addresses only) and compares its per-epoch
metrics with a local run of the same config on the same partitions. ``terraform destroy`` runs
whatever happens, and a failed destroy fails the test loudly with the state directory to clean
up by hand. It costs about $0.30 (the example's $0.92/h for 15-25 minutes).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dorylus.config import TrainConfig
from dorylus.runs import read_metrics
from tests.graphs import SHARED_DATA

CORA = SHARED_DATA / "cora.npz"

pytestmark = pytest.mark.aws

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 3
TRAIN_CONFIG = {"model": "gcn", "layers": 2, "hidden": 16, "backend": "lambda", "intervals": 2,
                "task_timeout_s": 300.0}
APPLY_S, DESTROY_S, BOOT_S, TRAIN_S = 1800, 1800, 1500, 1800


def _why_not() -> str | None:
    if os.environ.get("DORYLUS_AWS_E2E") != "1":
        return "the AWS tier deploys real resources (about $0.30): set DORYLUS_AWS_E2E=1 to opt in"
    try:
        import boto3

        if boto3.Session().get_credentials() is None:
            return "no AWS credentials (environment, ~/.aws or an instance role)"
    except Exception as exc:  # a broken profile is "no credentials" here
        return f"no usable AWS credentials: {exc}"
    if shutil.which("terraform") is None:
        return "terraform is not on PATH"
    if not CORA.is_file():
        return f"Cora is not present at {CORA}"
    return None


def _run(args: list[str], timeout: float, cwd: Path | None = None) -> str:
    result = subprocess.run(args, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _dorylus(*args: str, timeout: float = 900) -> str:
    return _run([sys.executable, "-m", "dorylus.cli", *args], timeout)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """The example applied under a unique name; destroyed at the end, always."""
    why = _why_not()
    if why:
        pytest.skip(why)
    import boto3

    work = tmp_path_factory.mktemp("aws")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    tag = uuid.uuid4().hex[:8]
    dist = work / "dist"
    _dorylus("package-lambda", "--out", str(dist / "function.zip"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(REPO)], 900)
    wheel = next(dist.glob("dorylus-*.whl"))
    _dorylus("keys", "--out", str(work / "keys"))

    tf = work / "terraform"
    tf.mkdir()
    for name in ("main.tf", "variables.tf"):
        text = (REPO / "terraform" / "examples" / name).read_text()
        (tf / name).write_text(text.replace('source = "../"', f'source = "{REPO / "terraform"}"'))
    (tf / "e2e.auto.tfvars.json").write_text(json.dumps({
        "region": region, "name": f"dorylus-e2e-{tag}", "bucket_name": f"dorylus-e2e-{tag}-{region}",
        "store_prefix": "stores/cora-2", "force_destroy_bucket": True, "function_zip": str(dist / "function.zip"),
        "dorylus_wheel": str(wheel), "train_config": TRAIN_CONFIG,
    }))
    shutil.copy(work / "keys" / "curve.tfvars.json", tf / "curve.auto.tfvars.json")
    terraform = ["terraform", f"-chdir={tf}"]
    try:
        _run([*terraform, "init", "-input=false", "-no-color"], 600)
        _run([*terraform, "apply", "-input=false", "-no-color", "-auto-approve"], APPLY_S)
        outputs = json.loads(_run([*terraform, "output", "-json"], 120))
        cluster = outputs["cluster"]["value"]
        (work / "cluster.json").write_text(json.dumps(cluster))
        yield {"work": work, "region": region, "cluster": cluster, "store_url": outputs["store_url"]["value"],
               "coordinator": outputs["coordinator_instance_id"]["value"], "ssm": boto3.client("ssm", region_name=region)}
    finally:
        result = subprocess.run([*terraform, "destroy", "-input=false", "-no-color", "-auto-approve"],
                                capture_output=True, text=True, timeout=DESTROY_S)
        assert result.returncode == 0, (f"terraform destroy failed: resources may still bill. Destroy them by hand "
                                        f"from {tf} (its state is there):\n{result.stderr[-3000:]}")


def _on_coordinator(deployed, script: str, timeout_s: float) -> str:
    """Run ``script`` on the first parameter server through SSM Run Command; its stdout."""
    ssm, instance = deployed["ssm"], deployed["coordinator"]
    deadline = time.monotonic() + BOOT_S
    while not ssm.describe_instance_information(
            Filters=[{"Key": "InstanceIds", "Values": [instance]}])["InstanceInformationList"]:
        assert time.monotonic() < deadline, f"{instance} never registered with SSM"
        time.sleep(15)
    command = ssm.send_command(InstanceIds=[instance], DocumentName="AWS-RunShellScript",
                               Parameters={"commands": [script], "executionTimeout": [str(int(timeout_s))]},
                               TimeoutSeconds=600)["Command"]["CommandId"]
    deadline = time.monotonic() + timeout_s + 120
    while True:
        time.sleep(15)
        try:
            result = ssm.get_command_invocation(CommandId=command, InstanceId=instance)
        except ssm.exceptions.InvocationDoesNotExist:
            continue
        if result["Status"] not in ("Pending", "InProgress", "Delayed"):
            break
        assert time.monotonic() < deadline, "the command on the coordinator did not finish"
    assert result["Status"] == "Success", result["StandardErrorContent"][-3000:]
    return result["StandardOutputContent"]


def test_cora_trains_in_cluster_mode_like_local_mode(deployed):
    work = deployed["work"]
    store = work / "cora-2"
    _dorylus("partition", "--dataset", str(CORA), "--parts", "2", "--out", str(store))
    _dorylus("upload", str(store), deployed["store_url"])

    # The servers have been waiting for the store (systemd restarts them every 30 s until it is
    # there); the coordinator waits for them and reads its keys from SSM.
    run = "/var/lib/dorylus/runs/e2e"
    out = _on_coordinator(deployed, (
        f"cd /var/lib/dorylus && sudo -u dorylus env AWS_DEFAULT_REGION={deployed['region']} "
        f"DORYLUS_CACHE_DIR=/var/cache/dorylus /opt/dorylus/bin/dorylus train --cluster /etc/dorylus/cluster.json "
        f"--config /etc/dorylus/train.json --epochs {EPOCHS} --cluster-wait-s {BOOT_S} --run-dir {run} "
        f"&& echo METRICS && cat {run}/metrics.jsonl"), TRAIN_S)
    remote = [json.loads(line) for line in out.split("METRICS", 1)[1].strip().splitlines()]

    from dorylus.coordinator.training import run_training

    local = work / "local"
    config = TrainConfig.from_dict({**TRAIN_CONFIG, "epochs": EPOCHS, "partitions": str(store), "run_dir": str(local)})
    run_training(config, None, progress=io.StringIO())
    assert [m["epoch"] for m in remote] == list(range(1, EPOCHS + 1))
    for got, want in zip(remote, read_metrics(local)):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["epoch"]
        assert abs(got["test_acc"] - want["test_acc"]) * 1000 <= 1 + 1e-9  # Cora: 1,000 test vertices
        assert got["calls"] > 0  # the graph servers invoked the deployed function
