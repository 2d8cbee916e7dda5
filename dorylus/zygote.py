"""Roles started locally are forked from a zygote, so that torch, numba and the role modules are
imported once per coordinator process instead of once per role.

Importing torch alone costs a process 2.6 CPU-s, and a role imports torch, numba and ZeroMQ
before it serves (about 3.3 CPU-s); a 2-part run starts three roles, and a test session many
runs. The zygote (``python -m dorylus.zygote``, started by :func:`shared`) imports all of that
and initialises numba's compiler by loading a serial kernel, then forks one child per role (what
only one role imports, :data:`ROLE_PRELOAD`, from that role's second fork on). The
child becomes the role as ``python -m MODULE ARGS`` would: its log on stdout and stderr (at fd
level, appended), stdin ``/dev/null``, the given cwd, environment and ``sys.argv``, the module run
as ``__main__``, non-daemon threads joined and ``atexit`` run at the end, its exit status that of
``python -m``. Its command line (``/proc/PID/cmdline``, what ``ps`` shows) is rewritten to that
command, in room the zygote's own command line reserves (:data:`COMMAND_ROOM`).

Forking is safe only while the zygote has a single thread: it never runs a parallel op, so
neither torch's OpenMP pool nor numba's threading layer exists (loading a parallel numba kernel
launches the layer, after which numba's own fork handler kills every forked child: the role loads
those itself, ~0.04 CPU-s once the compiler is up). The zygote refuses to serve with more than
one thread.

The coordinator holds a :class:`Role` per child, with :class:`subprocess.Popen`'s interface
(``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``). The zygote
reaps its children and reports their exit statuses over its control socket. Signals go through a
pidfd that the zygote opened at fork, before it could reap the child, so a reused pid is never
signalled.

Orphans: the zygote exits when its control socket closes or its parent changes (the coordinator
exited, even by SIGKILL), after SIGTERM (then SIGKILL) to the roles it started; the roles watch the
zygote as their parent (``--exit-with-parent ZYGOTE_PID``), so they stop even if the zygote is
killed. One zygote serves every run of a coordinator process that has the same start-time
environment (:data:`START_TIME_PREFIXES`); it stops when the process exits. ``DORYLUS_ZYGOTE=0``
starts roles as plain subprocesses instead (:func:`enabled`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dorylus.errors import DorylusError

# Bytes of the zygote's command line kept free for its children's (a role's is about 1 KB:
# a few paths); a longer one is cut after its last whole argument that fits.
COMMAND_ROOM = 8192
STARTUP_TIMEOUT_S = 120.0
# How often the zygote checks that its parent is still the coordinator that started it.
PARENT_CHECK_S = 1.0
# After SIGTERM, how long the zygote's roles get to stop before SIGKILL.
STOP_GRACE_S = 5.0
# Variables read while a process starts or imports torch, numba, numpy or OpenBLAS: a zygote
# started with other values than the coordinator's current ones would fork stale roles, so such
# a change starts another zygote. Every other variable is set in each child.
START_TIME_PREFIXES = ("PYTHON", "LD_", "OPENBLAS_", "GOTO", "OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "NUMBA_",
                       "TORCH", "PYTORCH")
# A role's exit status when the zygote that reaped it is gone (it was killed): unknown.
STATUS_LOST = 255
MESSAGE_BYTES = 1 << 20
ROLE_MODULES = ("dorylus.paramserver", "graphserver.server")


class ZygoteError(DorylusError):
    """The zygote could not start, or could not fork a role; the message says why."""

    exit_status = 1


def enabled() -> bool:
    """Whether local roles are forked from a zygote: unless ``DORYLUS_ZYGOTE=0``."""
    value = os.environ.get("DORYLUS_ZYGOTE", "1")
    if value not in ("0", "1"):
        raise ZygoteError(f"DORYLUS_ZYGOTE must be 0 or 1, got {value!r}")
    return value == "1"


# ----------------------------------------------------------------------------- coordinator side


class Role:
    """A child of the zygote, as the coordinator sees it: :class:`subprocess.Popen`'s interface."""

    def __init__(self, zygote: "Zygote", pid: int, pidfd: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _gone(self) -> bool:
        """The process has exited (a pidfd polls readable then), whoever reaped it."""
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote._collect(0.0)
            if self.returncode is None and self.zygote.lost and self._gone():
                self._exited(STATUS_LOST)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self.zygote.lost:  # only the pidfd can tell: an orphan stops on its own (its parent watch)
                time.sleep(0.05 if left is None else min(0.05, left))
            else:
                self.zygote._collect(0.05 if left is None else min(0.05, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote process and its control socket; :meth:`spawn` forks a role from it."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.lost = False  # the control socket closed: the zygote exited
        self._lock = threading.RLock()
        self._roles: dict[int, Role] = {}
        self._early_exits: dict[int, int] = {}  # statuses read before the reply that named the pid
        self._replies: list[tuple[dict[str, Any], list[int]]] = []
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        command = [sys.executable, "-m", "dorylus.zygote", str(theirs.fileno()), str(os.getpid()), " " * COMMAND_ROOM]
        try:
            self.process = subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, pass_fds=[theirs.fileno()], cwd=os.getcwd())
        except OSError as exc:
            ours.close()
            raise ZygoteError(f"could not start the role zygote ({sys.executable} -m dorylus.zygote): {exc}") from None
        finally:
            theirs.close()
        self.pid = self.process.pid
        try:
            reply, _ = self._reply(STARTUP_TIMEOUT_S, "starting")
            if "ready" not in reply:
                raise ZygoteError(f"the role zygote (pid {self.pid}) failed to start: {reply.get('error', reply)}")
        except BaseException:
            self.close()
            raise

    def spawn(self, module: str, args: list[str], log: Any, cwd: str, env: dict[str, str]) -> Role:
        """Fork ``python -m module *args`` with stdout and stderr on the open file ``log``."""
        request = json.dumps({"module": module, "args": args, "cwd": cwd, "env": env}).encode()
        with self._lock:
            try:
                socket.send_fds(self._socket, [request], [log.fileno()])
            except OSError as exc:
                raise ZygoteError(f"the role zygote (pid {self.pid}) cannot be reached to start {module}: "
                                  f"{exc}") from None
            reply, fds = self._reply(STARTUP_TIMEOUT_S, f"forking {module}")
            if "pid" not in reply or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ZygoteError(f"the role zygote (pid {self.pid}) could not fork {module}: "
                                  f"{reply.get('error', reply)}")
            role = Role(self, reply["pid"], fds[0], [sys.executable, "-m", module, *args])
            if role.pid in self._early_exits:
                role._exited(self._early_exits.pop(role.pid))
            else:
                self._roles[role.pid] = role
            return role

    def _reply(self, timeout: float, doing: str) -> tuple[dict[str, Any], list[int]]:
        """The next reply to a request (exit reports that come first are recorded)."""
        deadline = time.monotonic() + timeout
        while not self._replies:
            if self.lost:
                code = self.process.wait(timeout=STOP_GRACE_S)
                raise ZygoteError(f"the role zygote (pid {self.pid}) exited with status {code} while {doing} "
                                  "(its error, if any, is on this process's stderr)")
            if time.monotonic() > deadline:
                raise ZygoteError(f"the role zygote (pid {self.pid}) did not answer within {timeout:.0f} s while "
                                  f"{doing}")
            self._collect(0.1)
        return self._replies.pop(0)

    def _collect(self, timeout: float) -> None:
        """Read what the zygote sent within ``timeout`` seconds: exit statuses and replies."""
        with self._lock:
            while not self.lost:
                if not select.select([self._socket], [], [], timeout)[0]:
                    return
                timeout = 0.0
                try:
                    data, fds, _, _ = socket.recv_fds(self._socket, MESSAGE_BYTES, 1)
                except ConnectionError:
                    data, fds = b"", []
                if not data:
                    self.lost = True
                    return
                message = json.loads(data)
                if "exited" in message:
                    role = self._roles.pop(message["exited"], None)
                    if role is not None:
                        role._exited(message["returncode"])
                    else:
                        self._early_exits[message["exited"]] = message["returncode"]
                else:
                    self._replies.append((message, fds))

    def live_roles(self) -> int:
        self._collect(0.0)
        return len(self._roles)

    def close(self) -> None:
        """Stop the zygote (it stops any role it still runs) and wait for it."""
        with self._lock:
            self._socket.close()
            self.lost = True
        try:
            self.process.wait(timeout=STOP_GRACE_S + 5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5.0)
        for role in list(self._roles.values()):
            if role.returncode is None and role._pidfd is not None and role._gone():
                role._exited(STATUS_LOST)
        self._roles = {k: r for k, r in self._roles.items() if r.returncode is None}


def start_time_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` that a zygote must have been started with (:data:`START_TIME_PREFIXES`)."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_TIME_PREFIXES)))


_shared: dict[tuple[tuple[str, str], ...], Zygote] = {}
_shared_lock = threading.Lock()
_shared_pid = os.getpid()


def _forget_inherited() -> None:
    """In a process forked from the one that started the zygotes: drop this copy of their control
    sockets, which the zygotes' owner still uses; this process starts its own."""
    global _shared_pid
    if _shared_pid != os.getpid():
        for zygote in _shared.values():
            zygote._socket.close()
        _shared.clear()
        _shared_pid = os.getpid()


def shared(env: dict[str, str]) -> Zygote:
    """This process's zygote for roles with environment ``env``, started on first use and
    stopped when the process exits. A zygote for another start-time environment that runs no
    role any more is stopped (an idle one holds ~300 MB)."""
    key = start_time_environment(env)
    with _shared_lock:
        _forget_inherited()
        zygote = _shared.get(key)
        if zygote is not None and zygote.lost:
            zygote.close()
            zygote = None
        if zygote is None:
            for other_key, other in list(_shared.items()):
                if other_key != key and other.live_roles() == 0:
                    other.close()
                    del _shared[other_key]
            if not _shared:
                atexit.register(stop_shared)
            zygote = _shared[key] = Zygote(env)
        return zygote


def stop_shared() -> None:
    """Stop every zygote this process started (registered with :mod:`atexit`)."""
    with _shared_lock:
        _forget_inherited()
        for zygote in _shared.values():
            zygote.close()
        _shared.clear()
    atexit.unregister(stop_shared)


# ----------------------------------------------------------------------------- zygote side


# What the roles import beyond their own modules before they serve or during a run, found with
# PYTHONPROFILEIMPORTTIME=1 in their logs: a graph server's Lambda client imports aiobotocore.
PRELOAD = ("numpy", "numpy.ma", "torch", "numba", "zmq", "zmq.asyncio", "asyncio", "uuid",
           "aiobotocore.session", "dorylus.spot", *ROLE_MODULES, "graphserver.invoker", "graphserver.scheduler",
           "dorylus.models._kernels_numba", "dorylus.models._dropout_numba")
# What one role alone imports: the parameter server's torch optimizer imports torch._dynamo
# (2.5 CPU-s, as much as torch itself; 71 MB RSS, 68 MB of it anonymous). A forked child's RSS
# counts every anonymous page it inherits, so preloaded for all, it was 71 MB more in the zygote
# and in each graph server, which never use it (0.21 GiB of a 2-part run's 5.7 GiB RSS
# together). The first such role imports these itself, at its start (a single run's CPU is the
# same); from the second fork of its module on (another run of a test session, or a
# replacement), the zygote imports them first, so later runs pay nothing.
ROLE_PRELOAD = {"dorylus.paramserver": ("torch._dynamo",)}


def _preload() -> None:
    """Import what every role imports and start numba's compiler, without a parallel op."""
    import importlib

    import numpy as np

    for name in PRELOAD:
        importlib.import_module(name)
    from dorylus.models import _kernels_numba

    # A serial kernel loads (or compiles, then caches) through the same LLVM setup as the
    # parallel ones, which is most of their load time (0.6 of 0.65 CPU-s).
    indptr, indices = np.zeros(2, np.int64), np.zeros(0, np.int32)
    _kernels_numba.transpose_fill(indptr, indices, np.zeros(2, np.int64), np.zeros(0, np.int32),
                                  np.zeros(0, np.int32))
    from dorylus.models import _dropout_numba  # serial too: a role's first large dropout is then ready

    _dropout_numba.dropped(np.ones((1, 4), np.float32), np.zeros(1), (0, 0, 0), 0.5)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload_role(module: str, forked: set[str]) -> None:
    """Before forking ``module``'s role for the second time or later: import what that role
    alone imports (:data:`ROLE_PRELOAD`), still without a second thread."""
    import importlib

    if module not in forked or all(name in sys.modules for name in ROLE_PRELOAD.get(module, ())):
        return
    for name in ROLE_PRELOAD[module]:
        importlib.import_module(name)
    if (threads := _threads()) != 1:
        raise RuntimeError(f"the zygote has {threads} threads after importing {', '.join(ROLE_PRELOAD[module])}; "
                           "forking it would be unsafe")


def _send(control: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    socket.send_fds(control, [json.dumps(message).encode()], list(fds))


def _returncode(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def serve(control: socket.socket, parent: int) -> None:
    """Fork a role per request until the control socket closes or the parent changes; then stop
    the roles that are left."""
    roles: set[int] = set()
    forked: set[str] = set()  # modules with a role forked so far
    stopping = False
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of exits

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)

    def reap() -> None:
        while roles:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            roles.discard(pid)
            with contextlib.suppress(OSError):
                _send(control, {"exited": pid, "returncode": _returncode(status)})

    try:
        while not stopping and os.getppid() == parent:
            readable = select.select([control, wake_r], [], [], PARENT_CHECK_S)[0]
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            reap()
            if control not in readable:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 1)
            except ConnectionError:
                break
            if not data:
                break  # the coordinator closed the socket or exited
            try:
                request = json.loads(data)
                if len(fds) != 1:
                    raise ValueError(f"a request carries one file descriptor (the log), not {len(fds)}")
                _preload_role(request["module"], forked)
                pid = _fork(request, fds[0], close=[control.fileno(), wake_r, wake_w])
                forked.add(request["module"])
            except Exception as exc:  # noqa: BLE001 - the coordinator reports it
                _send(control, {"error": f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            roles.add(pid)
            pidfd = os.pidfd_open(pid)  # before any reap: it names this child, not a later one with its pid
            try:
                _send(control, {"pid": pid}, [pidfd])
            finally:
                os.close(pidfd)
    finally:
        _stop(roles)


def _stop(roles: set[int]) -> None:
    """SIGTERM the roles (SIGCONT too: a stopped one must run to see it), SIGKILL after
    :data:`STOP_GRACE_S`, and reap them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in roles:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + STOP_GRACE_S
        while roles and time.monotonic() < deadline:
            for pid in list(roles):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        continue
                roles.discard(pid)
            time.sleep(0.02)


def _fork(request: dict[str, Any], log: int, close: list[int]) -> int:
    module, args, cwd, env = request["module"], request["args"], request["cwd"], request["env"]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = _become(module, args, cwd, env, log, close)
        finally:
            os._exit(status)
    return pid


def _become(module: str, args: list[str], cwd: str, env: dict[str, str], log: int, close: list[int]) -> int:
    """In the forked child: run ``python -m module *args``; returns its exit status."""
    import atexit as exits
    import runpy

    import numpy as np

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote ignores Ctrl-C; a role stops on it
    for fd in close:
        os.close(fd)
    os.dup2(log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    command = [sys.executable, "-m", module, *args]
    _set_command_line(command)
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = command[2:]  # run_module sets argv[0] to the module's file
    np.random.seed()  # a fresh process's global generator is seeded from the OS, not shared with its siblings
    sys.modules.pop(module, None)  # run afresh as __main__, as `python -m` does (no double-import warning)
    status = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        status = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # noqa: SLF001 - what interpreter exit does: join non-daemon threads
    exits._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if status == -signal.SIGINT:  # an interrupt that escaped: die of SIGINT, as the interpreter does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130
    return status


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends the interpreter with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _set_command_line(words: list[str]) -> None:
    """Make ``/proc/self/cmdline`` (ps, top, and whoever looks a role up by it) read ``words``: the
    argument area of the stack, which the kernel reads it from, is overwritten in place. A
    command longer than the room loses its last arguments."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: fields 48 and 49 of stat
    room = end - start
    line = b""
    for word in words:
        encoded = os.fsencode(word) + b"\0"
        if len(line) + len(encoded) > room:
            break
        line += encoded
    # NULs to the end: a last byte that is not NUL would make the kernel read it as a setproctitle title
    ctypes.memmove(start, line.ljust(room, b"\0"), room)


def main(argv: list[str]) -> int:
    """``python -m dorylus.zygote CONTROL_FD PARENT_PID ROOM``: started by :class:`Zygote` only."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: roles stop, the coordinator reaps
    control = socket.socket(fileno=int(argv[0]))
    parent = int(argv[1])
    try:
        _preload()
        if (threads := _threads()) != 1:
            raise RuntimeError(f"the zygote has {threads} threads after its imports; forking it would be unsafe")
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, which raises it
        with contextlib.suppress(OSError):
            _send(control, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    _send(control, {"ready": os.getpid()})
    serve(control, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
