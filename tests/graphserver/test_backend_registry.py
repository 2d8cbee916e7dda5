"""What each registered backend owns at the run level (graphserver.backends.RunBackend): its config
checks, its machine checks, its local services, its cluster target and its pricing facts, read
through the registry by the config, the trainer, the coordinator and the planner."""

from __future__ import annotations

import json
import sys
import urllib.request
from types import SimpleNamespace

import pytest

from dorylus.config import TrainConfig
from dorylus.cost import Pricing
from dorylus.errors import ConfigError
from graphserver.backends import BACKENDS, Backend, RunBackend, backend_class, make_backend, make_state


def test_every_name_is_a_run_backend_and_only_reference_lacks_graph_servers():
    classes = {name: backend_class(name) for name in BACKENDS}
    assert all(issubclass(cls, RunBackend) for cls in classes.values())
    assert {name for name, cls in classes.items() if not cls.graph_servers} == {"reference"}
    assert all(issubclass(cls, Backend) for name, cls in classes.items() if cls.graph_servers)
    assert not issubclass(classes["reference"], Backend)
    with pytest.raises(ValueError, match="backend 'reference' runs no graph server"):
        make_backend("reference", None, concurrency=1)
    with pytest.raises(ValueError, match="backend 'reference' runs no graph server"):
        make_state(TrainConfig(backend="reference"), None, None, parts=1)


def test_the_config_asks_only_its_own_backend_about_that_backends_options():
    # lambda's limits bind the lambda backend, not a cpu run that carries the options unused
    with pytest.raises(ConfigError, match="task_timeout_s must be <= 900 with the lambda backend"):
        TrainConfig(backend="lambda", task_timeout_s=1000.0)
    assert TrainConfig(backend="cpu", task_timeout_s=1000.0).task_timeout_s == 1000.0
    with pytest.raises(ConfigError, match="fault fractions must be in"):
        TrainConfig(backend="lambda", fault_raise=0.7, fault_crash=0.7)
    with pytest.raises(ConfigError, match="device 'tpu' .* is not a torch device the gpu backend runs on"):
        TrainConfig(backend="gpu", device="tpu")
    with pytest.raises(ConfigError, match=r"gpu_memory_fraction must be in \(0, 1\], got 1.5"):
        TrainConfig(backend="gpu", device="cpu", gpu_memory_fraction=1.5)
    assert TrainConfig(backend="cpu", device="tpu").device == "tpu"  # the cpu backend has no device
    with pytest.raises(ConfigError, match="preempt needs graph servers; the reference backend has none"):
        TrainConfig(backend="reference", preempt="0@1")
    assert TrainConfig(backend="cpu", preempt="0@1", epochs=2).preemptions() == [(0, 1)]


def test_machine_checks_are_the_backends(monkeypatch):
    with pytest.raises(ConfigError, match="function_handler 'nosuchmodule:handler' does not import"):
        TrainConfig(backend="lambda", function_handler="nosuchmodule:handler").check_machine()
    # a cpu run does not import a handler it never calls
    TrainConfig(backend="cpu", function_handler="nosuchmodule:handler").check_machine()
    from graphserver.backends import serverless

    monkeypatch.setattr(serverless, "local_worker_capacity", lambda: (9, "faked"))
    with pytest.raises(ConfigError, match=r"--functions 4 needs 2 x \(4 \+ 1\) = 10 emulator workers, more than "
                                          r"this machine can start \(9: faked\); use --functions 3 or fewer"):
        TrainConfig(backend="lambda", functions=4, intervals=4).check_machine(parts=2)
    TrainConfig(backend="lambda", functions=3, intervals=4).check_machine(parts=2)  # 8 fit


