"""Models and the task registry used by the trainer.

A ``Task`` pairs a linen module with how to initialise it and compute its loss from a batch
dict. ``build_task("gpt" | "mlp" | "cnn", **config)`` builds one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from .cnn import ResNet
from .common import classification_loss, layer_groups, param_count
from .gpt import GPT, Block, Embed, GPTConfig, Head
from .mlp import MLP

__all__ = [
    "GPT",
    "GPTConfig",
    "Embed",
    "Block",
    "Head",
    "MLP",
    "ResNet",
    "Task",
    "TASK_NAMES",
    "build_task",
    "layer_groups",
    "param_count",
]

Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Task:
    """A model plus its batch -> loss contract.

    If ``module`` is a ``GPT`` the batch needs ``"tokens"`` int32[B, T+1] (inputs
    ``tokens[:, :-1]``, targets ``tokens[:, 1:]``); otherwise it is a classifier and the batch
    needs ``"image"`` f32[B, H, W, C] and ``"label"`` int32[B]. Other batch keys are ignored.
    """

    name: str
    module: nn.Module

    @property
    def is_language_model(self) -> bool:
        """Whether the batch is token sequences (``GPT``) rather than labelled images."""
        return isinstance(self.module, GPT)

    def _inputs(self, batch: Batch) -> jax.Array:
        if self.is_language_model:
            return batch["tokens"][:, :-1]
        return batch["image"]

    def init(self, key: jax.Array, batch: Batch) -> Any:
        """Initial parameters (the ``params`` collection only) for inputs shaped like ``batch``."""
        return self.module.init(key, self._inputs(batch))["params"]

    def loss(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Scalar mean cross-entropy (nats) and ``{"loss", "accuracy"}`` f32 scalar metrics.

        For ``GPT`` the mean is over all ``B * T`` next-token predictions.
        """
        logits = self.module.apply({"params": params}, self._inputs(batch))
        if self.is_language_model:
            labels = batch["tokens"][:, 1:]
        else:
            labels = batch["label"]
        return classification_loss(logits, labels)


def _build_gpt(**kwargs: Any) -> nn.Module:
    return GPT(GPTConfig(**kwargs))


_REGISTRY: dict[str, tuple[Callable[..., nn.Module], tuple[str, ...]]] = {
    "gpt": (_build_gpt, tuple(f.name for f in dataclasses.fields(GPTConfig))),
    "mlp": (MLP, ("features", "num_classes")),
    "cnn": (
        ResNet,
        ("channels", "blocks_per_stage", "num_classes", "bottleneck", "imagenet_stem"),
    ),
}

TASK_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def build_task(name: str, **kwargs: Any) -> Task:
    """Build the task ``name`` (one of ``TASK_NAMES``) with model config fields ``kwargs``.

    ``gpt`` takes ``GPTConfig`` fields, ``mlp`` takes ``features, num_classes`` and ``cnn``
    takes ``channels, blocks_per_stage, num_classes``. Raises ValueError on an unknown name,
    an unknown kwarg, or an invalid value.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASK_NAMES)}")
    factory, allowed = _REGISTRY[name]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        import difflib

        hints = [difflib.get_close_matches(u, list(allowed), n=1) for u in unknown]
        mean = [f"{u!r} -> {h[0]!r}" for u, h in zip(unknown, hints, strict=True) if h]
        tail = f"; did you mean {', '.join(mean)}?" if mean else ""
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for task {name!r}; "
            f"allowed: {', '.join(allowed)}{tail}"
        )
    return Task(name=name, module=factory(**kwargs))
