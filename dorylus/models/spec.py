"""Layer shapes, activations, dropout and weight init, shared by every role.

The spec is plain data (numpy only) so that the parameter server, the reference trainer and the
function code agree on it without sharing torch code; how a layer is computed, and the names
and shapes of its parameters, are its model module's business (:mod:`dorylus.models`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dorylus.models import MODELS, get_model
from dorylus.models.base import param_key


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``l``: ``H_{l+1} = act(graph_op(dropout(H_l), W_l))``.

    Attributes:
        index: ``l``, also the dropout key's layer component.
        in_dim: width of the layer's input ``H_l``.
        out_dim: width of the layer's output (per head for multi-head attention).
        dropout: probability of dropping an element of ``H_l`` during training.
        activation: ``"relu"`` or ``"elu"``, or ``None`` for the last layer (its output is the logits).
        weight_decay: L2 coefficient applied to every parameter of the layer, its biases
            included (PyG's Planetoid examples decay ``conv1.parameters()``, bias and all).
        heads: attention heads (models with ``MULTI_HEAD``; 1 for others).
        concat: the heads' outputs are concatenated (``heads * out_dim`` wide) or averaged.
        attention_dropout: dropout on attention coefficients (models with ``MULTI_HEAD``).
        options: ``(name, value)`` pairs: the run's ``hidden`` width and the config fields the
            model module declares (its ``CONFIG_FIELDS``), read with :meth:`option`.
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
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

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
        """Layers from a :class:`~dorylus.config.TrainConfig`: ``F -> hidden -> ... -> C``, hidden
        layers activated by the model's ``HIDDEN_ACTIVATION`` (default ReLU); for a model with
        ``MULTI_HEAD`` (GAT), hidden layers have ``heads`` heads of ``hidden`` each
        (concatenated) and the last ``out_heads`` heads of ``C`` (averaged)."""
        if config.model not in MODELS:
            raise ValueError(f"unknown model {config.model!r}; known: {', '.join(MODELS)}")
        model = get_model(config.model)
        attention = bool(getattr(model, "MULTI_HEAD", False))
        activation = getattr(model, "HIDDEN_ACTIVATION", "relu")
        options = (("hidden", config.hidden),
                   *((name, getattr(config, name)) for name in getattr(model, "CONFIG_FIELDS", {})))
        layers = []
        in_dim = num_features
        for i in range(config.layers):
            last = i == config.layers - 1
            layer = LayerSpec(
                index=i,
                in_dim=in_dim,
                out_dim=num_classes if last else config.hidden,
                dropout=config.input_dropout if i == 0 else config.dropout,
                activation=None if last else activation,
                weight_decay=config.weight_decay if (i == 0 or config.weight_decay_scope == "all") else 0.0,
                heads=(config.out_heads if last else config.heads) if attention else 1,
                concat=not last,
                attention_dropout=config.attention_dropout if attention else 0.0,
                options=options,
            )
            layers.append(layer)
            in_dim = layer.output_width
        return cls(arch=config.model, layers=tuple(layers))

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, ``{name: shape}`` of its parameters in the model's order (the model module decides)."""
        model = get_model(self.arch)
        return [dict(model.params(layer)) for layer in self.layers]

    def named_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape under its ``layers.<l>.<name>`` key, layer by layer."""
        return {param_key(l, name): shape for l, shapes in enumerate(self.param_shapes())
                for name, shape in shapes.items()}

    def weight_decays(self) -> dict[str, float]:
        """Every parameter's L2 weight decay: its layer's (:class:`LayerSpec`), biases included."""
        return {param_key(layer.index, name): layer.weight_decay
                for layer, shapes in zip(self.layers, self.param_shapes()) for name in shapes}

    def layer_sizes(self) -> list[int]:
        """Floats of each layer's parameters."""
        return [sum(int(np.prod(shape)) for shape in shapes.values()) for shapes in self.param_shapes()]

    def init_params(self, seed: int) -> list[dict[str, np.ndarray]]:
        """Each layer's initial parameters (the model's ``init_params``) from one numpy generator
        seeded by ``seed`` and drawn layer by layer: every role that needs the initial weights
        (reference trainer, parameter server) gets them bit-identical."""
        rng = np.random.default_rng(seed)
        model = get_model(self.arch)
        params = []
        for layer, shapes in zip(self.layers, self.param_shapes()):
            values = model.init_params(layer, rng)
            if list(values) != list(shapes) or any(v.shape != shapes[k] or v.dtype != np.float32
                                                   for k, v in values.items()):
                raise ValueError(f"{self.arch}.init_params of layer {layer.index} gave "
                                 f"{ {k: (str(v.dtype), v.shape) for k, v in values.items()} }, its params() "
                                 f"declares float32 {shapes}")
            params.append(values)
        return params


def glorot(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """``U(-a, a)`` with ``a = sqrt(6 / (rows + cols))``, ``float32 [rows, cols]``."""
    bound = np.sqrt(6.0 / (rows + cols))
    return rng.uniform(-bound, bound, size=(rows, cols)).astype(np.float32)


def zeros(*shape: int) -> np.ndarray:
    """``float32`` zeros: the biases' initial value (PyG's ``GCNConv``, ``GATConv``)."""
    return np.zeros(shape, np.float32)
