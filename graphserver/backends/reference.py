"""The ``reference`` backend: the whole graph trained in the coordinator's process with PyTorch
autograd (:class:`dorylus.coordinator.training.ReferenceTrainer` over :mod:`dorylus.models.reference`), the
oracle every other backend is tested against. No graph server, no partition store, no parameter
server, so no cluster mode; priced as one graph-server machine."""

from __future__ import annotations

from graphserver.backends import RunBackend


class ReferenceBackend(RunBackend):
    graph_servers = False

    @classmethod
    def check_config(cls, config) -> list[tuple[bool, str]]:
        return [(config.preempt is None, "preempt needs graph servers; the reference backend has none")]


BACKEND = ReferenceBackend
