"""The roles' logs: every record one line that names its time, its role and its process.

Each role process (``dorylus paramserver``, ``dorylus graphserver``, ``dorylus lambda-emulator``)
calls :func:`setup` once, before it logs anything; from then on every module's records reach
stderr, which ``dorylus train`` appends to ``RUN/logs/<role>.log``, as

    2026-11-25 03:01:02.123 graphserver-1[12345] INFO listening on ipc:///tmp/dorylus-x/graphserver-1

Levels: INFO for listening and once-per-run facts, WARNING for what a peer or the machine did
wrong and the role survives (a refused message, a spot notice), ERROR for a failure of the
role's own work. The one line a command ends with on an error (:mod:`dorylus.commandline`)
is not a record: it is the command line's answer, the same for every command.

The function logs in Lambda's style instead (:mod:`lambdas.handler`): Lambda's runtime, and the
emulator's worker in its place, formats its records.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def formatter(role: str) -> logging.Formatter:
    """``DATE TIME.MS ROLE[PID] LEVEL message``, in local time."""
    return logging.Formatter(f"%(asctime)s.%(msecs)03d {role.replace('%', '%%')}[%(process)d] "
                             f"%(levelname)s %(message)s", DATE_FORMAT)


class _RoleHandler(logging.StreamHandler):
    """The handler :func:`setup` installs; a second setup replaces it (tests call it twice)."""


def setup(role: str, level: str = "INFO") -> None:
    """Send every record at ``level`` or above to stderr, formatted for ``role`` (the name of its
    log file: ``paramserver``, ``graphserver-1``), and Python's warnings with them."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RoleHandler)]:
        root.removeHandler(handler)
    handler = _RoleHandler(sys.stderr)
    handler.setFormatter(formatter(role))
    root.addHandler(handler)
    root.setLevel(level)
    warnings.showwarning = _log_warning


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning as one record (``logging.captureWarnings`` makes it two lines, the
    second, the source line, without the role)."""
    logging.getLogger("py.warnings").warning("%s:%d: %s: %s", filename, lineno, category.__name__, message)


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LEVELS,
                        help="the least severe records logged (default: INFO)")
