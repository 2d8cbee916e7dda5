"""``dorylus train``: load the data, run the chosen backend epoch by epoch, record the run."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from dorylus.config import TrainConfig
from dorylus.coordinator.errors import ClusterError, RoleDied
from dorylus.coordinator.trainer import DistributedTrainer
from dorylus.cost import Pricing, epoch_metrics, value
from dorylus.data.graph import GraphDataset
from dorylus.data.loaders import EdgeStream
from dorylus.errors import ConfigError
from dorylus.models.sparse import SparseRows, in_layout
from dorylus.models.spec import ModelSpec
from dorylus.normalize import NormalizedAdjacency, gcn_normalize, row_normalize
from dorylus.runs import (
    Checkpoint, EpochProgress, RunDir, check_creatable_dir, default_run_dir, load_checkpoint, read_metrics,
)
from graphserver.backends import backend_class


def has_graph_servers(config: TrainConfig) -> bool:
    """Whether ``config``'s backend trains on graph servers (a partition store, a parameter
    server), else on the whole graph in this process (``reference``)."""
    return backend_class(config.backend).graph_servers


@dataclass
class PreparedGraph:
    """A dataset with ``A_hat`` computed on the whole graph and features prepared for training."""

    dataset: GraphDataset
    adjacency: NormalizedAdjacency
    features: np.ndarray | SparseRows  # float32 [N, F] (CSR when sparse_features picks it), row-normalized if asked


def prepare_graph(dataset: GraphDataset, config: TrainConfig) -> PreparedGraph:
    adjacency = gcn_normalize(dataset.src, dataset.dst, dataset.num_nodes, symmetrize=not dataset.directed)
    features = in_layout(dataset.features, config.sparse_features)
    features = row_normalize(features) if config.row_normalize_features else features
    return PreparedGraph(dataset=dataset, adjacency=adjacency, features=features)


class ReferenceTrainer:
    """Full-graph training in one process; ``step(epoch)`` returns that epoch's metrics.

    Epochs are numbered from 1; the epoch number is part of the dropout key. Each step is one
    forward/backward pass with dropout and one optimizer step, followed (every ``eval_every``
    epochs) by a forward pass without dropout that gives train/val/test accuracy.

    torch is imported here, not with the module: a coordinator of the other backends never needs
    it before its first checkpoint, and a run that stops earlier (a refused option, a kill) saves
    its ~2 CPU-seconds of import.
    """

    def __init__(self, config: TrainConfig, graph: PreparedGraph):
        import torch

        from dorylus.models.reference import ReferenceModel, input_features, whole_graph
        from dorylus.optim import build_optimizer

        self.config = config
        data = graph.dataset
        self.spec = ModelSpec.from_config(config, data.num_features, data.num_classes)
        self.graph = whole_graph(graph.adjacency, symmetric=not data.directed)
        self.features = input_features(graph.features)
        self.labels = torch.from_numpy(data.labels)
        self.masks = {name: torch.from_numpy(getattr(data, f"{name}_mask")) for name in ("train", "val", "test")}
        self.model = ReferenceModel(self.spec, config.seed)
        self.optimizer = build_optimizer(dict(self.model.named_parameters()), config.optimizer, config.lr,
                                         self.spec.weight_decays())
        # One machine of the graph-server type, so that backends compare in dollars too.
        self.pricing = Pricing.of_run(config, parts=None)

    def step(self, epoch: int) -> dict[str, Any]:
        from dorylus.models.reference import masked_loss

        start = time.perf_counter()
        self.model.train()
        logits = self.model(self.graph, self.features, epoch, training=True)
        loss = masked_loss(logits, self.labels, self.masks["train"])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        metrics: dict[str, Any] = {"epoch": epoch, "loss": loss.item()}
        if epoch % self.config.eval_every == 0 or epoch == self.config.epochs:
            metrics.update(self.evaluate(epoch))
        else:
            metrics.update(train_acc=None, val_acc=None, test_acc=None)
        metrics["epoch_s"] = time.perf_counter() - start
        metrics["invocations"] = 0
        metrics.update(epoch_metrics(self.pricing, metrics["epoch_s"]))
        return metrics

    def evaluate(self, epoch: int) -> dict[str, float]:
        import torch

        from dorylus.models.reference import accuracy

        self.model.eval()
        with torch.no_grad():
            logits = self.model(self.graph, self.features, epoch, training=False)
            return {f"{name}_acc": accuracy(logits, self.labels, mask) for name, mask in self.masks.items()}

    def state(self, epoch: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Parameters (``layers.<l>.<name>``) and optimizer state after ``epoch`` (the latest
        step) (see :mod:`dorylus.optim`), copies."""
        from dorylus.optim import optimizer_arrays

        return ({name: p.detach().numpy().copy() for name, p in self.model.named_parameters()},
                optimizer_arrays(self.optimizer))

    def restore(self, params: dict[str, np.ndarray], optimizer: dict[str, np.ndarray], epoch: int) -> None:
        import torch

        from dorylus.optim import load_optimizer_arrays

        ours = dict(self.model.named_parameters())
        shapes = {name: tuple(p.shape) for name, p in ours.items()}
        if {name: tuple(np.shape(w)) for name, w in params.items()} != shapes:
            raise ConfigError(f"checkpoint parameters {({n: tuple(np.shape(w)) for n, w in params.items()})} do not "
                              f"fit the model's {shapes}")
        load_optimizer_arrays(self.optimizer, optimizer)
        with torch.no_grad():
            for name, w in params.items():
                ours[name].copy_(torch.from_numpy(np.array(w)))


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its per-epoch metrics. Per-epoch figures keep their metric names
    as means over the epochs (``epoch_s``, ``cost_usd``, ``cost_by_component_usd``), so that
    ``value = 1 / (epoch_s * cost_usd)``; totals are ``total_s`` and ``total_cost_usd``."""
    evaluated = [m for m in history if m.get("val_acc") is not None]
    best = max(evaluated, key=lambda m: m["val_acc"])
    final = evaluated[-1]
    return {
        "epochs": len(history),
        "final_loss": history[-1]["loss"],
        "final_train_acc": final["train_acc"],
        "final_val_acc": final["val_acc"],
        "final_test_acc": final["test_acc"],
        "best_val_acc": best["val_acc"],
        "best_val_epoch": best["epoch"],
        "test_acc_at_best_val": best["test_acc"],
        "total_s": sum(m["epoch_s"] for m in history),
        "epoch_s": sum(m["epoch_s"] for m in history) / len(history),
    }


DEFAULT_PARTS = 2
# What `--resume` may change: how long and how carefully to run, never what is computed.
RESUME_OVERRIDES = frozenset({"epochs", "eval_every", "checkpoint_every", "task_timeout_s", "watchdog_min_s",
                              "watchdog_factor", "functions", "relaunch_min_s", "relaunch_ratio", "fallback_after",
                              "max_recoveries", "lambda_start_latency_ms", "lambda_cold_start_ms", "lambda_keep_warm_s",
                              "lambda_bandwidth_mbps", "lambda_cpu_share", "aws_like", "curve", "max_message_mb",
                              "preempt"})


def check_new_run(config: TrainConfig) -> TrainConfig:
    """``config`` with its run directory chosen, once the checks that need no data pass: what
    the backend needs of this machine (:meth:`~dorylus.config.TrainConfig.check_machine`) and
    that the run directory can be created."""
    if config.run_dir is None:
        config = dataclasses.replace(config, run_dir=str(default_run_dir(config.dataset, config.backend)))
    config.check_machine()
    check_creatable_dir(config.run_dir, "run directory")
    return config


def run_training(config: TrainConfig, dataset: GraphDataset | EdgeStream | None,
                 progress: IO[str] | None = None) -> dict[str, Any]:
    """Train with ``config`` on ``dataset`` (or on the partition store ``config.partitions``),
    writing a new run directory; returns the summary. Every option is checked before the run
    directory is created. Given an :class:`EdgeStream` (``dorylus train --dataset``), only the
    reference backend and the in-memory partitioners load the graph whole: the streaming ones
    write the store part by part, and the graph servers load their own parts."""
    from dorylus.data.loaders import load_dataset

    config = check_new_run(config)
    if not has_graph_servers(config):
        if dataset is None:
            raise ConfigError(f"the {config.backend} backend trains on --dataset, not on a partition store")
        if isinstance(dataset, EdgeStream):
            dataset = dataset.in_memory if dataset.in_memory is not None else load_dataset(config.dataset)
        return _run(config, RunDir.create, dataset, None, {"dataset": dataset.fingerprint(), "partitions": None},
                    None, progress)

    from dorylus.partition import open_store
    from dorylus.partition.placement import assign

    # A bad store or partitioning fails before the run directory exists: nothing is left behind.
    store = open_store(config.partitions, verify=True) if config.partitions else None
    if store is not None:
        if config.parts not in (None, store.num_parts):
            raise ConfigError(f"--parts {config.parts} disagrees with the partition store {config.partitions}, "
                              f"which has {store.num_parts} parts (omit --parts to use the store's)")
        config = dataclasses.replace(config, parts=store.num_parts)
        identity = {"dataset": dataset.fingerprint() if dataset is not None else None,
                    "partitions": store.fingerprint()}
        return _run(config, RunDir.create, dataset, store, identity, None, progress)
    config = dataclasses.replace(config, parts=config.parts or DEFAULT_PARTS)
    stream = dataset if isinstance(dataset, EdgeStream) else EdgeStream.from_dataset(dataset, config.dataset)
    del dataset
    identity = {"dataset": stream.fingerprint(), "partitions": None}  # its passes validate the whole dataset
    assignment = assign(stream, config.parts, config.partition_method, seed=config.seed,
                        load=lambda: load_dataset(config.dataset),
                        progress=lambda line: print(line, file=progress or sys.stderr, flush=True))
    # _run gets the only reference we hold: once the store is written the graph is freed,
    # unless the caller keeps the dataset itself.
    data = [stream]
    del stream
    return _run(config, RunDir.create, data, assignment, identity, None, progress)


@dataclasses.dataclass(frozen=True)
class ClusterArgs:
    """Where a cluster-mode run trains: the cluster file, the coordinator's keys directory
    (None: the file's, or SSM), and how long to wait for servers that are still starting."""

    file: str | Path
    keys: str | Path | None = None
    wait_s: float = 120.0


def _open_cluster(config: TrainConfig, where: ClusterArgs):
    """``(config, cluster)`` for a cluster-mode run: the file, keys and store checked, the
    config bound to the cluster's store. The cluster is not started yet."""
    from dorylus.coordinator.clusterfile import load_cluster_file
    from dorylus.coordinator.remote import RemoteCluster, coordinator_keys, remote_store

    spec = load_cluster_file(where.file)
    if not where.wait_s > 0:
        raise ConfigError(f"--cluster-wait-s must be > 0, got {where.wait_s}")
    if not has_graph_servers(config):
        from graphserver.backends import BACKENDS

        served = [name for name in BACKENDS if backend_class(name).graph_servers]
        raise ConfigError(f"cluster mode runs the {', '.join(served[:-1])} or {served[-1]} backend on the cluster's "
                          f"servers, not {config.backend!r}")
    if config.partitions not in (None, spec.store):
        raise ConfigError(f"--partitions {config.partitions} disagrees with the store of cluster file {spec.path}, "
                          f"{spec.store} (omit --partitions in cluster mode)")
    keys = coordinator_keys(spec, where.keys)
    store = remote_store(spec.store)
    if len(spec.graph_servers) != store.num_parts:
        raise ConfigError(f"cluster file {spec.path} lists {len(spec.graph_servers)} graph server(s) but the store "
                          f"{spec.store} has {store.num_parts} parts: one graph server per part")
    if config.parts not in (None, store.num_parts):
        raise ConfigError(f"--parts {config.parts} disagrees with the store {spec.store}, which has "
                          f"{store.num_parts} parts (omit --parts in cluster mode)")
    config = dataclasses.replace(config, partitions=spec.store, parts=store.num_parts)
    return config, RemoteCluster(config, spec, store, keys, where.wait_s)


def run_cluster_training(config: TrainConfig, where: ClusterArgs, progress: IO[str] | None = None) -> dict[str, Any]:
    """Train with ``config`` on the running servers of a cluster file (cluster mode, see
    :mod:`dorylus.coordinator.remote`), writing a new run directory. Everything is checked first: the
    file, the keys, the store, and (once they answer) the servers' parts, store and config;
    nothing is written until they all agree."""
    config, cluster = _open_cluster(config, where)
    try:
        if config.run_dir is None:
            config = dataclasses.replace(config, run_dir=str(default_run_dir(cluster.store.meta.dataset,
                                                                             config.backend)))
            cluster.config = config
        check_creatable_dir(config.run_dir, "run directory")
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    identity = {"dataset": None, "partitions": cluster.store.fingerprint()}
    return _run(config, RunDir.create, None, cluster.store, identity, None, progress, cluster=cluster)


def resume_training(run_dir: str | Path, overrides: dict[str, Any] | None = None,
                    progress: IO[str] | None = None, cluster: ClusterArgs | None = None) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its checkpoint. ``overrides`` may change only
    :data:`RESUME_OVERRIDES`; a changed dataset, partition store or model is refused."""
    from dorylus.data.loaders import load_dataset, open_edge_stream
    from dorylus.partition import open_store

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json)")
    saved_dict, checkpoint = load_checkpoint(run_dir)
    saved = TrainConfig.from_dict(saved_dict, where=str(run_dir / "checkpoint.pt"))
    changed = {k: v for k, v in (overrides or {}).items() if v is not None and v != getattr(saved, k)}
    refused = sorted(set(changed) - RESUME_OVERRIDES - {"run_dir"})
    if refused:
        k = refused[0]
        raise ConfigError(f"--resume cannot change {k} (the run has {getattr(saved, k)!r}, got {changed[k]!r}); "
                          f"only {', '.join(sorted(RESUME_OVERRIDES))} may change, start a new run otherwise")
    config = dataclasses.replace(saved, **{k: v for k, v in changed.items() if k != "run_dir"}, run_dir=str(run_dir))
    if checkpoint.epoch >= config.epochs:
        raise ConfigError(f"{run_dir} already finished epoch {checkpoint.epoch} of {config.epochs}; "
                          f"pass --epochs N with N > {checkpoint.epoch} to train further")
    remote = None
    if cluster is not None:
        config, remote = _open_cluster(config, cluster)
        try:
            if remote.store.fingerprint() != checkpoint.identity.get("partitions"):
                raise ConfigError(f"the cluster's store {remote.spec.store} is not the one {run_dir} trained on "
                                  f"(sha256 {remote.store.fingerprint()[:12]}..., the checkpoint has "
                                  f"{str(checkpoint.identity.get('partitions'))[:12]}...); refusing to resume on "
                                  "different data")
            remote.start()
        except BaseException:
            remote.close()
            raise
        return _run(config, lambda path, c: RunDir.reopen(path, c, checkpoint.epoch), None, remote.store,
                    dict(checkpoint.identity), checkpoint, progress, cluster=remote)
    config.check_machine()
    own_store = run_dir / "partitions"
    store = None
    if has_graph_servers(config):
        store = open_store(config.partitions or own_store, verify=True)
    dataset = None
    if checkpoint.identity.get("dataset"):  # the graph servers load the store: only the reference needs it whole
        dataset = open_edge_stream(config.dataset) if has_graph_servers(config) else load_dataset(config.dataset)
    identity = {"dataset": dataset.fingerprint() if dataset is not None else None,
                "partitions": store.fingerprint() if checkpoint.identity.get("partitions") else None}
    for what, was in checkpoint.identity.items():
        if was != identity.get(what):
            source = config.dataset if what == "dataset" else (config.partitions or own_store)
            raise ConfigError(f"the {'partition store' if what == 'partitions' else what} {source} changed since "
                              f"the run started (sha256 {str(identity.get(what))[:12]}..., the checkpoint has "
                              f"{str(was)[:12]}...); refusing to resume on different data")
    data = [dataset]  # freed once _run no longer needs it (see run_training)
    del dataset
    return _run(config, lambda path, c: RunDir.reopen(path, c, checkpoint.epoch), data, store, identity,
                checkpoint, progress)


def _run(config: TrainConfig, open_run, dataset: GraphDataset | list | None, placement,
         identity: dict[str, str | None], checkpoint: Checkpoint | None, progress: IO[str] | None,
         cluster=None) -> dict[str, Any]:
    """Open the run directory, build the trainer of ``config.backend`` and train. ``placement``
    is the partition store, or a :class:`~dorylus.partition.placement.Placement` to write into
    the run directory. ``dataset`` may come as a one-element list that this takes over (emptied), so that the dataset is
    freed once the store is written. ``cluster``: a started :class:`~dorylus.coordinator.remote.RemoteCluster`
    (cluster mode), closed here."""
    if isinstance(dataset, list):
        dataset = dataset.pop()
    source = (f"{dataset.name} ({dataset.num_nodes:,} vertices, {dataset.num_edges:,} edges)" if dataset is not None
              else config.partitions)
    where = f" on the cluster of {cluster.spec.path}" if cluster is not None else ""
    print(f"{'resuming' if checkpoint else 'training'} {config.model} ({config.layers} layers, hidden "
          f"{config.hidden}) on {source}{where}, backend {config.backend}, run directory {config.run_dir}"
          + (f", after epoch {checkpoint.epoch} of {config.epochs}" if checkpoint else ""),
          file=progress or sys.stderr, flush=True)
    try:
        run = open_run(config.run_dir, config.to_dict())
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    try:
        if cluster is not None:
            with cluster:
                trainer = DistributedTrainer(config, cluster)
                return _train(config, trainer, run, identity, checkpoint, progress,
                              extra={"dataset": cluster.store.meta.dataset, "num_nodes": cluster.store.meta.num_nodes,
                                     "num_edges": cluster.store.meta.num_edges, "parts": cluster.store.num_parts,
                                     "cluster": str(cluster.spec.path)})
        if not has_graph_servers(config):
            trainer = ReferenceTrainer(config, prepare_graph(dataset, config))
            return _train(config, trainer, run, identity, checkpoint, progress,
                          extra={"dataset": dataset.name, "num_nodes": dataset.num_nodes,
                                 "num_edges": dataset.num_edges})

        from dorylus.coordinator.local import LocalCluster
        from dorylus.lifecycle import in_forked_child, release_freed_memory
        from dorylus.partition import PartitionStore, open_store

        store = placement
        if not isinstance(store, PartitionStore):
            store_path = run.path / "partitions"
            # In a child process: numba, which the store's locality order loads, stays out of
            # the coordinator (0.12 GB resident through the run).
            in_forked_child(lambda: placement.write(store_path, seed=config.seed,
                                                    sparse_features=config.sparse_features),
                            f"writing the partition store {store_path}", keep_out="numba")
            store = open_store(store_path, verify=False)
            identity = {**identity, "partitions": store.fingerprint()}
        # The graph servers load their own parts: nothing of the graph stays in the coordinator.
        del dataset, placement
        release_freed_memory()
        with LocalCluster(config, store, run.path, run.path / "config.json") as cluster:
            trainer = DistributedTrainer(config, cluster)
            return _train(config, trainer, run, identity, checkpoint, progress,
                          extra={"dataset": store.meta.dataset, "num_nodes": store.meta.num_nodes,
                                 "num_edges": store.meta.num_edges, "parts": store.num_parts})
    finally:
        run.close()


def _train(config: TrainConfig, trainer, run: RunDir, identity: dict[str, str | None], resume: Checkpoint | None,
           progress: IO[str] | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The epoch loop shared by every backend: log, show progress, checkpoint, summarize.

    The state after each epoch is kept in memory, written every ``checkpoint_every`` epochs and
    at the end, and written on any way out (Ctrl-C, SIGTERM, a failed role), followed by the
    command that resumes the run."""
    first = 1
    if resume is not None:
        trainer.restore(resume.params, resume.optimizer, resume.epoch)
        first = resume.epoch + 1
    latest, saved = resume, resume.epoch if resume is not None else 0
    bar = EpochProgress(config.epochs, progress)
    recoveries, recovered_in, unlogged = 0, None, 0
    due = False  # a checkpoint is owed (its epoch's state may have been gone: see below)

    def checkpoint_now(part: int, notice: str) -> None:
        # A spot notice: the machine goes within two minutes, so what the run has is written now.
        nonlocal saved
        if latest is not None and latest.epoch > saved:
            run.save_checkpoint(latest)
            saved = latest.epoch
        print(f"graph server {part}: interruption notice ({notice}); checkpoint "
              + (f"after epoch {saved} on disk" if saved else "not written, no epoch finished yet"),
              file=progress or sys.stderr, flush=True)

    if hasattr(trainer, "on_interruption"):
        trainer.on_interruption = checkpoint_now
    try:
        epoch = first
        while epoch <= config.epochs:
            try:
                metrics = trainer.step(epoch)
                # Its state before its metrics: a role that dies meanwhile is recovered from like
                # one that died in the step, and the epoch is trained (and logged) once.
                try:
                    state = Checkpoint(epoch, *trainer.state(epoch), identity=identity)
                except RoleDied:
                    raise
                except ClusterError as exc:
                    # The graph servers do not wait for the coordinator: one that fell more epochs
                    # behind than the parameter server keeps states for finds this epoch's gone.
                    # The last epoch's is always kept; a checkpoint that was due is taken at the
                    # first epoch whose state is still there.
                    if exc.code != "state_gone" or epoch == config.epochs:
                        raise
                    state = None
            except RoleDied as exc:
                # A role's process died: restart the roles from the state after the last finished
                # epoch (kept in `latest`), as --resume would, and train this epoch again. A role
                # that dies again in the same epoch is not bad luck: the run stops as before.
                if not getattr(trainer, "can_recover", False) or recoveries >= config.max_recoveries \
                        or recovered_in == epoch:
                    raise
                recoveries, recovered_in, unlogged = recoveries + 1, epoch, unlogged + 1
                if latest is not None and latest.epoch > saved:  # durable first: the restart may fail
                    run.save_checkpoint(latest)
                    saved = latest.epoch
                print(f"{exc.role} died during epoch {epoch} ({str(exc).splitlines()[0]}); recovery {recoveries} "
                      f"of {config.max_recoveries}: restarting the roles from the state after epoch "
                      f"{latest.epoch if latest is not None else 0}", file=progress or sys.stderr, flush=True)
                trainer.recover(latest)
                continue
            if getattr(trainer, "can_recover", False):
                metrics["recoveries"], unlogged = unlogged, 0
            run.log_epoch(metrics)
            bar.update(metrics)
            due = due or epoch % config.checkpoint_every == 0 or epoch == config.epochs
            if state is not None:
                latest = state
                if due:
                    run.save_checkpoint(latest)
                    saved, due = epoch, False
            epoch += 1
    except BaseException as exc:
        if latest is not None and latest.epoch > saved:
            run.save_checkpoint(latest)
        if latest is not None:
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped by a failure"
            on = f" --cluster {shlex.quote(extra['cluster'])}" if "cluster" in extra else ""  # its servers, again
            print(f"run {why} after epoch {latest.epoch}; checkpoint {run.path / 'checkpoint.pt'}; resume with:\n"
                  f"  dorylus train --resume {shlex.quote(str(run.path))}{on}", file=progress or sys.stderr, flush=True)
        raise
    history = read_metrics(run.path)
    summary = {"backend": config.backend, "run_dir": str(run.path), **extra, **summarize(history)}
    if all("cost_usd" in m for m in history):
        epochs = len(history)
        summary["total_cost_usd"] = sum(m["cost_usd"] for m in history)
        summary["cost_usd"] = summary["total_cost_usd"] / epochs
        if all("cost_by_component_usd" in m for m in history):
            summary["cost_by_component_usd"] = {k: sum(m["cost_by_component_usd"][k] for m in history) / epochs
                                                for k in history[0]["cost_by_component_usd"]}
        if summary["epoch_s"] > 0 and summary["cost_usd"] > 0:
            summary["value"] = value(summary["epoch_s"], summary["cost_usd"])
        summary["invocations"] = sum(m["invocations"] for m in history)
    if any("fallback_calls" in m for m in history):  # the functions' failures and what absorbed them
        summary["relaunches"] = sum(m.get("relaunches", 0) for m in history)
        summary["fallback_calls"] = sum(m.get("fallback_calls", 0) for m in history)
        summary["failures"] = {k: sum(m.get("failures", {}).get(k, 0) for m in history)
                               for k in sorted({k for m in history for k in m.get("failures", {})})}
    summary["pricing"] = trainer.pricing.to_dict()
    if getattr(trainer, "can_recover", False):
        summary["recoveries"] = recoveries
    if hasattr(trainer, "ps_counts"):  # every gradient applied exactly once, duplicates dropped
        summary.update(trainer.ps_counts())
    run.write_summary(summary)
    return summary
