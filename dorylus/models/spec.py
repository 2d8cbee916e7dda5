"""Layer shapes, activations, dropout and weight init, shared by every role.

The spec is plain data (numpy only) so that the parameter server, the reference trainer and the
function code agree on it without sharing torch code; how a layer is computed, and the shape of
its one weight matrix, are its model module's business (:mod:`dorylus.models`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dorylus.models import MODELS, get_model


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``l``: ``H_{l+1} = act(graph_op(dropout(H_l), W_l))``.

    Attributes:
        index: ``l``, also the dropout key's layer component.
        in_dim: width of the layer's input ``H_l``.
        out_dim: width of the layer's output (per head for multi-head attention).
        dropout: probability of dropping an element of ``H_l`` during training.
        activation: ``"relu"`` or ``"elu"``, or ``None`` for the last layer (its output is the logits).
        weight_decay: L2 coefficient applied to the layer's weights.
        heads: attention heads (GAT; 1 for other models).
        concat: the heads' outputs are concatenated (``heads * out_dim`` wide) or averaged.
        attention_dropout: dropout on attention coefficients (GAT).
    """

    index: int
    in_dim: int
    out_dim: int
    dropout: float
    activation: str | None
    weight_decay: float
    heads: int = 1
    concat: bool = True
    attention_dropout: float = 0.0

    @property
    def is_last(self) -> bool:
        return self.activation is None

    @property
    def output_width(self) -> int:
        """Width of the layer's output rows: ``heads * out_dim`` when concatenated, else ``out_dim``."""
        return self.heads * self.out_dim if self.concat else self.out_dim


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_config(cls, config, num_features: int, num_classes: int) -> "ModelSpec":
        """Layers from a :class:`~dorylus.config.TrainConfig`: ``F -> hidden -> ... -> C``; for
        ``gat``, hidden layers have ``heads`` heads of ``hidden`` each (concatenated, ELU) and the
        last ``out_heads`` heads of ``C`` (averaged)."""
        if config.model not in MODELS:
            raise ValueError(f"unknown model {config.model!r}; known: {', '.join(MODELS)}")
        attention = config.model == "gat"
        layers = []
        in_dim = num_features
        for i in range(config.layers):
            last = i == config.layers - 1
            layer = LayerSpec(
                index=i,
                in_dim=in_dim,
                out_dim=num_classes if last else config.hidden,
                dropout=config.input_dropout if i == 0 else config.dropout,
                activation=None if last else ("elu" if attention else "relu"),
                weight_decay=config.weight_decay if (i == 0 or config.weight_decay_scope == "all") else 0.0,
                heads=(config.out_heads if last else config.heads) if attention else 1,
                concat=not last,
                attention_dropout=config.attention_dropout if attention else 0.0,
            )
            layers.append(layer)
            in_dim = layer.output_width
        return cls(arch=config.model, layers=tuple(layers))

    def weight_shapes(self) -> list[tuple[int, int]]:
        """``(rows, cols)`` of each layer's weight matrix (the model module decides)."""
        model = get_model(self.arch)
        return [model.weight_shape(layer) for layer in self.layers]

    def init_weights(self, seed: int) -> list[np.ndarray]:
        """Each layer's initial weights (the model's ``init_weight``) from one numpy generator
        seeded by ``seed`` and drawn layer by layer: every role that needs the initial weights
        (reference trainer, parameter server) gets them bit-identical."""
        rng = np.random.default_rng(seed)
        model = get_model(self.arch)
        return [model.init_weight(layer, rng) for layer in self.layers]


def glorot(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """``U(-a, a)`` with ``a = sqrt(6 / (rows + cols))``, ``float32 [rows, cols]``."""
    bound = np.sqrt(6.0 / (rows + cols))
    return rng.uniform(-bound, bound, size=(rows, cols)).astype(np.float32)
