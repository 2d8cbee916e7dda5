"""Bad input to the role commands is one line on stderr and exit status 2, with nothing created;
Ctrl-C while the command imports its modules is one line and 130; ``--help`` does not import
torch. Every case runs the real command line in a subprocess."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dorylus import cli
from dorylus.data.loaders import save_npz
from dorylus.partition import assign_parts, write_store
from tests.graphs import random_graph

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TIMEOUT = 120  # seconds; a graph server imports torch before it binds


def run(tmp_path: Path, *args: str, module: str = "dorylus.cli") -> subprocess.CompletedProcess:
    # Run in tmp_path (empty but for what the test put there) so that any file the command creates shows.
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=tmp_path, env=ENV)


def assert_one_error(proc: subprocess.CompletedProcess, command: str, *needles: str) -> str:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dorylus {command}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0].lower(), lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-part store and a cpu-backend config file, outside every test's working directory."""
    root = tmp_path_factory.mktemp("store")
    graph = random_graph(num_nodes=40, num_edges=120)
    write_store(graph, assign_parts(graph.num_nodes, graph.src, graph.dst, 2, "random"), root / "parts",
                method="random", seed=0)
    config = root / "config.json"
    config.write_text(json.dumps({"backend": "cpu", "hidden": 4}))
    return root / "parts", config


def graphserver_args(store: tuple[Path, Path], **overrides: str) -> list[str]:
    options = {"--store": str(store[0]), "--part": "0", "--config": str(store[1]),
               "--param-server": "tcp://127.0.0.1:5", "--ready-file": "ready", **overrides}
    return [part for option, value in options.items() for part in (option, value)]


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_emulator_port_out_of_range(tmp_path, port):
    line = assert_one_error(run(tmp_path, "lambda-emulator", "--port", port), "lambda-emulator", "--port", port)
    assert "0-65535" in line
    assert not list(tmp_path.iterdir())


def test_emulator_port_in_use(tmp_path, busy_port):
    proc = run(tmp_path, "lambda-emulator", "--port", str(busy_port), "--concurrency", "1")
    assert_one_error(proc, "lambda-emulator", "cannot bind", str(busy_port), "address already in use")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["--bind", "--param-server"])
@pytest.mark.parametrize("module", ["dorylus.cli", "graphserver.server"])
def test_graphserver_bad_endpoint(tmp_path, module, option):
    # A missing store and config as well: the endpoint must be checked first, before any loading.
    args = graphserver_args((tmp_path / "no-store", tmp_path / "no-config.json"), **{option: "garbage"})
    if module == "dorylus.cli":
        args.insert(0, "graphserver")
    assert_one_error(run(tmp_path, *args, module=module), "graphserver", option, "'garbage'")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("module", ["dorylus.cli", "dorylus.paramserver"])
@pytest.mark.parametrize("endpoint", ["garbage", "tcp://127.0.0.1", "tcp://127.0.0.1:65536", "udp://1.2.3.4:5"])
def test_paramserver_bad_bind(tmp_path, module, endpoint):
    args = ["--num-features", "5", "--num-classes", "3", "--bind", endpoint, "--ready-file", "ready"]
    if module == "dorylus.cli":
        args.insert(0, "paramserver")
    assert_one_error(run(tmp_path, *args, module=module), "paramserver", "--bind", endpoint)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["--config", "--ready-file"])
def test_paramserver_missing_file_or_directory(tmp_path, option):
    missing = str(tmp_path / "no-dir" / "run.json")
    args = {"--num-features": "5", "--num-classes": "3", "--ready-file": "ready", option: missing}
    proc = run(tmp_path, "paramserver", *(part for item in args.items() for part in item))
    assert_one_error(proc, "paramserver", missing.lower())
    assert not list(tmp_path.iterdir())


def test_paramserver_port_in_use(tmp_path, busy_port):
    endpoint = f"tcp://127.0.0.1:{busy_port}"
    proc = run(tmp_path, "paramserver", "--num-features", "5", "--num-classes", "3", "--bind", endpoint,
               "--ready-file", "ready")
    assert_one_error(proc, "paramserver", f"cannot bind {endpoint}", "address already in use")
    assert not list(tmp_path.iterdir())


def test_graphserver_port_in_use(tmp_path, store, busy_port):
    endpoint = f"tcp://127.0.0.1:{busy_port}"
    proc = run(tmp_path, "graphserver", *graphserver_args(store, **{"--bind": endpoint}))
    assert_one_error(proc, "graphserver", f"cannot bind {endpoint}", "address already in use")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["store", "part", "config", "ready-file"])
