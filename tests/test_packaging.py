"""``dorylus package-lambda``: the function zip (dorylus.packaging).

Most tests build from tiny fake wheels, so they take milliseconds. One test builds the real
bundle for this machine's Python and architecture from wheels pip downloads once (kept in
pytest's cache directory), unpacks it, and runs the handler from it in a Python that sees
nothing but the unpacked zip and the standard library: no project checkout, no site-packages,
no torch. The handler talks to a fake graph/parameter server in this process, and its pushes
must match those of the project's own handler on the same event.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zmq

from dorylus import cli, packaging, protocol
from dorylus.packaging import BundleError, Target, build_bundle, select_wheels, walk_imports
from dorylus.protocol import Op


def make_wheel(directory: Path, filename: str, members: dict[str, str]) -> Path:
    path = directory / filename
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return path


@pytest.fixture
def fake_wheels(tmp_path: Path) -> Path:
    """Stand-ins for numpy and pyzmq wheels for Lambda Python 3.11 on x86_64."""
    directory = tmp_path / "wheels"
    directory.mkdir()
    make_wheel(directory, "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
               {"numpy/__init__.py": "", "numpy/_core/_multiarray.cpython-311-x86_64-linux-gnu.so": "ELF",
                "numpy-2.2.6.dist-info/METADATA": "Name: numpy\n"})
    make_wheel(directory, "pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
               {"zmq/__init__.py": "", "pyzmq.libs/libzmq.so.5": "ELF",
                "pyzmq-27.3.0.data/purelib/zmq/extra.py": "", "pyzmq-27.3.0.data/headers/zmq.h": ""})
    return directory


def wheels_for(directory: Path) -> list[Path]:
    return select_wheels(directory, Target("3.11", "x86_64"))


def test_build_is_reproducible_and_holds_the_handler(tmp_path, fake_wheels):
    """Same bytes from two builds, even from a copy of the sources with other times and modes."""
    first = build_bundle(tmp_path / "a.zip", wheels_for(fake_wheels))
    copy = tmp_path / "copy"
    for path in walk_imports().files:
        rel = path.relative_to(packaging.ROOT)
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(path.read_bytes())
        os.chmod(copy / rel, 0o600)
        os.utime(copy / rel, (1_700_000_000, 1_700_000_000))
    (copy / "dorylus" / "__pycache__").mkdir()
    (copy / "dorylus" / "__pycache__" / "junk.pyc").write_bytes(b"x")
    second = build_bundle(tmp_path / "b.zip", wheels_for(fake_wheels), root=copy)
    assert first.sha256 == second.sha256 == hashlib.sha256((tmp_path / "b.zip").read_bytes()).hexdigest()
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()

    with zipfile.ZipFile(tmp_path / "a.zip") as z:
        infos = {i.filename: i for i in z.infolist()}
    names = list(infos)
    assert names == sorted(names)
    assert {"lambdas/handler.py", "lambdas/__init__.py", "dorylus/__init__.py", "dorylus/protocol.py",
            "dorylus/models/__init__.py", "dorylus/models/gcn.py", "numpy/__init__.py", "zmq/__init__.py",
            "zmq/extra.py"} <= set(names)  # .data/purelib lands at the root
    assert not any("__pycache__" in n or n.endswith("/") or ".data/" in n or n.startswith("torch") for n in names)
    # The torch twin of the model is imported only inside a function: left out, and said so.
    assert "dorylus/models/reference.py" in first.left_out and not set(first.left_out) & set(names)
    assert not any(n.startswith(("graphserver/", "dorylus/partition/", "dorylus/cli")) for n in names)
    assert {i.date_time for i in infos.values()} == {packaging.ZIP_TIME}
    assert infos["lambdas/handler.py"].external_attr >> 16 == 0o100644
    assert infos["pyzmq.libs/libzmq.so.5"].external_attr >> 16 == 0o100755


def test_wheels_must_match_the_runtime(tmp_path):
    """python3.11 runs on glibc 2.26 (Amazon Linux 2): a manylinux_2_28 wheel would not load."""
    t311, t312, arm = Target("3.11", "x86_64"), Target("3.12", "x86_64"), Target("3.12", "arm64")
    assert t311.accepts("numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert not t311.accepts("numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert t312.accepts("numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert not t312.accepts("numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert not t312.accepts("numpy-2.4.6-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl")
    assert arm.accepts("numpy-2.4.6-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl")
    assert arm.accepts("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl")
    assert not t312.accepts("numpy-2.4.6-cp312-cp312-macosx_14_0_arm64.whl")
    assert "manylinux_2_26_x86_64" in t311.platforms and "manylinux_2_27_x86_64" not in t311.platforms
    # The newest compatible wheel is chosen; an incompatible newer one is ignored.
    directory = tmp_path / "w"
    directory.mkdir()
    for name in ("numpy-2.1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.whl",
                 "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl", "pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.whl"):
        make_wheel(directory, name, {})
    assert [p.name.split("-")[1] for p in select_wheels(directory, t311)] == ["2.2.6", "27.3.0"]
    with pytest.raises(BundleError, match=r"no numpy wheel for Lambda Python 3\.12 x86_64 \(glibc 2\.34\)"):
        select_wheels(directory, t312)


def _no_partial_files(directory: Path) -> None:
    assert sorted(p.name for p in directory.iterdir() if p.suffix in (".zip", ".tmp")) == []


def test_torch_is_refused(tmp_path, fake_wheels):
    root = tmp_path / "project"
    for rel, text in {
        "lambdas/__init__.py": "", "dorylus/__init__.py": "",
        "lambdas/handler.py": "import numpy\nfrom dorylus import helper\n\ndef handler(event, context):\n    return 1\n",
        "dorylus/helper.py": "import zmq\nfrom dorylus.tensors import *\n",
        "dorylus/tensors.py": "import torch\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(BundleError, match=r"would need torch: imported by dorylus/tensors\.py <- dorylus/helper\.py "
                                          r"<- lambdas/handler\.py"):
        build_bundle(out_dir / "f.zip", wheels_for(fake_wheels), root=root)
    _no_partial_files(out_dir)

    # Imported only inside a function, guarded by ImportError, or for type checking: not needed.
    (root / "dorylus/helper.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
        "def twin():\n    from dorylus.tensors import x\n")
    bundle = build_bundle(out_dir / "f.zip", wheels_for(fake_wheels), root=root)
    assert bundle.left_out == ["dorylus/tensors.py"]

    # A wheel that brings torch is refused whatever imports it.
    make_wheel(fake_wheels, "torch-2.13.0-cp311-cp311-manylinux_2_17_x86_64.whl", {"torch/__init__.py": ""})
    wheels = select_wheels(fake_wheels, Target("3.11", "x86_64"), ("numpy", "pyzmq", "torch"))
    with pytest.raises(BundleError, match="refusing to bundle torch"):
        build_bundle(out_dir / "g.zip", wheels, root=root)
    assert not (out_dir / "g.zip").exists()


def test_a_module_no_wheel_provides_is_refused(tmp_path, fake_wheels):
    root = tmp_path / "project"
    (root / "lambdas").mkdir(parents=True)
    (root / "lambdas/__init__.py").write_text("")
    (root / "lambdas/handler.py").write_text("import json\nimport numpy\nimport scipy.sparse\n")
    with pytest.raises(BundleError, match="the function imports scipy, which no bundled wheel provides"):
        build_bundle(tmp_path / "f.zip", wheels_for(fake_wheels), root=root)


def test_a_wheel_member_outside_the_bundle_is_refused(tmp_path, fake_wheels):
    for wheel in fake_wheels.glob("pyzmq-*"):
        wheel.unlink()
    make_wheel(fake_wheels, "pyzmq-27.3.0-cp311-cp311-manylinux_2_17_x86_64.whl",
               {"zmq/__init__.py": "", "../../etc/evil.py": ""})
    with pytest.raises(BundleError, match="refusing member '../../etc/evil.py'"):
        build_bundle(tmp_path / "f.zip", wheels_for(fake_wheels))
    assert not (tmp_path / "f.zip").exists()


@pytest.mark.parametrize("limit", ["zip_limit", "unzipped_limit"])
def test_over_lambdas_limits_is_refused_and_nothing_is_left(tmp_path, fake_wheels, limit):
    out = tmp_path / "out" / "f.zip"
    out.parent.mkdir()
    out.write_bytes(b"previous build")  # an earlier bundle stays as it was
    with pytest.raises(BundleError, match=r"over the 1,000 bytes|more than 1,000 bytes.*nothing written"):
        build_bundle(out, wheels_for(fake_wheels), **{limit: 1000})
    assert out.read_bytes() == b"previous build"
    assert [p.name for p in out.parent.iterdir()] == ["f.zip"]


def test_cli_prints_path_size_and_sha256(tmp_path, fake_wheels, capsys):
    out = tmp_path / "function.zip"
    assert cli.main(["package-lambda", "--out", str(out), "--python", "3.11", "--arch", "x86_64",
                     "--wheels", str(fake_wheels)]) == 0
    printed = capsys.readouterr().out
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert str(out) in printed and digest in printed and f"{out.stat().st_size:,}" in printed


def exit_status(argv: list[str]) -> int:
    """``dorylus ARGV``'s exit status, whether argparse exits or main returns."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sparc"], "invalid choice: 'sparc'"),
    (["--python", "2.7"], "--python 2.7: Lambda has no such Python runtime"),
    (["--wheels", "/nonexistent/wheels"], "--wheels /nonexistent/wheels: not a directory"),
    (["--python", "3.12"], "no numpy wheel for Lambda Python 3.12 x86_64"),
])
def test_cli_bad_input_exits_2(tmp_path, fake_wheels, capsys, argv, message):
    argv = argv if "--wheels" in argv else ["--wheels", str(fake_wheels), *argv]
    assert exit_status(["package-lambda", "--out", str(tmp_path / "f.zip"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "f.zip").exists()


# ----------------------------------------------------------------------------- the real bundle


def host_target() -> Target:
    arch = {"x86_64": "x86_64", "AMD64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if arch is None or python not in packaging.RUNTIME_GLIBC or sys.platform != "linux":
        pytest.skip(f"no Lambda runtime matches this host ({sys.platform} {platform.machine()}, Python {python})")
    return Target(python, arch)


@pytest.fixture(scope="module")
def real_bundle(request, tmp_path_factory) -> Path:
    """The real bundle for this host's Python and architecture, unpacked; wheels cached."""
    target = host_target()
    cache_plugin = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = Path(cache_plugin.mkdir("dorylus-lambda-wheels") if cache_plugin else tmp_path_factory.mktemp("wheels"))
    try:
        wheels = packaging.download_wheels(target, cache)
    except BundleError as exc:
        pytest.skip(f"cannot download the wheels: {exc}")
    out = tmp_path_factory.mktemp("bundle") / "function.zip"
    bundle = build_bundle(out, wheels)
    assert bundle.zipped_bytes < packaging.ZIP_LIMIT_BYTES and bundle.unzipped_bytes < packaging.UNZIPPED_LIMIT_BYTES
    unpacked = out.parent / "task"
    with zipfile.ZipFile(out) as z:
        assert not any(n.split("/")[0] == "torch" for n in z.namelist())
        z.extractall(unpacked)
    return unpacked


class FakeServers:
    """One ROUTER standing in for both the graph server and the parameter server; records the
    tensors of every PUSH and PUSH_GRADS, per run token."""

    def __init__(self, buffers: dict[str, np.ndarray], params: list[dict[str, np.ndarray]]):
        self.buffers, self.layer_params = buffers, params
        self.pushed: dict[str, list[np.ndarray]] = {}
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(50):
                continue
            try:
                identity, header, tensors = protocol.recv_routed(self.socket, timeout=1.0)
                out: list[np.ndarray] = []
                if header.op is Op.PULL:
                    start, stop = header.rows
                    reply, out = protocol.reply_to(header, Op.ROWS), [self.buffers[n][start:stop] for n in header.names]
                elif header.op is Op.PULL_WEIGHTS:
                    layer_params = self.layer_params[header.layer]
                    reply = protocol.reply_to(header, Op.WEIGHTS, version=1, names=tuple(layer_params),
                                              meta={"newest": 1})
                    out = list(layer_params.values())
                else:
                    key = "grads" if header.op is Op.PUSH_GRADS else "rows"
                    self.pushed.setdefault(key, []).extend(np.array(t) for t in tensors)
                    reply = protocol.reply_to(header, Op.ACK, meta={"duplicate": False})
                protocol.send_routed(self.socket, identity, reply, out)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

    def take(self) -> dict[str, list[np.ndarray]]:
        pushed, self.pushed = self.pushed, {}
        return pushed

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.socket.close(linger=0)
        self.ctx.term()


RUN_IN_BUNDLE = r"""
import json, sys
bundle, event = sys.argv[1], json.loads(sys.argv[2])
assert not any('site-packages' in p or 'dist-packages' in p for p in sys.path), sys.path
sys.path.insert(0, bundle)
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit('torch is importable: the test is not isolated')
import lambdas.handler, numpy, zmq, dorylus
for module in (lambdas.handler, numpy, zmq, dorylus):
    assert module.__file__.startswith(bundle), module.__file__

class Context:
    def get_remaining_time_in_millis(self):
        return 20000

print(json.dumps(lambdas.handler.handler(event, Context())))
"""


def test_bundle_runs_the_handler_alone(real_bundle):
    """The unpacked zip alone (plus the standard library) runs a real function task."""
    from dorylus.config import TrainConfig
    from dorylus.models import get_model
    from dorylus.models.spec import ModelSpec
    from lambdas.handler import handler

    features, classes, rows = 6, 3, 8
    spec = ModelSpec.from_config(TrainConfig(), features, classes)
    plan = get_model("gcn").build_plan(spec)
    stage = next(s for s in plan.train if s.kind == "function" and s.grad)
    rng = np.random.default_rng(0)
    buffers = {"X": rng.standard_normal((rows, features)).astype(np.float32),
               "ids": np.arange(rows, dtype=np.int64), "labels": rng.integers(0, classes, rows).astype(np.int64),
               "split": np.ones(rows, np.uint8),
               **{n: rng.standard_normal((rows, w)).astype(np.float32) for n, w in plan.widths.items()}}
    servers = FakeServers(buffers, spec.init_params(0))
    try:
        event = {"model": "gcn", "task": stage.task, "layer": stage.layer, "reads": list(stage.reads),
                 "writes": list(stage.writes), "weights": stage.weights, "grad": True,
                 "args": {**dict(stage.args), "seed": 0, "epoch": 1, "training": True, "train_count": rows},
                 "graph_server": servers.endpoint, "param_server": servers.endpoint, "part": 0, "interval": 0,
                 "rows": [0, rows], "epoch": 1, "pass": "train", "attempt": 0}
        event = json.loads(json.dumps(event))
        handler({**event, "run": "in-process"}, None)
        expected = servers.take()
        result = subprocess.run([sys.executable, "-I", "-S", "-c", RUN_IN_BUNDLE, str(real_bundle),
                                 json.dumps({**event, "run": "bundle"})],
                                capture_output=True, text=True, timeout=60, cwd=real_bundle.parent)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout.splitlines()[-1])
        assert summary["task"] == stage.task and summary["layer"] == stage.layer
        got = servers.take()
    finally:
        servers.close()
    assert not servers.errors, servers.errors
    assert set(got) == set(expected) == {"rows", "grads"}
    for key in expected:
        assert len(got[key]) == len(expected[key])
        for a, b in zip(got[key], expected[key]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # another numpy build: not bit for bit
