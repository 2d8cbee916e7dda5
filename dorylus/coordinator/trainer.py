"""The training loop of a distributed run (:class:`DistributedTrainer`): the reference
trainer's interface (``step(epoch) -> metrics``) over a :class:`~dorylus.coordinator.cluster.Cluster`;
the graph servers run the epochs themselves (:mod:`graphserver.scheduler`), the coordinator
collects their reports, publishes ``min_epoch``, watches the roles, takes checkpoints and
recovers a role that died (local mode restarts it, cluster mode waits for it). A graph
server's spot interruption notice (:mod:`dorylus.spot`) reaches it in ``progress`` replies and
is passed to ``on_interruption`` (the epoch loop checkpoints at once).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dorylus.config import TrainConfig
from dorylus.coordinator.cluster import Cluster
from dorylus.coordinator.errors import ClusterError
from dorylus.cost import Pricing, epoch_metrics
from dorylus.models.spec import ModelSpec
from dorylus.protocol import Header, Op


class DistributedTrainer:
    """Starts the graph servers' epochs and collects them; ``step(epoch)`` returns epoch
    ``epoch``'s metrics once every graph server reported it.

    The graph servers run their epochs themselves (``train`` command); the coordinator asks
    for their ``progress``, which carries ``min_epoch`` (the oldest epoch some server has not
    finished: async mode's gate) one way and the finished epochs' reports the other, and which
    the servers furthest behind answer at their next news (:data:`PROGRESS_WAIT_S`). The
    parameter server steps by itself once an epoch's gradients are all in.
    """

    # A server answers progress at its next news (a report, a failure, a notice) or after this
    # long: the coordinator waits on the servers instead of polling them (polls every 5 ms cost a
    # 1-part cpu epoch about a fifth of its time: each reply's send waits for the GIL that the
    # server's compute threads hold).
    PROGRESS_WAIT_S = 0.5

    def __init__(self, config: TrainConfig, cluster: Cluster):
        self.config = config
        self.cluster = cluster
        meta = cluster.store.meta
        self.spec = ModelSpec.from_config(config, meta.num_features, meta.num_classes)
        self.counts = {"train": meta.train_count, "val": meta.val_count, "test": meta.test_count}
        cluster.ps_request(Header(Op.COMMAND, meta={"command": "configure", "expected": cluster.intervals}))
        self.started = False
        self.reports: dict[int, list[dict[str, Any]]] = {}  # epoch -> reports, one per graph server so far
        self.finished = [0] * len(cluster.servers)           # last epoch each graph server reported
        self.before = cluster.emulator_stats()
        self.pricing = Pricing.of_run(config, cluster.store.num_parts)
        self.since_epoch = 1  # the parameter server's counts (ps_counts) start here
        # Called once per graph server and notice with (part, the notice's words), from step().
        self.on_interruption = lambda part, notice: None
        self.notices: set[tuple[int, str]] = set()

    @property
    def can_recover(self) -> bool:
        """Whether the cluster can bring its roles back (local mode restarts them; cluster mode
        waits for them at their addresses)."""
        return hasattr(self.cluster, "restart")

    def recover(self, latest) -> None:
        """Restart every role and load ``latest`` (a :class:`~dorylus.runs.Checkpoint` of the last
        finished epoch; None: no epoch finished, the fresh parameter server's seeded weights are
        the start), so that the next ``step`` trains the epoch after it."""
        self.cluster.restart()
        self.cluster.ps_request(Header(Op.COMMAND, meta={"command": "configure", "expected": self.cluster.intervals}))
        self.started = False
        self.reports = {}
        self.finished = [0] * len(self.cluster.servers)
        self.before = self.cluster.emulator_stats()
        self.notices = set()  # new instances
        if latest is not None:
            self.restore(latest.params, latest.optimizer, latest.epoch)
        self.since_epoch = (latest.epoch if latest is not None else 0) + 1

    def _start(self, first: int) -> None:
        self.finished = [first - 1] * len(self.cluster.servers)
        self.cluster.command("train", first=first, last=self.config.epochs, epochs=self.config.epochs,
                             eval_every=self.config.eval_every)
        self.started = True

    def _poll(self) -> None:
        """Take every report the graph servers hold. A server sends its reports oldest first and
        at most a document's worth per reply (``more``: some still wait), so a coordinator that
        was stopped for a while asks again at once until it has caught up."""
        more = True
        while more:
            min_epoch = min(self.finished) + 1
            # The servers that finished least wait for news; those ahead answer at once, so the
            # news that moves async's epoch gate (a laggard's report) is passed on in one round.
            waits = [{"wait_s": self.PROGRESS_WAIT_S if done + 1 == min_epoch else 0.0} for done in self.finished]
            replies = self.cluster.command_replies("progress", each=waits, min_epoch=min_epoch)
            more = False
            for part, reply in enumerate(replies):
                reports = reply.doc if reply.doc is not None else []
                if not isinstance(reports, list) or not all(isinstance(r, dict) and isinstance(r.get("epoch"), int)
                                                            for r in reports):
                    raise ClusterError(f"graph server {part} answered progress with a malformed report list "
                                       f"({str(reports)[:80]})")
                for report in reports:
                    self.reports.setdefault(report["epoch"], []).append(report)
                    self.finished[part] = max(self.finished[part], report["epoch"])
                more = more or reply.meta.get("more") is True
                notice = reply.meta.get("interruption")
                if isinstance(notice, str) and (part, notice) not in self.notices:
                    self.notices.add((part, notice))
                    self.on_interruption(part, notice)
                    self.cluster.interruption_handled(part)

    def step(self, epoch: int) -> dict[str, Any]:
        if not self.started:
            self._start(epoch)
        self.cluster.epoch_begins(epoch)
        start = time.monotonic()
        bound, why = self.cluster.watchdog.bound("epoch")
        while len(self.reports.get(epoch, ())) < len(self.cluster.servers):
            self._poll()
            self.cluster.check(f"epoch {epoch}", time.monotonic() - start, bound, why)
        self.cluster.watchdog.record("epoch", time.monotonic() - start)
        reports = self.reports.pop(epoch)
        # The graph servers time their own epochs: in sync and pipe they do not wait for the
        # coordinator, so the moment this loop sees an epoch says when it looked, not how long
        # the epoch took (a checkpoint's write or a paused coordinator made one epoch seconds
        # long and the next ones near 0). The slowest server's epoch is the run's.
        seconds = max(float(r["epoch_s"]) for r in reports)
        metrics: dict[str, Any] = {"epoch": epoch, "loss": float(sum(r["loss"] for r in reports))}
        if reports[0]["evaluated"]:
            metrics.update({f"{k}_acc": sum(r[f"correct_{k}"] for r in reports) / v if v else float("nan")
                            for k, v in self.counts.items()})
        else:
            metrics.update(train_acc=None, val_acc=None, test_acc=None)
        metrics["epoch_s"] = seconds
        after = self.cluster.emulator_stats()
        metrics.update(self._cost(self.before, after, seconds))
        self.before = after
        reads = sum(r["staleness_reads"] for r in reports)
        metrics.update(
            staleness_max=max(r["staleness_max"] for r in reports),
            staleness_mean=sum(r["staleness_sum"] for r in reports) / reads if reads else 0.0,
            weight_lag_max=max(r["weight_lag_max"] for r in reports),
            relaunches=sum(r["relaunches"] for r in reports), failed_calls=sum(r["failed_calls"] for r in reports),
            fallback_calls=sum(r.get("fallback_calls", 0) for r in reports),
            throttled=sum(r.get("throttled", 0) for r in reports),
            calls=sum(r["invocations"] for r in reports), concurrency=[r["concurrency"] for r in reports])
        # Failed function attempts by kind (graphserver.invoker.FAILURE_KINDS); empty off the lambda backend.
        metrics["failures"] = {k: sum(r.get("failures", {}).get(k, 0) for r in reports)
                               for k in sorted({k for r in reports for k in r.get("failures", {})})}
        metrics["task_s"] = {k: max(r["task_s"].get(k, 0.0) for r in reports)
                             for k in sorted({k for r in reports for k in r["task_s"]})}
        metrics["bytes"] = {k[len("bytes_"):]: sum(r.get(k, 0) for r in reports)
                            for k in ("bytes_functions", "bytes_ghosts", "bytes_params")}
        return metrics

    def ps_counts(self) -> dict[str, Any]:
        """The run's totals from the parameter server, for ``summary.json``: ``gradients`` (pushes
        applied and dropped as duplicates) and ``weight_pulls`` (pulls answered)."""
        reply, _ = self.cluster.ps_request(Header(Op.STATS))
        gradients = {"applied": int(reply.meta["applied"]), "dropped": int(reply.meta["dropped"])}
        if self.since_epoch > 1:  # a recovered run: the counts of the parameter server started then
            gradients["since_epoch"] = self.since_epoch
        return {"gradients": gradients, "weight_pulls": int(reply.meta["pulls"])}

    def _cost(self, before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The epoch's function bill (the emulator's counters since the last epoch) and its
        dollars and value (:func:`dorylus.cost.epoch_metrics`)."""
        invocations = int(after.get("invocations", 0) - before.get("invocations", 0))
        billed_gb_s = float(after.get("billed_gb_s", 0.0) - before.get("billed_gb_s", 0.0))
        return {"invocations": invocations, "billed_gb_s": billed_gb_s,
                **epoch_metrics(self.pricing, seconds, billed_gb_s, invocations)}

    def state(self, epoch: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The parameters (``layers.<l>.<name>``) and optimizer state right after epoch
        ``epoch``'s step (see :mod:`dorylus.optim`)."""
        reply, tensors = self.cluster.ps_request(Header(Op.COMMAND, meta={"command": "get_state", "version": epoch}))
        arrays = {name: np.array(t) for name, t in zip(reply.names, tensors)}
        params = {name: arrays.pop(name) for name in self.spec.named_shapes()}
        return params, arrays

    def restore(self, params: dict[str, np.ndarray], optimizer: dict[str, np.ndarray], epoch: int) -> None:
        """Load a checkpoint's state into the parameter server; its version counts epochs (one
        step each), so the restored version is ``epoch``."""
        arrays = {**{name: np.asarray(w, np.float32) for name, w in params.items()}, **optimizer}
        self.cluster.ps_request(Header(Op.COMMAND, names=tuple(arrays), meta={
            "command": "set_state", "version": epoch, "epoch": epoch, "optimizer": self.config.optimizer}),
            list(arrays.values()))