def test_graphserver_bad_inputs(tmp_path, store, case):
    bad = {"store": {"--store": str(tmp_path / "no-store")},
           "part": {"--part": "2"},
           "config": {"--config": str(tmp_path / "no-config.json")},
           "ready-file": {"--ready-file": str(tmp_path / "no-dir" / "ready")}}[case]
    proc = run(tmp_path, "graphserver", *graphserver_args(store, **bad))
    # Each message names the offending value: the path, or the part number.
    assert_one_error(proc, "graphserver", "part 2" if case == "part" else next(iter(bad.values())).lower())
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("role", ["graphserver", "paramserver"])
@pytest.mark.parametrize("case", ["advertise", "port", "no-keys", "missing-secret"])
def test_server_bad_advertise_or_keys(tmp_path, store, role, case):
    keys = tmp_path.parent / f"{tmp_path.name}-keys"
    from dorylus.curve import write_keys

    write_keys(keys)
    (keys / f"{role}.secret").unlink()
    option, value, needle = {"advertise": ("--advertise", "0.0.0.0", "--advertise '0.0.0.0'"),
                             "port": ("--advertise", "10.0.0.1:70000", "port 70000"),
                             "no-keys": ("--keys", str(tmp_path / "nowhere"), str(tmp_path / "nowhere")),
                             "missing-secret": ("--keys", str(keys), f"{role}.secret does not exist")}[case]
    args = (graphserver_args(store, **{option: value}) if role == "graphserver" else
            ["--num-features", "5", "--num-classes", "3", "--ready-file", "ready", option, value])
    assert_one_error(run(tmp_path, role, *args), role, needle.lower())
    assert not list(tmp_path.iterdir())


