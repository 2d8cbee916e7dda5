"""The optimizer every trainer steps with: ``torch.optim`` over named parameters, one group each.

The reference trainer and the parameter server build it with :func:`build_optimizer`, so a
distributed run and the reference apply the same kernel to (round-off equal) gradients on any
CPU; no reimplementation has to match torch's float32 arithmetic bit for bit. The parameter
server is not part of the Lambda bundle, so it may import torch.

Parameters are named as everywhere else (``layers.<l>.<name>``, :func:`dorylus.models.base.param_key`);
each is its own group with its own L2 weight decay. :func:`optimizer_arrays` and
:func:`load_optimizer_arrays` move the optimizer state as flat arrays named ``<parameter>.<kind>``
(``layers.0.weight.exp_avg``, ``layers.0.weight.exp_avg_sq``, ``layers.0.weight.step``, ...), the
form that travels in protocol messages and is stored in checkpoints.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

OPTIMIZERS = ("adam", "sgd")


class NamedOptimizer:
    """A ``torch.optim`` optimizer and the names of its parameters, one group per parameter in
    the order of ``names``; ``step()`` and ``zero_grad()`` are the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: list[str]):
        self.optimizer, self.names = optimizer, names

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def build_optimizer(params: Mapping[str, torch.Tensor], name: str, lr: float,
                    weight_decays: Mapping[str, float]) -> NamedOptimizer:
    """``torch.optim.Adam`` or ``SGD`` (torch's defaults otherwise) over ``params`` (name ->
    tensor), each parameter in its own group with L2 weight decay ``weight_decays[name]``."""
    if set(params) != set(weight_decays):
        raise ValueError(f"parameters {sorted(params)} but weight decays for {sorted(weight_decays)}")
    names = list(params)
    groups = [{"params": [params[n]], "weight_decay": float(weight_decays[n])} for n in names]
    if name == "adam":
        return NamedOptimizer(torch.optim.Adam(groups, lr=lr), names)
    if name == "sgd":
        return NamedOptimizer(torch.optim.SGD(groups, lr=lr), names)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")


def optimizer_arrays(optimizer: NamedOptimizer) -> dict[str, np.ndarray]:
    """The per-parameter state as ``{"<parameter>.<kind>": array}``; scalars (Adam's ``step``)
    as float64 ``[1]`` arrays. Empty before the first step (and always for plain SGD)."""
    arrays = {}
    for name, param in zip(optimizer.names, _params(optimizer)):
        for kind, value in optimizer.optimizer.state.get(param, {}).items():
            value = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
            arrays[f"{name}.{kind}"] = (value.astype(np.float64).reshape(1) if value.ndim == 0 else value.copy())
    return arrays


def load_optimizer_arrays(optimizer: NamedOptimizer, arrays: Mapping[str, np.ndarray]) -> None:
    """Restore :func:`optimizer_arrays` output. Raises ``ValueError`` naming the first key that does
    not fit (unknown parameter, wrong shape) before anything changes."""
    params = dict(zip(optimizer.names, _params(optimizer)))
    index = {name: i for i, name in enumerate(optimizer.names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        name, _, kind = key.rpartition(".")
        if name not in params or not kind:
            raise ValueError(f"optimizer state key {key!r} names no parameter (the model has "
                             f"{', '.join(optimizer.names)})")
        value = np.asarray(value)
        if kind == "step":
            if value.shape != (1,) or not np.isfinite(value).all() or value[0] < 0:
                raise ValueError(f"optimizer state {key} must be one step count >= 0, got {value!r}")
            tensor = torch.tensor(float(value[0]), dtype=torch.float32)
        else:
            if value.shape != tuple(params[name].shape):
                raise ValueError(f"optimizer state {key} has shape {list(value.shape)}, parameter {name} has "
                                 f"{list(params[name].shape)}")
            tensor = torch.from_numpy(np.array(value, dtype=np.float32))
        state.setdefault(index[name], {})[kind] = tensor
    torch_optimizer = optimizer.optimizer
    torch_optimizer.load_state_dict({"state": state, "param_groups": torch_optimizer.state_dict()["param_groups"]})


def _params(optimizer: NamedOptimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