def test_pricing_facts_come_from_the_backend():
    assert {name: backend_class(name).graph_server_instance for name in BACKENDS} == {
        "lambda": "c5.2xlarge", "cpu": "c5.2xlarge", "gpu": "p3.2xlarge", "reference": "c5.2xlarge"}
    assert [name for name in BACKENDS if backend_class(name).calls_functions] == ["lambda"]
    assert [name for name in BACKENDS if backend_class(name).device == "gpu"] == ["gpu"]
    lam = Pricing.of_run(TrainConfig(backend="lambda", lambda_memory_mb=2048), parts=2)
    cpu = Pricing.of_run(TrainConfig(backend="cpu", lambda_memory_mb=2048), parts=2)
    assert lam.to_dict()["functions"]["memory_mb"] == 2048 and cpu.to_dict()["functions"] is None
    machine = SimpleNamespace(vcpus=8)
    assert {name: backend_class(name).scale_intervals(machine) for name in ("lambda", "cpu", "gpu")} == {
        "lambda": 1, "cpu": 8, "gpu": 1}


def test_cluster_target_names_the_function_for_lambda_only():
    def spec(endpoint):
        return SimpleNamespace(region="eu-west-1", function=SimpleNamespace(name="f", endpoint_url=endpoint))

    assert backend_class("lambda").cluster_target(spec(None)) == {"function_name": "f", "region": "eu-west-1"}
    assert backend_class("lambda").cluster_target(spec("http://127.0.0.1:1")) == {
        "function_name": "f", "region": "eu-west-1", "lambda_endpoint": "http://127.0.0.1:1"}
    assert backend_class("cpu").cluster_target(spec(None)) == {}


def test_only_the_lambda_backend_starts_local_services():
    with backend_class("cpu").local_services(TrainConfig(backend="cpu"), parts=2) as services:
        assert services.graph_server_args == [] and services.stats() == {}


def test_the_lambda_backends_local_services_are_an_emulator_the_graph_servers_reach(tmp_path):
    """The emulator serves the config's handler under the function's name with a worker per call
    in flight (one more per server), answers invokes, and is gone when the context exits."""
    config = TrainConfig(backend="lambda", function_handler="tests.emulator.handlers:echo", intervals=1,
                         lambda_memory_mb=512)
    with backend_class("lambda").local_services(config, parts=2) as services:
        args = services.graph_server_args
        assert args[0] == "--lambda-endpoint" and args[2] == "--function-name"
        url, name = args[1], args[3]
        request = urllib.request.Request(f"{url}/2015-03-31/functions/{name}/invocations",
                                         data=json.dumps({"x": 1}).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["event"] == {"x": 1}
        stats = services.stats()
        assert stats["invocations"] == 1 and stats["concurrency"] == 2 * (1 + 1) and stats["memory_mb"] == 512
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/2015-03-31/functions/{name}/invocations", data=b"{}", timeout=5)


def test_config_and_planner_import_no_torch(tmp_path):
    """The registry's modules are light: validating a config of every backend (gpu's included:
    its device-side module, graphserver.backends.gpu_device, is the graph server's), pricing it,
    a gpu run's machine check on torch's CPU device, and `dorylus plan`'s table at scale and its
    local predictions (gpu's from a calibration taken with a GPU) load no torch: the coordinator,
    the parameter server and the planner never need it."""
    import dataclasses
    import subprocess

    from tests.plan.test_command import CAL

    calibration = tmp_path / "cal.json"
    dataclasses.replace(CAL, gpu=CAL.cpu, gpu_name="NVIDIA H100 80GB HBM3").save(calibration)
    code = ("import contextlib, io, sys\nfrom dorylus.cli import main\nfrom dorylus.config import TrainConfig\n"
            "from dorylus.cost import Pricing\n"
            f"for b in {tuple(BACKENDS)!r}:\n"
            "    Pricing.of_run(TrainConfig(backend=b), parts=2)\n"
            "TrainConfig(backend='gpu', device='cpu').check_machine()\n"
            "checked = 'torch' in sys.modules\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"    assert main(['plan', '--calibration', {str(calibration)!r}]) == 0\n"
            f"    assert main(['plan', '--calibration', {str(calibration)!r}, '--dataset', 'synthetic-1m',\n"
            "                 '--backend', 'gpu', '--backend', 'lambda']) == 0\n"
            "assert 'gpu      2' in out.getvalue(), out.getvalue()\n"
            "print(checked, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