def _mapped(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# Interrupt while the parser's modules import (numpy: before the command runs) and while the
# command's own imports run (libzmq: dorylus.coordinator.local's first, aiohttp's import follows; train
# imports torch only for the reference backend or a checkpoint). Waiting for the library to be
# mapped, rather than a fixed delay, puts the signal inside the import phase even on a loaded machine.
@pytest.mark.parametrize("library", ["_multiarray_umath", "libzmq"])
def test_ctrl_c_while_importing_is_one_line(tmp_path, library):
    data = tmp_path / "g.npz"
    save_npz(random_graph(), data)
    process = subprocess.Popen([sys.executable, "-m", "dorylus.cli", "train", "--dataset", str(data),
                                "--run-dir", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not _mapped(process.pid, library):
            assert process.poll() is None and time.monotonic() < deadline, f"{library} was never loaded"
            time.sleep(0.005)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert "Traceback" not in err + out and "Exception ignored" not in err, err
    assert process.returncode == 130, err
    assert err == "dorylus train: interrupted\n"


class _ImportingParser:
    """A parser whose modules' import meets Ctrl-C inside native code that turns the
    KeyboardInterrupt into ImportError (as numpy's PyCapsule_Import does)."""

    def __init__(self, ctrl_c: bool):
        self.ctrl_c = ctrl_c

    def parse_args(self, argv):
        try:
            if self.ctrl_c:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs before this returns
        except KeyboardInterrupt:
            raise ImportError('PyCapsule_Import could not import module "datetime"') from None
        raise ImportError("a real import error")


def test_an_interrupt_turned_into_import_error_is_still_one_line(monkeypatch, capsys):
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "build_parser", lambda *commands: _ImportingParser(ctrl_c=True))
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "dorylus train: interrupted\n"
    # Without Ctrl-C, an import error is not mistaken for one.
    monkeypatch.setattr(cli, "build_parser", lambda *commands: _ImportingParser(ctrl_c=False))
    with pytest.raises(ImportError, match="a real import error"):
        cli.main(["train"])
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def test_help_does_not_import_torch(tmp_path):
    code = ("import contextlib, io, sys\n"
            "from dorylus.cli import build_parser\n"
            "for command in ([], ['train'], ['partition'], ['graphserver'], ['paramserver'], ['lambda-emulator'],\n"
            "                ['keys']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        build_parser().parse_args([*command, '--help'])\n"
            "print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"



@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    """Asked in a subprocess (once), so that this module does not import torch for every test."""
    code = "import torch; print(torch.cuda.is_available())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                          env=ENV).stdout.strip() == "True"


@pytest.mark.parametrize("device, needles", [("cuda", ("--device", "cuda is not available", "--device cpu")),
                                             ("tpu", ("--device", "'tpu'", "'cuda', 'cuda:n' or 'cpu'"))])
def test_train_gpu_device_absent_or_unknown(tmp_path, device, needles):
    if device == "cuda" and _cuda_available():
        pytest.skip("checks the error of a machine without CUDA")
    data = tmp_path.parent / f"{tmp_path.name}-graph.npz"
    save_npz(random_graph(), data)
    proc = run(tmp_path, "train", "--dataset", str(data), "--backend", "gpu", "--device", device, "--epochs", "1")
    assert_one_error(proc, "train", *needles)
    assert not list(tmp_path.iterdir())


def test_graphserver_gpu_without_cuda(tmp_path, store):
    if _cuda_available():
        pytest.skip("checks the error of a machine without CUDA")
    config = tmp_path.parent / f"{tmp_path.name}-gpu.json"
    config.write_text(json.dumps({"backend": "gpu", "device": "cuda:0", "hidden": 4}))
    proc = run(tmp_path, "graphserver", *graphserver_args(store, **{"--config": str(config)}))
    assert_one_error(proc, "graphserver", "--device", "cuda is not available")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- train: bounds and data (issue 21)


def test_train_intervals_above_the_cap(tmp_path):
    from dorylus.config import MAX_INTERVALS

    proc = run(tmp_path, "train", "--dataset", "synthetic-small", "--backend", "cpu", "--intervals", "100000")
    assert_one_error(proc, "train", "intervals", str(MAX_INTERVALS), "100000")
    assert not list(tmp_path.iterdir())


def test_train_functions_above_lambdas_limit(tmp_path):
    proc = run(tmp_path, "train", "--dataset", "synthetic-small", "--functions", "5000")
    assert_one_error(proc, "train", "functions", "5000", "1000")
    assert not list(tmp_path.iterdir())


def test_train_functions_above_what_this_machine_can_start(tmp_path):
    from dorylus.config import MAX_FUNCTIONS
    from graphserver.backends.serverless import local_worker_capacity

    capacity, _ = local_worker_capacity()
    # 2 parts x (capacity + 1) workers: twice what fits. The capacity follows available memory,
    # which other processes move between this line and the command's own count (capacity / 2,
    # one more than fits, was accepted or named another capacity on a busy machine).
    functions = capacity
    if functions > MAX_FUNCTIONS:
        pytest.skip(f"this machine starts {capacity} workers: every allowed --functions fits")
    # A graph server never has more calls in flight than its intervals (graphserver.modes.calls_at_once):
    # as many intervals as functions, so that the functions count.
    proc = run(tmp_path, "train", "--dataset", "synthetic-small", "--backend", "lambda", "--parts", "2",
               "--intervals", str(functions), "--functions", str(functions))
    line = assert_one_error(proc, "train", f"--functions {functions}", "emulator workers")
    assert "more than this machine can start (" in line, line
    assert not list(tmp_path.iterdir())


@pytest.fixture
def locked_dir(tmp_path):
    """An empty directory nobody may write into. Permission bits do not bind root, so as root
    it is also made immutable (chattr +i); undone afterwards, so that pytest can remove it."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    immutable = False
    try:
        if os.geteuid() == 0:
            proc = subprocess.run(["chattr", "+i", str(locked)], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"running as root and chattr +i failed ({proc.stderr.strip()}): no directory here "
                            "is unwritable to root")
            immutable = True
        yield locked
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        locked.chmod(0o755)


@pytest.mark.parametrize("case", ["existing-empty", "to-create"])
def test_train_run_dir_not_writable(tmp_path, locked_dir, case):
    run_dir = locked_dir if case == "existing-empty" else locked_dir / "run"
    proc = run(tmp_path, "train", "--dataset", "synthetic-small", "--backend", "cpu", "--run-dir", str(run_dir))
    assert_one_error(proc, "train", "run directory", str(run_dir).lower(), "not writable")
    assert not list(locked_dir.iterdir()) and [p.name for p in tmp_path.iterdir()] == ["locked"]


@pytest.fixture(scope="module")
def bad_label_store(tmp_path_factory) -> tuple[Path, int]:
    """A store whose part 1 has a label equal to num_classes on a train vertex; meta.json's
    checksums are updated, so the store verifies and only the label check can find it."""
    import hashlib

    import numpy as np

    root = tmp_path_factory.mktemp("bad-labels")
    graph = random_graph(num_nodes=40, num_edges=120)
    write_store(graph, assign_parts(graph.num_nodes, graph.src, graph.dst, 2, "contiguous"), root / "parts",
                method="contiguous", seed=0)
    store = root / "parts"
    meta = json.loads((store / "meta.json").read_text())
    labels_file = next(rel for rel in meta["files"] if rel.startswith("part-1/") and "labels" in rel)
    train = np.load(store / labels_file.replace("labels", "train_mask"))
    labels = np.load(store / labels_file)
    row = int(np.flatnonzero(train)[0])
    labels[row] = meta["num_classes"]
    np.save(store / labels_file, labels)
    meta["files"][labels_file] = hashlib.sha256((store / labels_file).read_bytes()).hexdigest()
    (store / "meta.json").write_text(json.dumps(meta))
    return store, meta["num_classes"]


def test_inspect_reports_labels_out_of_range(tmp_path, bad_label_store):
    store, classes = bad_label_store
    proc = run(tmp_path, "inspect", str(store))
    assert_one_error(proc, "inspect", "part 1", f"outside [0, {classes})")


def test_train_refuses_labels_out_of_range_before_the_run_directory(tmp_path, bad_label_store):
    store, classes = bad_label_store
    proc = run(tmp_path, "train", "--partitions", str(store), "--backend", "cpu", "--run-dir", "run")
    assert_one_error(proc, "train", "part 1", f"outside [0, {classes})", str(classes))
    assert not list(tmp_path.iterdir())


def test_inspect_accepts_labels_in_range(tmp_path, store):
    proc = run(tmp_path, "inspect", str(store[0]))
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
