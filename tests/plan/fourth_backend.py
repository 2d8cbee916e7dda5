"""A fourth backend for the planner's tests, registered by monkeypatching ``BACKENDS``: the cpu
backend's calls priced at scale on another instance. The planner must list, predict and price it
from the registry alone."""

from __future__ import annotations

from graphserver.backends.cpu import CpuBackend


class FourthBackend(CpuBackend):
    scale_instance = "c5n.4xlarge"


BACKEND = FourthBackend
