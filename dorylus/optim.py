"""The optimizer every trainer steps with: ``torch.optim`` with one parameter group per layer.

The reference trainer and the parameter server build it with :func:`build_optimizer`, so a
distributed run and the reference apply the same kernel to (round-off equal) gradients on any
CPU; no reimplementation has to match torch's float32 arithmetic bit for bit. The parameter
server is not part of the Lambda bundle, so it may import torch.

:func:`optimizer_arrays` and :func:`load_optimizer_arrays` move the optimizer state as flat
named arrays (``exp_avg_0``, ``exp_avg_sq_0``, ``step_0``, ...), the form that travels in
protocol messages and is stored in checkpoints.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np
import torch

OPTIMIZERS = ("adam", "sgd")
_KEY = re.compile(r"([a-z_]+?)_(\d+)")


def build_optimizer(params: Sequence[torch.Tensor], name: str, lr: float,
                    weight_decays: Sequence[float]) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` or ``SGD`` (torch's defaults otherwise) over ``params``, parameter
    ``i`` in its own group with L2 weight decay ``weight_decays[i]``."""
    if len(params) != len(weight_decays):
        raise ValueError(f"{len(params)} parameters but {len(weight_decays)} weight decays")
    groups = [{"params": [p], "weight_decay": float(wd)} for p, wd in zip(params, weight_decays)]
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")


def optimizer_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """The per-parameter state as ``{"<kind>_<i>": array}``; scalars (Adam's ``step``) as float64
    ``[1]`` arrays. Empty before the first step (and always for plain SGD)."""
    arrays = {}
    for i, param in enumerate(_params(optimizer)):
        for kind, value in optimizer.state.get(param, {}).items():
            value = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
            arrays[f"{kind}_{i}"] = (value.astype(np.float64).reshape(1) if value.ndim == 0 else value.copy())
    return arrays


def load_optimizer_arrays(optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray]) -> None:
    """Restore :func:`optimizer_arrays` output. Raises ``ValueError`` naming the first key that does
    not fit (unknown parameter index, wrong shape) before anything changes."""
    params = _params(optimizer)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        match = _KEY.fullmatch(key)
        if match is None or int(match.group(2)) >= len(params):
            raise ValueError(f"optimizer state key {key!r} names no parameter (the model has {len(params)})")
        kind, i = match.group(1), int(match.group(2))
        value = np.asarray(value)
        if kind == "step":
            if value.shape != (1,) or not np.isfinite(value).all() or value[0] < 0:
                raise ValueError(f"optimizer state {key} must be one step count >= 0, got {value!r}")
            tensor = torch.tensor(float(value[0]), dtype=torch.float32)
        else:
            if value.shape != tuple(params[i].shape):
                raise ValueError(f"optimizer state {key} has shape {list(value.shape)}, parameter {i} has "
                                 f"{list(params[i].shape)}")
            tensor = torch.from_numpy(np.array(value, dtype=np.float32))
        state.setdefault(i, {})[kind] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
