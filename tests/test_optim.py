"""The shared optimizer: a group per named parameter, and its state as flat named arrays that restore exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dorylus.optim import build_optimizer, load_optimizer_arrays, optimizer_arrays

SHAPES = {"layers.0.weight": (6, 4), "layers.0.bias": (4,), "layers.1.weight": (4, 3)}
WEIGHT_DECAYS = {"layers.0.weight": 5e-4, "layers.0.bias": 5e-4, "layers.1.weight": 0.0}


def _params() -> dict[str, torch.nn.Parameter]:
    rng = np.random.default_rng(0)
    return {n: torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32))) for n, s in SHAPES.items()}


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(1)
    return [{n: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for n, s in SHAPES.items()}
            for _ in range(steps)]


def _run(optimizer, params, grads) -> None:
    for step in grads:
        for name, p in params.items():
            p.grad = step[name].clone()
        optimizer.step()


def test_groups_carry_each_parameters_weight_decay():
    optimizer = build_optimizer(_params(), "adam", 0.01, WEIGHT_DECAYS)
    assert optimizer.names == list(SHAPES)
    assert [g["weight_decay"] for g in optimizer.param_groups] == list(WEIGHT_DECAYS.values())
    assert isinstance(optimizer.optimizer, torch.optim.Adam)
    assert isinstance(build_optimizer(_params(), "sgd", 0.1, WEIGHT_DECAYS).optimizer, torch.optim.SGD)
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        build_optimizer(_params(), "rmsprop", 0.01, WEIGHT_DECAYS)
    with pytest.raises(ValueError, match="but weight decays for"):
        build_optimizer(_params(), "adam", 0.01, {"layers.0.weight": 0.0})


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
        assert sorted(arrays) == sorted(f"{p}.{kind}" for p in SHAPES for kind in ("exp_avg", "exp_avg_sq", "step"))
        assert arrays["layers.1.weight.step"].tolist() == [5.0]
        assert arrays["layers.0.bias.exp_avg"].shape == (4,)
    else:
        assert arrays == {}  # plain SGD keeps no state

    resumed = {n: torch.nn.Parameter(p.detach().clone()) for n, p in first_params.items()}
    second = build_optimizer(resumed, name, 0.01, WEIGHT_DECAYS)
    load_optimizer_arrays(second, arrays)
    _run(second, resumed, grads[5:])
    moved = straight["layers.0.weight"].detach().numpy()
    assert not np.allclose(moved, _params()["layers.0.weight"].detach().numpy(), atol=1e-3)  # it moved
    for n in SHAPES:
        # Same kernel on the same inputs; a tolerance anyway, since nothing here needs bit equality.
        np.testing.assert_allclose(resumed[n].detach().numpy(), straight[n].detach().numpy(), rtol=1e-6, atol=1e-7)


def test_load_names_the_key_that_does_not_fit_and_changes_nothing():
    params = _params()
    optimizer = build_optimizer(params, "adam", 0.01, WEIGHT_DECAYS)
    _run(optimizer, params, _grads(2))
    good = optimizer_arrays(optimizer)
    w = "layers.0.weight"
    for arrays, words in [
        ({**good, f"{w}.exp_avg": np.zeros((2, 2), np.float32)},
         "layers.0.weight.exp_avg has shape [2, 2], parameter layers.0.weight has [6, 4]"),
        ({**good, "layers.2.weight.exp_avg": good[f"{w}.exp_avg"]}, "'layers.2.weight.exp_avg' names no parameter"),
        ({**good, "exp_avg_0": good[f"{w}.exp_avg"]}, "'exp_avg_0' names no parameter"),  # an older dorylus's key
        ({**good, "momentum": good[f"{w}.exp_avg"]}, "'momentum' names no parameter"),
        ({**good, f"{w}.step": np.array([1.0, 2.0])}, "layers.0.weight.step must be one step count"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            load_optimizer_arrays(optimizer, arrays)
    assert optimizer_arrays(optimizer)[f"{w}.step"].tolist() == [2.0]
