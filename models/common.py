"""Helpers shared by the models: validation, classification loss, parameter bookkeeping."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

_INPUT_GROUPS = ("embed", "stem")
_OUTPUT_GROUPS = ("head",)


def check_positive_int(owner: str, field: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a positive ``int`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{field} must be a positive int, got {value!r}")


def check_positive_int_tuple(owner: str, field: str, value: Any) -> tuple[int, ...]:
    """Return ``value`` as a tuple after checking it is a non-empty sequence of positive ints."""
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(
            f"{owner}.{field} must be a non-empty sequence of positive ints, got {value!r}"
        ) from None
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in items):
        raise ValueError(
            f"{owner}.{field} must be a non-empty sequence of positive ints, got {value!r}"
        )
    return items


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict]:
    """Mean softmax cross-entropy (nats) and accuracy (fraction in [0, 1]).

    ``logits`` is f32[..., C] and ``labels`` int[...] with the same leading shape. Returns the
    scalar mean loss and ``{"loss": ..., "accuracy": ...}`` of f32 scalars.
    """
    logits = logits.astype(jnp.float32)
    labels = labels.astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32).mean()
    return loss, {"loss": loss, "accuracy": accuracy}


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _group_key(name: str) -> tuple:
    if name in _INPUT_GROUPS:
        rank = 0
    elif name in _OUTPUT_GROUPS:
        rank = 2
    else:
        rank = 1
    return (rank, _natural_key(name))


def layer_groups(params: Mapping[str, Any]) -> list[str]:
    """Top-level keys of a ``params`` tree in layer order, input -> output.

    Input groups (``embed``, ``stem``) come first, ``head`` last, and everything else in
    between sorted with embedded numbers compared numerically (``block_9`` before ``block_10``,
    ``stage0_block1`` before ``stage1_block0``).
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a mapping of layer groups, got {type(params).__name__}")
    return sorted(params.keys(), key=_group_key)


def param_count(params: Any) -> int:
    """Total number of scalar parameters (elements) across all leaves of ``params``.

    Leaves may be arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
    """
    return int(sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(params)))
