"""Layer shapes, activations, dropout and weight init, shared by every role.

The spec is plain data (numpy only) so that the parameter server, the reference trainer and the
function code agree on it without sharing torch code; how a layer is computed is its model
module's business (:mod:`dorylus.models`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dorylus.models import MODELS


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``l``: ``H_{l+1} = act(A_hat · dropout(H_l) · W_l)``.

    Attributes:
        index: ``l``, also the dropout key's layer component.
        in_dim, out_dim: ``W_l`` is ``float32 [in_dim, out_dim]``.
        dropout: probability of dropping an element of ``H_l`` during training.
        activation: ``"relu"``, or ``None`` for the last layer (its output is the logits).
        weight_decay: L2 coefficient applied to ``W_l``.
    """

    index: int
    in_dim: int
    out_dim: int
    dropout: float
    activation: str | None
    weight_decay: float

    @property
    def is_last(self) -> bool:
        return self.activation is None


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_config(cls, config, num_features: int, num_classes: int) -> "ModelSpec":
        """Layer shapes ``[F, hidden, ..., hidden, C]`` from a :class:`~dorylus.config.TrainConfig`."""
        if config.model not in MODELS:
            raise ValueError(f"unknown model {config.model!r}; known: {', '.join(MODELS)}")
        dims = [num_features] + [config.hidden] * (config.layers - 1) + [num_classes]
        layers = []
        for i in range(config.layers):
            last = i == config.layers - 1
            layers.append(LayerSpec(
                index=i,
                in_dim=dims[i],
                out_dim=dims[i + 1],
                dropout=config.input_dropout if i == 0 else config.dropout,
                activation=None if last else "relu",
                weight_decay=config.weight_decay if (i == 0 or config.weight_decay_scope == "all") else 0.0,
            ))
        return cls(arch=config.model, layers=tuple(layers))

    def init_weights(self, seed: int) -> list[np.ndarray]:
        """Glorot-uniform ``W_l ~ U(-a, a)``, ``a = sqrt(6 / (in_dim + out_dim))``, from one numpy
        generator seeded by ``seed`` and drawn layer by layer: every role that needs the initial
        weights (reference trainer, parameter server) gets them bit-identical."""
        rng = np.random.default_rng(seed)
        weights = []
        for layer in self.layers:
            bound = np.sqrt(6.0 / (layer.in_dim + layer.out_dim))
            weights.append(rng.uniform(-bound, bound, size=(layer.in_dim, layer.out_dim)).astype(np.float32))
        return weights
