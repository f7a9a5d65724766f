"""A multilayer perceptron classifier in ``flax.linen``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .common import check_positive_int, check_positive_int_tuple


class MLP(nn.Module):
    """ReLU MLP classifier: f32[B, ...] (flattened per example) -> f32[B, num_classes] logits.

    Submodules ``dense_0`` .. ``dense_{k-1}`` (``k = len(features)``, each Dense + ReLU) and
    ``head`` (Dense to ``num_classes``).
    """

    features: tuple[int, ...] = (128, 128)
    num_classes: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "features", check_positive_int_tuple("MLP", "features", self.features)
        )
        check_positive_int("MLP", "num_classes", self.num_classes)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32).reshape(x.shape[0], -1)
        for i, width in enumerate(self.features):
            h = nn.relu(nn.Dense(width, name=f"dense_{i}")(h))
        return nn.Dense(self.num_classes, name="head")(h)
