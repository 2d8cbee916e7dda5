"""Roles forked from the zygote (dorylus/zygote.py) behave as ``python -m MODULE`` processes: exit
status, signals, log, cwd, environment, command line, thread pools; and nothing outlives a
coordinator killed with SIGKILL, nor a killed zygote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dorylus import zygote
from dorylus.lifecycle import local_process_environment
from tests.processes import alive, wait_gone

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def started():
    """Roles a test forked: killed at its end."""
    roles: list[zygote.Role] = []
    yield roles
    for role in roles:
        if role.poll() is None:
            role.kill()
            role.wait(timeout=10)


def spawn(started, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          launcher: zygote.Zygote | None = None) -> tuple[zygote.Role, Path]:
    env = env if env is not None else local_process_environment()
    launcher = launcher or zygote.shared(env)
    log = tmp_path / "role.log"
    with open(log, "a") as out:
        role = launcher.spawn("tests.zygote_role", list(args), out, cwd=str(REPO), env=env)
    started.append(role)
    return role, log


def report(log: Path, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        assert time.monotonic() < deadline, f"no report in {log}: {log.read_text()[-2000:]}"
        time.sleep(0.02)


def test_a_forked_role_sees_what_python_m_would_and_exits_with_its_status(started, tmp_path):
    log = tmp_path / "role.log"
    log.write_text("an earlier attempt's line\n")
    env = {**local_process_environment(), "ZYGOTE_TEST_VALUE": "set after the zygote started"}
    role, _ = spawn(started, tmp_path, "3", "2", env=env)
    assert role.wait(timeout=60) == 3
    text = log.read_text()
    assert text.startswith("an earlier attempt's line\n")  # appended
    seen = report(log)
    assert seen["cwd"] == str(REPO) and seen["path0"] == str(REPO)
    assert seen["argv"] == [str(REPO / "tests" / "zygote_role.py"), "3", "2"]
    assert seen["cmdline"] == [sys.executable, "-m", "tests.zygote_role", "3", "2"]
    assert seen["stdin"] == ""
    assert seen["env"] == {"ZYGOTE_TEST_VALUE": "set after the zygote started"}
    # torch's and numba's pools start in the child, with its thread count: float32 products
    # of 512 terms of N(0,1)^2 are within ~1e-3 of float64; a float32 sum of 5 rows within 1e-5
    assert seen["threads"] == 2
    assert seen["matmul_error"] < 1e-2 and seen["gather_error"] < 1e-4


def test_only_a_second_parameter_server_makes_the_zygote_import_torch_dynamo(started, tmp_path):
    """torch._dynamo (68 MB anonymous, which every forked child's RSS counts) is the parameter
    server's alone: the first one imports it itself, graph servers never carry it; from the
    second parameter server on, the zygote imports it before forking, and so every later role
    inherits it."""
    env = local_process_environment()
    launcher = zygote.Zygote(env)
    try:
        role, log = spawn(started, tmp_path, "0", launcher=launcher)
        assert role.wait(timeout=60) == 0 and report(log)["dynamo"] is False
        for attempt in range(2):
            ps_log = tmp_path / f"paramserver-{attempt}.log"
            with open(ps_log, "a") as out:
                ps = launcher.spawn("dorylus.paramserver", ["--help"], out, cwd=str(REPO), env=env)
            started.append(ps)
            assert ps.wait(timeout=60) == 0 and "usage:" in ps_log.read_text()
            (tmp_path / f"after-{attempt}").mkdir()
            role, log = spawn(started, tmp_path / f"after-{attempt}", "0", launcher=launcher)
            assert role.wait(timeout=60) == 0
            assert report(log)["dynamo"] is (attempt == 1)
    finally:
        launcher.close()


def test_an_uncaught_exception_is_printed_to_the_log_with_status_1(started, tmp_path):
    role, log = spawn(started, tmp_path, "not-a-number")
    assert role.wait(timeout=60) == 1
    assert "ValueError: invalid literal for int()" in log.read_text()


def test_signals_reach_the_role_through_its_handle(started, tmp_path):
    role, log = spawn(started, tmp_path, "sleep")
    report(log)
    role.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{role.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "SIGSTOP did not stop the role"
        time.sleep(0.02)
    role.send_signal(signal.SIGCONT)
    with pytest.raises(subprocess.TimeoutExpired):
        role.wait(timeout=0.2)
    role.terminate()
    assert role.wait(timeout=30) == -signal.SIGTERM
    role.kill()  # a finished role: nothing is signalled, nothing raised
    assert role.poll() == -signal.SIGTERM


def test_a_zygote_that_cannot_start_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    env = {**local_process_environment(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    with pytest.raises(zygote.ZygoteError, match="failed to start: ImportError: this torch is broken"):
        zygote.Zygote(env)


def test_a_killed_zygote_takes_its_roles_with_it(tmp_path, started):
    """The role watches the zygote as its parent (the coordinator passes --exit-with-parent
    ZYGOTE_PID): a parameter server stops by itself once the zygote is SIGKILLed."""
    env = local_process_environment()
    launcher = zygote.Zygote(env)
    try:
        config = tmp_path / "c.json"
        config.write_text(json.dumps({"layers": 2, "hidden": 4}))
        ready = tmp_path / "ready"
        with open(tmp_path / "ps.log", "a") as out:
            role = launcher.spawn("dorylus.paramserver", [
                "--config", str(config), "--num-features", "5", "--num-classes", "3", "--bind", "tcp://127.0.0.1:0",
                "--ready-file", str(ready), "--exit-with-parent", str(launcher.pid)], out, cwd=str(REPO), env=env)
        started.append(role)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert role.poll() is None and time.monotonic() < deadline, (tmp_path / "ps.log").read_text()
            time.sleep(0.02)
        os.kill(launcher.pid, signal.SIGKILL)
        assert role.wait(timeout=30) == zygote.STATUS_LOST  # the status died with the zygote
        assert not alive(role.pid)
    finally:
        launcher.close()


def test_a_coordinator_killed_with_sigkill_leaves_no_zygote_and_no_role(tmp_path):
    """The parent (a subprocess standing in for `dorylus train`) forks a role that would sleep
    for ten minutes, then is killed: the zygote sees its control socket close and stops it."""
    script = (
        "import json, sys\n"
        "from dorylus import zygote\n"
        "from dorylus.lifecycle import local_process_environment\n"
        "env = local_process_environment()\n"
        "z = zygote.shared(env)\n"
        f"role = z.spawn('tests.zygote_role', ['sleep'], open({str(tmp_path / 'role.log')!r}, 'a'), "
        f"cwd={str(REPO)!r}, env=env)\n"
        "print(json.dumps([z.pid, role.pid]), flush=True)\n"
        "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    pids: list[int] = []
    try:
        line = parent.stdout.readline()  # the parent's stdout: bounded by its startup (~10 CPU-s)
        pids = json.loads(line)
        report(tmp_path / "role.log")
        parent.kill()
        parent.wait(timeout=30)
        assert not wait_gone(set(pids), 30), "the zygote or its role outlived the coordinator"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        parent.wait(timeout=30)


def test_dorylus_zygote_takes_0_or_1(monkeypatch):
    monkeypatch.setenv("DORYLUS_ZYGOTE", "0")
    assert not zygote.enabled()
    monkeypatch.setenv("DORYLUS_ZYGOTE", "off")
    with pytest.raises(zygote.ZygoteError, match="DORYLUS_ZYGOTE must be 0 or 1, got 'off'"):
        zygote.enabled()
