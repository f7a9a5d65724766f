"""Per-layer forward and backward time of a model, for DreamDDP's scheduler.

DreamDDP (Sec. 3, "profiler") needs each layer's backward time ``b_l`` and each layer's
communication time ``c_l``. :func:`profile_layers` measures the backward by *cumulative
backward prefixes*: program ``P_l`` computes the loss and its gradient with respect to the
parameters of layers ``l .. L-1`` only (the layers below are constants), so its backward
runs from the output down to layer ``l`` and stops there (JAX prunes the cotangents nobody
needs); ``P_L`` is the forward alone. With ``T_l`` the time of ``P_l``::

    forward_s = T_L,    b_l = T_l - T_{l+1}

The prefixes telescope, so ``forward_s + sum(b)`` is ``T_0``, the full forward and
backward (exactly, unless a difference was clipped at 0; see below). Each prefix is one
whole program, so no per-layer launch or dispatch overhead is counted ``L`` times (timing
each layer's VJP alone would). Two ways to get ``T_l``:

* ``roofline=`` a :class:`jaxcomm.compute.Roofline`: the roofline seconds of the compiled prefix's
  flops and memory bytes (:func:`jaxcomm.audit.program_cost`) on that device: deterministic, the
  same on any host, and what the simulated clock of the trainers uses;
* ``roofline=None``: wall time on the device the arrays live on, the median of ``repeats``
  runs taken round-robin over the prefixes (so a drift in the host's speed hits all of them
  alike). A difference of two medians can come out slightly negative for a tiny layer; it
  is clipped to 0, and :attr:`LayerProfile.spread_s` (half the interquartile range of each
  ``T_l``) says how far each figure can be trusted.

Communication time per layer is the network model of the bytes the layer's averaging sends
(:meth:`LayerProfile.comm_s`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxcomm._src._checks import check_int
from jaxcomm._src.audit import program_cost
from jaxcomm._src.compute import Roofline
from jaxcomm._src.localsgd import (
    Layers,
    _join_layers,
    _layer_trees,
    layer_comm_s,
    layer_names,
    layer_wires,
)
from jaxcomm._src.network import Network

__all__ = ["LayerProfile", "profile_layers"]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Per-layer compute of one training iteration (layers 0-based from the input).

    Attributes:
      names: the layers' names (top-level parameter keys), input to output.
      forward_s: seconds of one iteration's forward pass (loss included).
      backward_s: ``[L]`` seconds of each layer's backward.
      param_bytes: ``[L]`` bytes of each layer's parameters.
      method: ``"roofline:<device>"`` or ``"measured"``.
      prefix_s: ``[L + 1]`` the prefix times ``T_0 .. T_L`` (``T_0``: the full forward and
        backward; ``T_L``: the forward alone).
      spread_s: ``[L + 1]`` uncertainty of each prefix time ``T_0 .. T_L`` (half the
        interquartile range of the timings; zeros for a roofline).
      params: the parameters' shapes (``jax.ShapeDtypeStruct``), to cost their averaging.
    """

    names: tuple[str, ...]
    forward_s: float
    backward_s: tuple[float, ...]
    param_bytes: tuple[int, ...]
    method: str
    prefix_s: tuple[float, ...]
    spread_s: tuple[float, ...]
    params: Any = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def num_layers(self) -> int:
        """Number of layers ``L``."""
        return len(self.backward_s)

    def comm_s(self, network: Network, n: int, *, reduce: str = "ring") -> list[float]:
        """``[L]`` modelled seconds of averaging each layer over ``n`` workers on
        ``network``: the ``rounds * alpha + path_bytes * beta`` of the all-reduce that
        :func:`jaxcomm.partial_local_sgd` runs for it."""
        return layer_comm_s(layer_wires(self.params, list(self.names), n, reduce=reduce), network)


def _prefix(loss_fn: Callable, names: list[str], start: int) -> Callable:
    """``P_start``: loss and the gradient w.r.t. the layers ``start ..`` (loss alone when
    ``start == L``)."""
    if start == len(names):
        return lambda params, batch: loss_fn(params, batch)

    def run(params, batch):
        trees = _layer_trees(params, names)
        fixed = trees[:start]

        def loss(trained):  # loss_fn sees the parameters' own structure (an nnx.State, ...)
            return loss_fn(_join_layers(fixed + trained, names, params), batch)

        return jax.value_and_grad(loss)(trees[start:])

    return run


def profile_layers(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    layers: Layers,
    *,
    roofline: Roofline | None = None,
    repeats: int = 20,
) -> LayerProfile:
    """Per-layer backward time and forward time of ``loss_fn(params, batch)`` (a scalar).

    Args:
      loss_fn: the scalar loss, e.g. ``lambda p, b: task.loss(p, b)[0]``.
      params: one worker's parameters (a mapping of layers); arrays, or
        ``jax.ShapeDtypeStruct`` with a ``roofline``.
      batch: one worker's batch (arrays, or shapes with a ``roofline``).
      layers: the layer names, input to output (see :mod:`jaxcomm.localsgd`).
      roofline: cost the compiled prefixes on this device (see the module docstring); None
        measures wall time on the arrays' device.
      repeats: timed runs of each prefix when measuring (after one warm-up run).

    Returns:
      A :class:`LayerProfile`.
    """
    names = layer_names(params, layers)
    if names is None:
        raise ValueError("profile_layers needs the layers (names of the top-level keys)")
    repeats = check_int("repeats", repeats, lo=1)
    programs = [
        jax.jit(_prefix(loss_fn, names, start)).lower(params, batch).compile()
        for start in range(len(names) + 1)
    ]
    if roofline is not None:
        costs = [program_cost(p) for p in programs]
        uncounted = sorted({c for cost in costs for c in cost.uncounted})
        if uncounted:
            warnings.warn(
                f"profile_layers: custom calls without a flop count ({', '.join(uncounted[:5])})"
                ": their flops are missing from the layer times",
                UserWarning,
                stacklevel=2,
            )
        prefix = [float(np.max(roofline.seconds(c.per_device()))) for c in costs]
        spread = [0.0] * len(prefix)
        method = f"roofline:{roofline.device.name}"
    else:
        samples: list[list[float]] = [[] for _ in programs]
        for p in programs:
            jax.block_until_ready(p(params, batch))
        for _ in range(repeats):
            for i, p in enumerate(programs):
                t0 = time.perf_counter()
                jax.block_until_ready(p(params, batch))
                samples[i].append(time.perf_counter() - t0)
        prefix = [float(np.median(s)) for s in samples]
        spread = [float(np.subtract(*np.percentile(s, [75, 25])) / 2) for s in samples]
        method = "measured"
    backward = [max(prefix[i] - prefix[i + 1], 0.0) for i in range(len(names))]
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    nbytes = [
        sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes[k]))
        for k in names
    ]
    return LayerProfile(
        names=tuple(names),
        forward_s=prefix[-1],
        backward_s=tuple(backward),
        param_bytes=tuple(nbytes),
        method=method,
        prefix_s=tuple(prefix),
        spread_s=tuple(spread),
        params=shapes,
    )
