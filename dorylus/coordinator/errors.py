"""The errors a run of roles ends with: :class:`ClusterError` (one line for the user, with a
code), and :class:`RoleDied`, the one the training loop may recover from."""

from __future__ import annotations

from dorylus.errors import DorylusError


class ClusterError(DorylusError):
    """A role failed to start, reported an error, died or stalled; the message says which and why.
    Not bad input, so the CLI exits with status 1. ``code``: the ERROR reply's code, if one came."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code

    exit_status = 1


class RoleDied(ClusterError):
    """A running role's process exited (``role``: its name). The training loop may restart the
    roles and go on from the last epoch's state (``--max-recoveries``, :func:`dorylus.training._train`)."""

    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role
