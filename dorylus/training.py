"""``dorylus train``: load the data, run the chosen backend epoch by epoch, record the run."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from dorylus.config import TrainConfig
from dorylus.cost import server_cost_usd
from dorylus.data.graph import GraphDataset
from dorylus.errors import ConfigError
from dorylus.models.reference import ReferenceGCN, SparseAdjacency, accuracy, build_optimizer, masked_loss
from dorylus.models.spec import ModelSpec
from dorylus.normalize import NormalizedAdjacency, gcn_normalize, row_normalize
from dorylus.runs import EpochProgress, RunDir, default_run_dir


@dataclass
class PreparedGraph:
    """A dataset with ``A_hat`` computed on the whole graph and features prepared for training."""

    dataset: GraphDataset
    adjacency: NormalizedAdjacency
    features: np.ndarray  # float32 [N, F], row-normalized if the config asks for it


def prepare_graph(dataset: GraphDataset, config: TrainConfig) -> PreparedGraph:
    adjacency = gcn_normalize(dataset.src, dataset.dst, dataset.num_nodes, symmetrize=not dataset.directed)
    features = row_normalize(dataset.features) if config.row_normalize_features else dataset.features
    return PreparedGraph(dataset=dataset, adjacency=adjacency, features=features)


class ReferenceTrainer:
    """Full-graph training in one process; ``step(epoch)`` returns that epoch's metrics.

    Epochs are numbered from 1; the epoch number is part of the dropout key. Each step is one
    forward/backward pass with dropout and one optimizer step, followed (every ``eval_every``
    epochs) by a forward pass without dropout that gives train/val/test accuracy.
    """

    def __init__(self, config: TrainConfig, graph: PreparedGraph):
        self.config = config
        data = graph.dataset
        self.spec = ModelSpec.from_config(config, data.num_features, data.num_classes)
        self.adj = SparseAdjacency(graph.adjacency)
        self.features = torch.from_numpy(graph.features)
        self.labels = torch.from_numpy(data.labels)
        self.masks = {name: torch.from_numpy(getattr(data, f"{name}_mask")) for name in ("train", "val", "test")}
        self.model = ReferenceGCN(self.spec, config.seed)
        self.optimizer = build_optimizer(self.model, config.optimizer, config.lr)

    def step(self, epoch: int) -> dict[str, Any]:
        start = time.perf_counter()
        self.model.train()
        logits = self.model(self.adj, self.features, epoch, training=True)
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
        # One machine of the graph-server type, so that backends compare in dollars too.
        metrics["invocations"] = 0
        metrics["cost_usd"] = server_cost_usd(self.config.graph_server_instance, metrics["epoch_s"])
        return metrics

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        self.model.eval()
        logits = self.model(self.adj, self.features, epoch, training=False)
        return {f"{name}_acc": accuracy(logits, self.labels, mask) for name, mask in self.masks.items()}

    def state(self, epoch: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "weights": [w.detach().clone() for w in self.model.weights],
            "optimizer": self.optimizer.state_dict(),
        }


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
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
        "mean_epoch_s": sum(m["epoch_s"] for m in history) / len(history),
    }


def run_training(config: TrainConfig, dataset: GraphDataset | None, progress: IO[str] | None = None) -> dict[str, Any]:
    """Train with ``config`` on ``dataset`` (or on the partition store ``config.partitions``),
    writing the run directory; returns the summary."""
    if config.run_dir is None:
        config = dataclasses.replace(config, run_dir=str(default_run_dir(config.dataset, config.backend)))
    if config.backend == "reference":
        if dataset is None:
            raise ConfigError("the reference backend trains on --dataset, not on a partition store")
        trainer = ReferenceTrainer(config, prepare_graph(dataset, config))
        run = RunDir(config.run_dir, config.to_dict())
        try:
            return _train(config, trainer, run, progress, lambda: trainer.state(config.epochs),
                          extra={"dataset": dataset.name, "num_nodes": dataset.num_nodes,
                                 "num_edges": dataset.num_edges})
        finally:
            run.close()

    from dorylus.coordinator import DistributedTrainer, LocalCluster
    from dorylus.partition import assign_parts, open_store, write_store

    # A bad store or partitioning fails before the run directory exists: nothing is left behind.
    store = open_store(config.partitions, verify=True) if config.partitions else None
    if store is None:
        parts = assign_parts(dataset.num_nodes, dataset.src, dataset.dst, config.parts,
                             config.partition_method, seed=config.seed)
    run = RunDir(config.run_dir, config.to_dict())
    try:
        if store is None:
            store_path = run.path / "partitions"
            write_store(dataset, parts, store_path, method=config.partition_method, seed=config.seed)
            store = open_store(store_path, verify=False)
        with LocalCluster(config, store, run.path, run.path / "config.json") as cluster:
            trainer = DistributedTrainer(config, cluster)
            return _train(config, trainer, run, progress, lambda: trainer.checkpoint(run.path / "paramserver.npz"),
                          extra={"dataset": store.meta.dataset, "num_nodes": store.meta.num_nodes,
                                 "num_edges": store.meta.num_edges, "parts": store.num_parts})
    finally:
        run.close()


def _train(config: TrainConfig, trainer, run: RunDir, progress: IO[str] | None, checkpoint,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The epoch loop shared by every backend: log, show progress, checkpoint, summarize."""
    bar = EpochProgress(config.epochs, progress)
    history = []
    for epoch in range(1, config.epochs + 1):
        metrics = trainer.step(epoch)
        history.append(metrics)
        run.log_epoch(metrics)
        bar.update(metrics)
    run.save_checkpoint(checkpoint())
    summary = {"backend": config.backend, "run_dir": str(run.path), **(extra or {}), **summarize(history)}
    if "cost_usd" in history[0]:
        summary["total_cost_usd"] = sum(m["cost_usd"] for m in history)
        summary["invocations"] = sum(m["invocations"] for m in history)
    run.write_summary(summary)
    return summary
