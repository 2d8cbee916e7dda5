"""The numpy optimizers against torch.optim as the oracle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dorylus.optim import SGD, Adam, make_optimizer

SHAPES = [(6, 4), (4, 3), (5,)]
WEIGHT_DECAYS = [5e-4, 0.0, 0.1]


def _params(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def _grads(steps: int, seed: int = 1) -> list[list[np.ndarray]]:
    # gradients of very different scales, so that Adam's normalization and eps both matter
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 2)).astype(np.float32) for shape in SHAPES]
            for _ in range(steps)]


def _torch_run(name: str, lr: float, grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    params = [torch.nn.Parameter(torch.from_numpy(p)) for p in _params()]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, WEIGHT_DECAYS)]
    optimizer = torch.optim.Adam(groups, lr=lr) if name == "adam" else torch.optim.SGD(groups, lr=lr)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.from_numpy(g.copy())
        optimizer.step()
    return [p.detach().numpy() for p in params]


def _max_relative_difference(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3))) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("name, lr", [("adam", 0.01), ("adam", 0.5), ("sgd", 0.1)])
def test_matches_torch(name, lr):
    grads = _grads(20)
    params = _params()
    optimizer = make_optimizer(name, lr, WEIGHT_DECAYS)
    for step_grads in grads:
        optimizer.step(params, step_grads)
    expected = _torch_run(name, lr, grads)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(params, _params()))
    assert moved > 10 * lr * 1e-2  # the comparison is not between two untouched copies
    assert _max_relative_difference(params, expected) < 1e-6
    assert all(p.dtype == np.float32 for p in params)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_state_dict_round_trip_continues_identically(name, tmp_path):
    grads = _grads(20)
    straight = _params()
    uninterrupted = make_optimizer(name, 0.01, WEIGHT_DECAYS)
    for step_grads in grads:
        uninterrupted.step(straight, step_grads)

    resumed = _params()
    first = make_optimizer(name, 0.01, WEIGHT_DECAYS)
    for step_grads in grads[:10]:
        first.step(resumed, step_grads)
    np.savez(tmp_path / "state.npz", **first.state_dict())
    with np.load(tmp_path / "state.npz") as saved:
        second = make_optimizer(name, 0.01, WEIGHT_DECAYS)
        second.load_state_dict(dict(saved))
    for step_grads in grads[10:]:
        second.step(resumed, step_grads)

    assert second.steps == 20
    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(a, b)
    assert _max_relative_difference(resumed, _torch_run(name, 0.01, grads)) < 1e-6


def test_state_dict_is_a_copy_and_loads_at_step_zero():
    params = _params()
    adam = Adam(0.01, WEIGHT_DECAYS)
    assert adam.state_dict() == {"steps": 0}
    adam.step(params, _grads(1)[0])
    state = adam.state_dict()
    state["exp_avg.0"][:] = 123.0
    assert not np.any(adam.exp_avg[0] == 123.0)
    fresh = Adam(0.01, WEIGHT_DECAYS)
    fresh.load_state_dict({"steps": 0})
    assert fresh.steps == 0 and fresh.exp_avg == [None] * 3


def test_bad_state_is_refused_without_changing_the_optimizer():
    adam = Adam(0.01, WEIGHT_DECAYS)
    params = _params()
    adam.step(params, _grads(1)[0])
    before = adam.state_dict()
    good = adam.state_dict()
    bad_states = {
        "steps": {**good, "steps": -1},
        "exp_avg_sq.1": {k: v for k, v in good.items() if k != "exp_avg_sq.1"},
        "unexpected keys exp_avg.7": {**good, "exp_avg.7": np.zeros(2, np.float32)},
    }
    for match, state in bad_states.items():
        with pytest.raises(ValueError, match=match):
            adam.load_state_dict(state)
    with pytest.raises(ValueError, match="unexpected keys exp_avg"):
        SGD(0.01, WEIGHT_DECAYS).load_state_dict(good)
    after = adam.state_dict()
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_bad_step_arguments_leave_params_untouched():
    adam = Adam(0.01, WEIGHT_DECAYS)
    params = _params()
    grads = _grads(1)[0]
    with pytest.raises(ValueError, match="2 params and 2 grads for 3 weight decays"):
        adam.step(params[:2], grads[:2])
    with pytest.raises(ValueError, match="grad 2 has shape"):
        adam.step(params, grads[:2] + [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="param 1 must be a float32"):
        adam.step([params[0], params[1].astype(np.float64), params[2]], grads)
    for a, b in zip(params, _params()):
        np.testing.assert_array_equal(a, b)
    assert adam.steps == 0


def test_factory_and_hyperparameter_checks():
    assert isinstance(make_optimizer("adam", 0.01, [0.0]), Adam)
    assert isinstance(make_optimizer("sgd", 0.01, [0.0]), SGD)
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; known: adam, sgd"):
        make_optimizer("rmsprop", 0.01, [0.0])
    with pytest.raises(ValueError, match="learning rate"):
        make_optimizer("adam", 0.0, [0.0])
    with pytest.raises(ValueError, match="weight decays"):
        make_optimizer("sgd", 0.1, [-1.0])


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import dorylus.optim"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
