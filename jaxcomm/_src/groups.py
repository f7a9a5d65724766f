"""DiLoCo's outer step between replica groups that are separate programs: :class:`GroupOuter`.

Inside one program, :func:`jaxcomm.diloco` forms the pseudo-gradient, averages it with a
collective over a mesh axis and steps ``theta_sync``. Replica groups (separate processes
with separate JAX runtimes, joined by a fault-tolerant transport such as torchft's) cannot
share a mesh axis: each group encodes its pseudo-gradient on the host, the transport
all-gathers the packed bytes, and every group decodes the same bytes in the same member
order and takes the same outer step, so ``theta_sync`` stays bit-identical across groups.

Per fragment (a flat ``f32[d]`` of the fragment's parameters, leaves one after another):

* ``delta = theta_sync - theta_local`` (DiLoCo's pseudo-gradient, float32);
* with a codec, error feedback as :func:`jaxcomm.error_fed`: ``e <- decay * e + delta``,
  the payload ``C(e)``, ``e <- e - decode(C(e))``; without one the payload is ``delta``'s
  float32 bytes;
* the mean of the members' decoded payloads, weighted by the tokens each group processed
  since the fragment's last exchange (Decoupled DiLoCo's weighting; equal weights give
  DiLoCo's plain mean), summed in member order;
* the outer optimizer (default Nesterov SGD, lr 0.7, momentum 0.9, the DiLoCo paper's) on
  ``theta_sync``;
* Streaming DiLoCo's merge ``alpha * theta_local + (1 - alpha) * theta_sync``.

Deviation: inside one program ``int8``/``int4`` travel by a two-phase compressed
all-reduce (:func:`jaxcomm.ec_quantized_all_reduce`); between groups every codec's payload
is all-gathered (a TCP transport has no compressed reduce-scatter), so each group decodes
every member's codes with its own error feedback only (no second rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm._src._checks import check_float, check_int
from jaxcomm._src.codec import Codec, decode

__all__ = ["GroupOuter", "GroupState"]


class GroupState(NamedTuple):
    """One fragment's outer state in one group (host or device arrays).

    Attributes:
      anchor: ``f32[d]`` ``theta_sync`` of the fragment, identical in every group.
      outer: the outer optimizer's state over ``f32[d]``, identical in every group.
      residual: ``f32[d]`` this group's error feedback (zeros without a codec).
      key: ``uint32[2]`` raw key of a codec that draws from its key, else ``None``.
    """

    anchor: Any
    outer: Any
    residual: Any
    key: Any


def _on(device: Any, fn: Any) -> Any:
    """``fn`` run with ``device`` as JAX's default device."""

    def run(*args: Any) -> Any:
        with jax.default_device(device):
            return fn(*args)

    return run


