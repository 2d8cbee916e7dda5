"""A tiny graph server for model tests: one partition (no ghosts), a model's plan run stage by
stage over intervals with the model's own functions, as the graph server and backends run them."""

from __future__ import annotations

from collections import Counter

import numpy as np

from dorylus.models.base import GATHER, GATHER_BACKWARD


class Interpreter:
    def __init__(self, model, plan, graph, statics, weights, intervals, train_count, seed):
        self.model, self.plan, self.graph, self.statics = model, plan, graph, statics
        self.weights, self.intervals, self.train_count, self.seed = weights, intervals, train_count, seed
        self.buffers: dict[str, np.ndarray] = {}

    def run(self, training: bool, epoch: int):
        """Returns (summed meta, {layer: float64 dW summed over intervals}); ``self.buffers`` keeps every buffer."""
        n = self.graph.num_rows
        buffers = self.buffers = dict(self.statics)
        grads: dict[int, np.ndarray] = {}
        meta: Counter = Counter()
        for stage in self.plan.train if training else self.plan.evaluate:
            args = {**dict(stage.args), "seed": self.seed, "epoch": epoch, "training": training,
                    "train_count": self.train_count}
            inputs = [buffers[name] for name in stage.reads]
            if stage.kind == GATHER_BACKWARD:
                results = self.model.gather_backward(stage.task, stage.layer, self.graph, inputs, args)
                assert len(results) == len(stage.writes), stage
                for name, got in zip(stage.writes, results):
                    assert got.dtype == np.float32 and got.shape == (n, self.plan.widths[name]), (name, got.shape)
                    buffers[name] = got
                continue
            outs = [np.full((n, self.plan.widths[name]), np.nan, np.float32) for name in stage.writes]
            for start, stop in self.intervals:
                if stage.kind == GATHER:
                    rows, grad_w, extra = self.model.gather(stage.task, stage.layer, self.graph, (start, stop),
                                                            inputs, args), None, {}
                else:
                    w = self.weights[stage.layer] if stage.weights else None
                    result = self.model.compute(stage.task, stage.layer, [x[start:stop] for x in inputs], w, args)
                    rows, grad_w, extra = result.rows, result.grad_w, result.meta
                    assert (grad_w is not None) == (stage.grad and training), stage
                assert len(rows) == len(stage.writes), (stage, len(rows))
                for out, got in zip(outs, rows):
                    assert got.dtype == np.float32 and got.shape == (stop - start, out.shape[1]), (stage, got.shape)
                    out[start:stop] = got
                if grad_w is not None:
                    assert grad_w.shape == self.weights[stage.layer].shape
                    grads[stage.layer] = grads.get(stage.layer, 0) + grad_w.astype(np.float64)
                meta.update(extra)
            for name, out in zip(stage.writes, outs):
                assert not np.isnan(out).any(), name
                buffers[name] = out
        return meta, grads
