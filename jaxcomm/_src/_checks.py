"""Argument validation shared by the public functions (trace-time, Python values only)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an int if it is an integer in ``[lo, hi]``; raise otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        raise ValueError(f"{name} must be an integer in [{lo_s}, {hi_s}], got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """Return ``value`` as a finite float inside the given (open or closed) bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    allowed = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
    bad = not math.isfinite(value)
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``allowed``; raise a ValueError listing them otherwise
    (with the closest one, when one is close)."""
    allowed = tuple(allowed)
    if value not in allowed:
        hint = did_you_mean(value, allowed)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}{hint}")
    return value


def did_you_mean(value: Any, allowed: Iterable[Any]) -> str:
    """``"; did you mean 'x'?"`` for the entry of ``allowed`` closest to ``value`` (as text),
    or ``""`` when none is close."""
    import difflib

    hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f"; did you mean {hint[0]!r}?" if hint else ""


def axis_size(axis_name: Any) -> int:
    """Size of a bound mesh axis, with a clear error when it is not bound."""
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: call this inside jax.shard_map (or pmap) "
            f"over a mesh that has an axis named {axis_name!r}"
        ) from e
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if manual is not None and any(name not in manual for name in names):
        raise ValueError(
            f"axis_name={axis_name!r} is bound by jax.vmap, not by a device mesh: jaxcomm's "
            "collectives send messages between devices, so call this inside jax.shard_map "
            f"over a mesh with an axis named {axis_name!r}"
        )
    return size


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds concrete values (not a tracer under jit/vmap/shard_map)."""
    return not isinstance(x, jax.core.Tracer)


def check_finite_if_concrete(name: str, x: Any) -> None:
    """Raise a ValueError when a concrete array holds NaN or Inf (traced arrays pass)."""
    if is_concrete(x):
        arr = np.asarray(x)
        if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
            bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
            raise ValueError(f"{name} holds {bad} non-finite value(s) (NaN or Inf)")
