"""How every Dorylus command line ends: one line naming the command on a Dorylus error (its exit
status), 130 and one line on Ctrl-C.

Below :mod:`dorylus.cli` and the role modules, so that ``python -m dorylus.paramserver`` and
``python -m graphserver.server`` parse and fail exactly as ``dorylus paramserver`` and ``dorylus
graphserver`` do without importing :mod:`dorylus.cli` (which would import them again, as
``dorylus.paramserver`` beside ``__main__``, and every other role with them).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Callable

from dorylus.errors import DorylusError

# The roles' one-line descriptions, for `dorylus --help` (without importing the roles) and for
# each role's own parser.
ROLE_HELP = {
    "graphserver": "run one graph server (started by `dorylus train`; for AWS mode by hand)",
    "paramserver": "run the parameter server (started by `dorylus train`; for AWS mode by hand)",
    "lambda-emulator": "serve the AWS Lambda Invoke API locally, running functions in worker processes",
}

_ctrl_c_seen = False


def _on_ctrl_c(signum: int, frame) -> None:
    """Python's default SIGINT behaviour, remembered: C code importing a module may swallow the
    KeyboardInterrupt and raise ImportError in its place (numpy's ``PyCapsule_Import`` does)."""
    global _ctrl_c_seen
    _ctrl_c_seen = True
    raise KeyboardInterrupt


def _forget_escaped_interrupt() -> None:
    """CPython remembers a KeyboardInterrupt that escaped code run through ``PyRun_String`` (native
    code on the torch import path runs some) and at exit kills the process with SIGINT, whatever
    status main returned: about one Ctrl-C in ten during `train`'s imports ended with -2, not 130.
    An empty ``PyRun_SimpleString`` resets that memory."""
    import ctypes

    ctypes.pythonapi.PyRun_SimpleString(b"")


def _interrupted(prog: str) -> int:
    print(f"{prog}: interrupted", file=sys.stderr)
    _forget_escaped_interrupt()
    return 130


def run(prog: str, body: Callable[[], int]) -> int:
    """``body()``'s exit status; a :class:`DorylusError` or a Ctrl-C (also while ``body`` imports
    modules) becomes one line on stderr beginning with ``prog``."""
    global _ctrl_c_seen
    _ctrl_c_seen = False
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_ctrl_c) if in_main_thread else None
    try:
        return body()
    except DorylusError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except Exception:
        if not _ctrl_c_seen:
            raise
        return _interrupted(prog)  # the interrupt, turned into another error by native code
    except KeyboardInterrupt:
        return _interrupted(prog)
    finally:
        if in_main_thread and previous is not None:
            signal.signal(signal.SIGINT, previous)


def role_main(name: str, add_arguments: Callable[[argparse.ArgumentParser], None],
              handler: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """``dorylus NAME ...`` for the role module that gives its ``add_arguments`` and handler."""
    prog = f"dorylus {name}"

    def body() -> int:
        parser = argparse.ArgumentParser(prog=prog, description=ROLE_HELP[name])
        add_arguments(parser)
        return handler(parser.parse_args(sys.argv[1:] if argv is None else argv))

    return run(prog, body)
