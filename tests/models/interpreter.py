"""A tiny graph server for model tests: one partition (no ghosts), a model's plan run stage by
stage over intervals with the model's own functions, as the graph server and backends run them."""

from __future__ import annotations

from collections import Counter

import numpy as np

from dorylus.models.base import GATHER, GATHER_BACKWARD


class Interpreter:
    def __init__(self, model, plan, graph, statics, params, intervals, train_count, seed):
        """``params``: per layer, ``{name: float32 array}`` (``ModelSpec.init_params``)."""
        self.model, self.plan, self.graph, self.statics = model, plan, graph, statics
        self.params, self.intervals, self.train_count, self.seed = params, intervals, train_count, seed
        self.buffers: dict[str, np.ndarray] = {}

    def run(self, training: bool, epoch: int):
        """Returns (summed meta, {layer: {name: float64 gradient summed over intervals}});
        ``self.buffers`` keeps every buffer."""
        n = self.graph.num_rows
        buffers = self.buffers = dict(self.statics)
        grads: dict[int, dict[str, np.ndarray]] = {}
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
                    rows, layer_grads, extra = self.model.gather(stage.task, stage.layer, self.graph, (start, stop),
                                                                 inputs, args), None, {}
                else:
                    params = self.params[stage.layer] if stage.weights else None
                    result = self.model.compute(stage.task, stage.layer, [x[start:stop] for x in inputs], params,
                                                args)
                    rows, layer_grads, extra = result.rows, result.grads, result.meta
                    assert (layer_grads is not None) == (stage.grad and training), stage
                assert len(rows) == len(stage.writes), (stage, len(rows))
                for out, got in zip(outs, rows):
                    assert got.dtype == np.float32 and got.shape == (stop - start, out.shape[1]), (stage, got.shape)
                    out[start:stop] = got
                if layer_grads is not None:
                    declared = self.params[stage.layer]
                    assert list(layer_grads) == list(declared), (stage, list(layer_grads))  # every parameter, in order
                    total = grads.setdefault(stage.layer, {})
                    for name, grad in layer_grads.items():
                        assert grad.dtype == np.float32 and grad.shape == declared[name].shape, (stage, name)
                        total[name] = total.get(name, 0) + grad.astype(np.float64)
                meta.update(extra)
            for name, out in zip(stage.writes, outs):
                assert not np.isnan(out).any(), name
                buffers[name] = out
        return meta, grads