class GroupOuter:
    """The outer step of DiLoCo across replica groups (see the module docstring).

    Args:
      outer: the outer optimizer (any ``optax`` transform of ``f32[d]``); default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      codec: a :class:`jaxcomm.codecs.Codec` of flat vectors for the pseudo-gradient, with
        error feedback; ``None`` sends float32.
      decay: the error buffer's decay in ``[0, 1]`` (codec only).
      sizes: the fragment's tensor sizes, for a codec with per-tensor statistics
        (:meth:`jaxcomm.codecs.Codec.bind`); default one tensor.
      seed: seed of a keyed codec; each group draws from ``fold_in(seed, slot)``.
    """

    def __init__(
        self,
        outer: optax.GradientTransformation | None = None,
        *,
        codec: Codec | None = None,
        decay: float = 1.0,
        sizes: Sequence[int] | None = None,
        seed: int = 0,
    ):
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(f"codec must be a jaxcomm.codecs.Codec or None, got {codec!r}")
        if codec is not None and codec.needs_matrix:
            raise ValueError(f"codec {codec.label!r} factors a matrix; a fragment is one vector")
        self.outer = outer if outer is not None else optax.sgd(0.7, momentum=0.9, nesterov=True)
        self.decay = check_float("decay", decay, lo=0.0, hi=1.0)
        self.seed = check_int("seed", seed, lo=0, hi=2**32 - 1)
        self.sizes = None if sizes is None else tuple(check_int("sizes", s, lo=1) for s in sizes)
        self.codec = None
        if codec is not None:
            self.codec = codec.bind(self.sizes) if self.sizes is not None else codec
        # On the host's CPU whatever the default device: every group, on any accelerator,
        # then rounds the outer step alike (theta_sync must stay bit-identical).
        cpu = jax.local_devices(backend="cpu")[0]
        self._encode = _on(cpu, jax.jit(self._encode_impl))
        self._step = _on(cpu, jax.jit(self._step_impl))
        self._decode = _on(cpu, jax.jit(decode))

    # ------------------------------------------------------------------ state

    def init(self, anchor: Any, *, slot: int = 0) -> GroupState:
        """The state of a fragment whose ``theta_sync`` starts at ``anchor`` (``f32[d]``,
        the same in every group); ``slot`` makes a keyed codec's draws the group's own."""
        anchor = self._vector("anchor", anchor)
        if self.sizes is not None and sum(self.sizes) != anchor.size:
            raise ValueError(f"sizes sum to {sum(self.sizes)}, but anchor has {anchor.size}")
        key = None
        if self.codec is not None and self.codec.keyed:
            slot = check_int("slot", slot, lo=0)
            key = jax.random.key_data(jax.random.fold_in(jax.random.key(self.seed), slot))
            key = np.asarray(key)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            outer = jax.tree_util.tree_map(np.asarray, self.outer.init(jnp.asarray(anchor)))
        return GroupState(
            anchor=anchor,
            outer=outer,
            residual=np.zeros_like(anchor),
            key=key,
        )

    @staticmethod
    def _vector(name: str, x: Any) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 1 or x.dtype != np.float32:
            raise ValueError(f"{name} must be a flat float32 vector f32[d], got {x.dtype}{x.shape}")
        return x

    # ------------------------------------------------------------------ sending

    def _encode_impl(self, anchor, local, residual, key):
        delta = anchor - local
        e = self.decay * residual + delta
        if key is None:
            payload = self.codec.encode(e, None)
            next_key = None
        else:
            k, nxt = jax.random.split(jax.random.wrap_key_data(key))
            payload, next_key = self.codec.encode(e, k), jax.random.key_data(nxt)
        return payload, e - decode(payload), next_key

    def send(self, state: GroupState, local: Any) -> tuple[Any, GroupState, GroupState]:
        """This group's payload for its local fragment ``local`` (``f32[d]``): returns
        ``(payload, sent, unsent)``, the state once the payload is delivered and the state
        to keep if it never is. ``unsent`` keeps the error feedback as it was (the key
        moves on): for an exchange that is not delivered and moves neither ``theta_sync``
        nor the local fragment, the next pseudo-gradient still holds this one's drift, and
        keeping it in the error feedback as well would send it twice."""
        local = self._vector("local", local)
        if local.shape != np.shape(state.anchor):
            raise ValueError(f"local has {local.shape}, the fragment {np.shape(state.anchor)}")
        if self.codec is None:
            delta = np.asarray(state.anchor) - local
            return delta, state, state
        payload, residual, key = self._encode(state.anchor, local, state.residual, state.key)
        payload = jax.tree_util.tree_map(np.asarray, payload)
        key = None if key is None else np.asarray(key)
        sent = state._replace(residual=np.asarray(residual), key=key)
        return payload, sent, state._replace(key=key)

    def payload_shape(self, d: int) -> Any:
        """The abstract payload of a fragment of ``d`` entries (shapes and dtypes)."""
        d = check_int("d", d, lo=1)
        if self.codec is None:
            return jax.ShapeDtypeStruct((d,), jnp.float32)
        key = jax.random.key(0) if self.codec.keyed else None
        x = jax.ShapeDtypeStruct((d,), jnp.float32)
        return jax.eval_shape(lambda x: self.codec.encode(x, key), x)

    def nbytes(self, d: int) -> int:
        """Bytes of one payload of a fragment of ``d`` entries on the wire."""
        leaves = jax.tree_util.tree_leaves(self.payload_shape(d))
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)

    def to_wire(self, payload: Any) -> np.ndarray:
        """The payload's packed bytes (``uint8``, its leaves one after another)."""
        leaves = jax.tree_util.tree_leaves(payload)
        return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in leaves])

    def from_wire(self, data: np.ndarray, d: int) -> Any:
        """The payload of a fragment of ``d`` entries from its bytes (:meth:`to_wire`)."""
        like = self.payload_shape(d)
        leaves, tree = jax.tree_util.tree_flatten(like)
        data = np.asarray(data, np.uint8).reshape(-1)
        if data.size != self.nbytes(d):
            raise ValueError(f"a payload of d={d} is {self.nbytes(d)} bytes, got {data.size}")
        out, at = [], 0
        for a in leaves:
            size = math.prod(a.shape) * np.dtype(a.dtype).itemsize
            out.append(data[at : at + size].view(a.dtype).reshape(a.shape))
            at += size
        return jax.tree_util.tree_unflatten(tree, out)

    # ------------------------------------------------------------------ receiving

    def mean(
        self, payloads: Sequence[Any], tokens: Sequence[float], *, decoded: bool = False
    ) -> np.ndarray:
        """``sum_i tokens_i decode(payload_i) / sum_i tokens_i`` in member order (``f32[d]``);
        equal tokens give the plain mean ``sum_i decode(payload_i) / n``. ``decoded``: the
        payloads are :meth:`decode`'s vectors already."""
        if len(payloads) != len(tokens) or not payloads:
            raise ValueError(
                f"need one token count per payload and at least one, got {len(payloads)} "
                f"payloads and {len(tokens)} token counts"
            )
        w = np.asarray(tokens, np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"tokens must be positive and finite, got {list(tokens)}")
        equal = bool(np.all(w == w[0]))
        total = None
        for p, wi in zip(payloads, w, strict=True):
            x = np.asarray(p if decoded else self.decode(p), np.float32)
            x = x if equal else np.float32(wi / w.sum()) * x
            total = x.copy() if total is None else total + x
        return total / np.float32(len(w)) if equal else total

    def decode(self, payload: Any) -> np.ndarray:
        """A payload's pseudo-gradient (``f32[d]``; float32 payloads are their own)."""
        return np.asarray(payload if self.codec is None else self._decode(payload), np.float32)

    def _step_impl(self, anchor, outer, mean):
        updates, outer = self.outer.update(mean, outer, anchor)
        return optax.apply_updates(anchor, updates), outer

    def step(self, state: GroupState, mean: Any) -> GroupState:
        """The outer optimizer's step of ``theta_sync`` on the averaged pseudo-gradient."""
        anchor, outer = self._step(state.anchor, state.outer, self._vector("mean", mean))
        return state._replace(
            anchor=np.asarray(anchor), outer=jax.tree_util.tree_map(np.asarray, outer)
        )

    @staticmethod
    def merge(local: Any, anchor: Any, alpha: float) -> np.ndarray:
        """Streaming DiLoCo's merge ``alpha * local + (1 - alpha) * anchor`` (float32)."""
        alpha = check_float("alpha", alpha, lo=0.0, hi=1.0, hi_open=True)
        local = np.asarray(local, np.float32)
        if alpha == 0:
            return np.asarray(anchor, np.float32).copy()
        return np.float32(alpha) * local + np.float32(1 - alpha) * np.asarray(anchor, np.float32)
