"""Numpy optimizers that reproduce ``torch.optim.Adam`` and ``torch.optim.SGD`` step for step.

The parameter server updates the weights without torch, yet its weights must track the reference
trainer's (which uses torch.optim), so the arithmetic below follows torch's CPU implementation
operation by operation: L2 weight decay added to the gradient, Adam's bias correction applied to
the step size and to ``sqrt(v)`` (never folded into ``m`` or ``v``), and the multiply-adds that
torch's kernels fuse rounded once, as they are there (:func:`_fused_multiply_add`). On a CPU with
FMA the results then equal torch's bit for bit in practice, not just to round-off.

State is plain data: ``state_dict()`` is a flat ``{str: int | np.ndarray}`` that pickles and
``np.savez`` can store as is.
"""

from __future__ import annotations

import math

import numpy as np


class Optimizer:
    """Updates a fixed list of float32 parameters in place; ``weight_decays[i]`` belongs to param ``i``."""

    name = ""

    def __init__(self, lr: float, weight_decays: list[float]):
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"{self.name}: learning rate must be a positive number, got {lr!r}")
        if any(not (math.isfinite(wd) and wd >= 0) for wd in weight_decays):
            raise ValueError(f"{self.name}: weight decays must be numbers >= 0, got {list(weight_decays)!r}")
        self.lr = float(lr)
        self.weight_decays = [float(wd) for wd in weight_decays]
        self.steps = 0

    def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> None:
        """One update of every ``params[i]`` (float32, in place) with gradient ``grads[i]`` (same shape)."""
        if not len(params) == len(grads) == len(self.weight_decays):
            raise ValueError(f"{self.name}: got {len(params)} params and {len(grads)} grads for "
                             f"{len(self.weight_decays)} weight decays")
        for i, (param, grad) in enumerate(zip(params, grads)):
            if not isinstance(param, np.ndarray) or param.dtype != np.float32:
                raise ValueError(f"{self.name}: param {i} must be a float32 numpy array, got {type(param).__name__} "
                                 f"{getattr(param, 'dtype', '')}")
            if np.shape(grad) != param.shape:
                raise ValueError(f"{self.name}: grad {i} has shape {np.shape(grad)}, param has {param.shape}")
            self._check_state(i, param)
        self.steps += 1
        for i, (param, grad) in enumerate(zip(params, grads)):
            grad = np.asarray(grad, dtype=np.float32)
            if self.weight_decays[i] != 0:
                grad = _fused_multiply_add(grad, np.float32(self.weight_decays[i]), param)
            self._update(i, param, grad)

    def _check_state(self, i: int, param: np.ndarray) -> None:
        """Raise before any parameter changes if the state kept for param ``i`` does not fit it."""

    def _update(self, i: int, param: np.ndarray, grad: np.ndarray) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, int | np.ndarray]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` of an optimizer of the same kind over the same parameters
        (a dict, or what ``np.load`` returns for an ``np.savez`` of it)."""
        steps = np.asarray(state.get("steps") if hasattr(state, "get") else None)
        if steps.ndim != 0 or not np.issubdtype(steps.dtype, np.integer) or steps < 0:
            raise ValueError(f"{self.name} state: 'steps' must be an int >= 0, got {steps!r}")
        steps = int(steps)
        arrays = self._load_arrays(state, steps)
        loaded = {f"{kind}.{i}" for kind, values in arrays.items() for i, a in enumerate(values) if a is not None}
        unknown = sorted(set(state) - {"steps"} - loaded)
        if unknown:
            raise ValueError(f"{self.name} state: unexpected keys {', '.join(unknown)} "
                             f"(saved by another optimizer, or for another number of parameters?)")
        self.steps = steps
        for kind, values in arrays.items():
            setattr(self, kind, values)

    def _load_arrays(self, state, steps: int) -> dict[str, list[np.ndarray | None]]:
        """Per-parameter state lists by attribute name, validated, as float32 copies."""
        return {}


class SGD(Optimizer):
    """``p <- p - lr * (g + wd * p)`` (``torch.optim.SGD`` without momentum)."""

    name = "sgd"

    def _update(self, i: int, param: np.ndarray, grad: np.ndarray) -> None:
        _fused_multiply_add(param, np.float32(-self.lr), grad, out=param)


class Adam(Optimizer):
    """``torch.optim.Adam`` (amsgrad off). At step ``t``, with ``g`` already including ``wd * p``::

        m <- m + (g - m) (1 - beta1)               v <- beta2 v + (1 - beta2) g^2
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    """

    name = "adam"

    def __init__(self, lr: float, weight_decays: list[float], betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(lr, weight_decays)
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"adam: betas must be two numbers in [0, 1), got {betas!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"adam: eps must be >= 0, got {eps!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.exp_avg: list[np.ndarray | None] = [None] * len(self.weight_decays)
        self.exp_avg_sq: list[np.ndarray | None] = [None] * len(self.weight_decays)

    def _check_state(self, i: int, param: np.ndarray) -> None:
        if self.exp_avg[i] is not None and self.exp_avg[i].shape != param.shape:
            raise ValueError(f"adam: state of param {i} has shape {self.exp_avg[i].shape}, param has {param.shape}")

    def _update(self, i: int, param: np.ndarray, grad: np.ndarray) -> None:
        beta1, beta2 = self.betas
        if self.exp_avg[i] is None:
            self.exp_avg[i] = np.zeros_like(param)
            self.exp_avg_sq[i] = np.zeros_like(param)
        m, v = self.exp_avg[i], self.exp_avg_sq[i]
        _fused_multiply_add(m, np.float32(1 - beta1), grad - m, out=m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v *= np.float32(beta2)
        _fused_multiply_add(v, np.float32(1 - beta2) * grad, grad, out=v)
        # bias corrections in Python floats (float64), as torch computes them
        step_size = self.lr / (1 - beta1 ** self.steps)
        bias_correction2_sqrt = (1 - beta2 ** self.steps) ** 0.5
        denom = np.sqrt(v) / np.float32(bias_correction2_sqrt) + np.float32(self.eps)
        param += (np.float32(-step_size) * m) / denom  # torch's addcdiv: (value * m) / denom

    def state_dict(self) -> dict[str, int | np.ndarray]:
        state = super().state_dict()
        for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
            if m is not None:
                state[f"exp_avg.{i}"] = m.copy()
                state[f"exp_avg_sq.{i}"] = v.copy()
        return state

    def _load_arrays(self, state, steps: int) -> dict[str, list[np.ndarray | None]]:
        count = len(self.weight_decays)
        arrays: dict[str, list[np.ndarray | None]] = {"exp_avg": [None] * count, "exp_avg_sq": [None] * count}
        if steps == 0:  # no update yet: the moments start at zero on the first step
            return arrays
        for i in range(count):
            m, v = state.get(f"exp_avg.{i}"), state.get(f"exp_avg_sq.{i}")
            if m is None or v is None or np.shape(m) != np.shape(v):
                raise ValueError(f"adam state: param {i} needs exp_avg.{i} and exp_avg_sq.{i} of one shape")
            arrays["exp_avg"][i] = np.array(m, dtype=np.float32)
            arrays["exp_avg_sq"][i] = np.array(v, dtype=np.float32)
        return arrays


def _fused_multiply_add(a: np.ndarray, b: np.float32 | np.ndarray, c: np.ndarray,
                        out: np.ndarray | None = None) -> np.ndarray:
    """``a + b * c`` for float32 operands, rounded once to float32 as an FMA instruction does.

    The float32 product is exact in float64, so one float64 add and one rounding to float32 give
    the fused result (except where double rounding differs, about 1 case in 2^29).
    """
    rounded_once = np.add(a, np.multiply(b, c, dtype=np.float64)).astype(np.float32)
    if out is None:
        return rounded_once
    out[...] = rounded_once
    return out


OPTIMIZERS = {"adam": Adam, "sgd": SGD}


def make_optimizer(name: str, lr: float, weight_decays: list[float]) -> Optimizer:
    """The optimizer ``name`` (``"adam"`` or ``"sgd"``, torch's defaults otherwise)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](lr, weight_decays)
