"""Which stages the lambda backend runs on its graph server instead of invoking a function.

A stage with element-wise work only and no gradient (GCN's and GAT's BIAS) runs through the cpu
code path on the graph server; everything else is a function call. The backend here has a
stand-in graph server (rows, the parameter server's weights, the result sink) and an endpoint
nobody listens on, so a stage it tried to invoke would fail.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from dorylus.config import TrainConfig
from dorylus.models import get_model
from dorylus.models.base import FUNCTION
from dorylus.models.spec import ModelSpec
from dorylus.protocol import Header, Op
from graphserver.backends.serverless import LambdaBackend

FEATURES, CLASSES, ROWS = 128, 7, 5


def _server(model: str, **config):
    spec = ModelSpec.from_config(TrainConfig(model=model, **config), FEATURES, CLASSES)
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape).astype(np.float32)
               for name, shape in spec.param_shapes()[0].items()}
    buffers, written, pulls = {}, {}, []

    class ParamServer:
        async def request(self, header, tensors=(), *, timeout):
            pulls.append(header)
            assert header.op is Op.PULL_WEIGHTS and header.layer == 0
            return Header(Op.WEIGHTS, layer=0, version=4, names=tuple(weights), meta={"newest": 6}), list(weights.values())

    def rows(name):
        return buffers.setdefault(name, rng.standard_normal((ROWS, spec.layers[0].output_width)).astype(np.float32))

    state = SimpleNamespace(rows=rows, compute=lambda model, *args: model.compute(*args))
    config = SimpleNamespace(task_timeout_s=5.0, relaunch_min_s=5.0, relaunch_ratio=3.0, fallback_after=1,
                             intervals=1, layers=2, staleness=0)
    server = SimpleNamespace(part_id=0, spec=spec, plan=get_model(model).build_plan(spec), config=config,
                             state=state, ps=ParamServer(), scheduler=None, write_result=lambda key, r: written.update({key: r}))
    return server, weights, buffers, written, pulls


def _event(stage, model: str, pass_: str = "train") -> dict:
    return {"model": model, "task": stage.task, "layer": stage.layer, "reads": list(stage.reads),
            "writes": list(stage.writes), "weights": stage.weights, "grad": stage.grad and pass_ == "train",
            "args": {**dict(stage.args), "seed": 0, "epoch": 1, "training": pass_ == "train", "train_count": 3},
            "graph_server": "tcp://127.0.0.1:9", "param_server": "tcp://127.0.0.1:9", "part": 0, "interval": 0,
            "rows": [0, ROWS], "epoch": 1, "pass": pass_, "attempt": 0, "run": "test"}


@pytest.mark.parametrize("model, config, on_server", [
    ("gcn", {}, {"BIAS"}),  # 128 -> 16 projects first: its bias is added after the Gather
    ("gcn", {"hidden": 256}, set()),  # gathers first: the bias joins the product
    ("gat", {"hidden": 8, "heads": 2}, {"BIAS"}),
    ("sage", {}, set()), ("gin", {}, set()),
])
def test_only_element_wise_stages_without_a_gradient_run_on_the_graph_server(model, config, on_server):
    server, *_ = _server(model, **config)
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    for pass_, stages in (("train", server.plan.train), ("eval", server.plan.evaluate)):
        here = {s.task for s in stages if s.kind == FUNCTION and backend.runs_on_server(_event(s, model, pass_))}
        assert here == on_server, pass_


def test_a_bias_stage_adds_the_pulled_bias_on_the_graph_server_without_an_invoke():
    server, weights, buffers, written, pulls = _server("gcn")
    backend = LambdaBackend(server.config, concurrency=1, endpoint_url="http://127.0.0.1:9", function_name="f",
                            server=server)
    bias = next(s for s in server.plan.train if s.task == "BIAS")

    async def call():
        try:
            return await backend.run(_event(bias, "gcn"), ())
        finally:
            await backend.close()

    meta = asyncio.run(call())
    assert meta == {"version": 4, "weight_lag": 2}
    assert [h.meta["weights"] for h in pulls] == ["pin"]  # pinned, as the function would have
    (key, rows), = written.items()
    assert key == ("train", "BIAS", 0, 1, 0)
    np.testing.assert_array_equal(rows[0], buffers["G0"] + weights["bias"])  # the same float32 add
    stats = backend.take_stats()
    assert stats["invocations"] == 1 and stats["failed_calls"] == 0  # counted as a call, none failed
    assert backend.take_stats()["invocations"] == 0
