"""The shared optimizer: per-layer groups, and its state as flat named arrays that restore exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.optim import build_optimizer, load_optimizer_arrays, optimizer_arrays

SHAPES = [(6, 4), (4, 3)]
WEIGHT_DECAYS = [5e-4, 0.0]


def _params() -> list[torch.nn.Parameter]:
    rng = np.random.default_rng(0)
    return [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32))) for s in SHAPES]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    rng = np.random.default_rng(1)
    return [[torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in SHAPES] for _ in range(steps)]


def _run(optimizer: torch.optim.Optimizer, params, grads) -> None:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()


def test_groups_carry_each_layers_weight_decay():
    optimizer = build_optimizer(_params(), "adam", 0.01, WEIGHT_DECAYS)
    assert [g["weight_decay"] for g in optimizer.param_groups] == WEIGHT_DECAYS
    assert isinstance(optimizer, torch.optim.Adam)
    assert isinstance(build_optimizer(_params(), "sgd", 0.1, WEIGHT_DECAYS), torch.optim.SGD)
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        build_optimizer(_params(), "rmsprop", 0.01, WEIGHT_DECAYS)
    with pytest.raises(ValueError, match="2 parameters but 1 weight decays"):
        build_optimizer(_params(), "adam", 0.01, [0.0])


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_arrays_round_trip_continues_like_an_uninterrupted_run(name):
    grads = _grads(12)
    straight = _params()
    _run(build_optimizer(straight, name, 0.01, WEIGHT_DECAYS), straight, grads)

    first_params = _params()
    first = build_optimizer(first_params, name, 0.01, WEIGHT_DECAYS)
    _run(first, first_params, grads[:5])
    arrays = optimizer_arrays(first)
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    if name == "adam":
        assert sorted(arrays) == ["exp_avg_0", "exp_avg_1", "exp_avg_sq_0", "exp_avg_sq_1", "step_0", "step_1"]
        assert arrays["step_1"].tolist() == [5.0]
    else:
        assert arrays == {}  # plain SGD keeps no state

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    second = build_optimizer(resumed, name, 0.01, WEIGHT_DECAYS)
    load_optimizer_arrays(second, arrays)
    _run(second, resumed, grads[5:])
    assert not np.allclose(straight[0].detach().numpy(), _params()[0].detach().numpy(), atol=1e-3)  # it moved
    for a, b in zip(resumed, straight):
        # Same kernel on the same inputs; a tolerance anyway, since nothing here needs bit equality.
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_load_names_the_key_that_does_not_fit_and_changes_nothing():
    params = _params()
    optimizer = build_optimizer(params, "adam", 0.01, WEIGHT_DECAYS)
    _run(optimizer, params, _grads(2))
    good = optimizer_arrays(optimizer)
    for arrays, words in [
        ({**good, "exp_avg_0": np.zeros((2, 2), np.float32)}, "exp_avg_0 has shape [2, 2], parameter 0 has [6, 4]"),
        ({**good, "exp_avg_2": good["exp_avg_0"]}, "'exp_avg_2' names no parameter"),
        ({**good, "momentum": good["exp_avg_0"]}, "'momentum' names no parameter"),
        ({**good, "step_0": np.array([1.0, 2.0])}, "step_0 must be one step count"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_optimizer_arrays(optimizer, arrays)
    assert optimizer_arrays(optimizer)["step_0"].tolist() == [2.0]
