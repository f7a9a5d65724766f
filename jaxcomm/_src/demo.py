"""DeMo: decoupled momentum, its fast components sent as top-k DCT coefficients.

From "DeMo: Decoupled Momentum Optimization" (Peng et al., arXiv
2411.19870, ICLR 2026), Algorithm 1 with the sign step the paper trains with, as the
authors' code (``bloc97/DeMo``, ``demo.py``) runs it. Every worker keeps its own momentum
``m`` (it is never averaged) and, with its gradient ``g``::

    m <- beta m + g
    q <- ExtractFastComponents(m)     # the k largest DCT coefficients of every block
    m <- m - IDCT(q)                  # what is sent leaves the momentum (error feedback)
    Q <- IDCT(mean of every worker's q, coefficient by coefficient)
    x <- x (1 - lr wd) - lr sign(Q)   # or - lr Q with sign=False

Blocks: a tensor of two or more axes is the matrix ``[prod(shape[:-1]), shape[-1]]``, one
of fewer axes a single row; each of the matrix's two dimensions ``n`` is cut into blocks of
``b`` = the largest divisor of ``n`` not above ``chunk`` (``n`` itself when ``n <= chunk``:
the authors' rule, so no padding, and a prime ``n > chunk`` gives blocks of 1), and each
``b1 x b2`` block is transformed by the 2-D orthonormal DCT-II (a 1-D DCT for a row). Its
``C = b1 b2`` coefficients are numbered row-major, and the ``min(k, C)`` of largest
magnitude are kept (ties to the lower number). Every worker all-gathers every payload;
each coefficient is averaged over the workers that sent it (the authors' ``scatter_reduce``
mean, ``average="senders"``) or over all ``N`` (``average="workers"``), summed in worker
order so that every worker computes the same ``Q`` bit for bit.

On the wire, per worker and step, one all-gather of one payload: the kept values as
``float32`` and their in-block numbers in the narrowest unsigned type that holds ``C - 1``
(``uint8`` for ``C <= 256``, ``uint16`` up to 65,536, else ``uint32``), nothing else. A
block of ``C`` coefficients costs ``min(k, C) (4 + w)`` bytes (``w`` the index bytes)
against ``4 C`` in float32: at the paper's ``chunk=64, k=32`` a 64 x 64 block of a matrix
is 192 bytes against 16,384 (85.3x fewer), a 64-entry block of a vector 160 against 256.

Where this differs from the paper's text or the authors' code:

* the momentum accumulates the gradient itself (Algorithm 1); the authors' code adds
  ``lr * g``. With a constant ``lr`` (the only kind here) and ``sign=True`` the steps are
  the same: every stage is linear in ``m`` or indifferent to its scale (top-k by
  magnitude, the mean, the sign). A schedule chained after it (``optax.scale_by_schedule``,
  as the trainer's ``optimizer.schedule`` does) scales the step and the decay and leaves
  the momentum unweighted, where the authors' code weights each gradient by its rate;
* tensors of more than two axes are blocked as the matrix above (the authors' code handles
  one and two axes only); kept values travel as float32 whatever the parameter dtype (the
  authors' code sends the parameter dtype) and indices in the narrowest unsigned type (it
  sends int64);
* a block whose coefficients hold a NaN or Inf sends NaN values, so the non-finite gradient
  reaches that block of every worker's update (the sign of an infinite coefficient would
  otherwise be finite).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._src._checks import axis_size, check_choice, check_float, check_int
from jaxcomm._src.aggregate import WholeOptimizer, whole_optimizer, worker_state
from jaxcomm._src.collectives import all_gather, all_gather_wire, replicated
from jaxcomm._src.network import CommLog, empty_log, log_wire
from jaxcomm._src.worker import (
    TreeLayout,
    check_layout,
    flatten_grads,
    init_layout,
    layout_of,
)

__all__ = ["AVERAGES", "DeMoState", "block_size", "dct_matrix", "demo"]

#: How the gathered coefficients are averaged: over the workers that sent each one (the
#: authors' code), or over all workers.
AVERAGES = ("senders", "workers")

_HIGHEST = lax.Precision.HIGHEST  # no reduced-precision matmul in the transform


class DeMoState(NamedTuple):
    """State of :func:`demo`, per worker.

    Attributes:
      momentum: ``f32[d]`` this worker's momentum of the flattened parameters, less what it
        has sent (DeMo's error feedback); never averaged.
      log: what the last step sent (one all-gather of the packed payload).
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    momentum: jax.Array
    log: CommLog
    layout: TreeLayout


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``f64[n, n]``: ``coefficients = D @ x`` for ``x: [n]``,
    ``D[a, h] = s_a cos(pi (2 h + 1) a / (2 n))`` with ``s_0 = sqrt(1 / n)`` and
    ``s_a = sqrt(2 / n)`` otherwise, so ``D @ D.T = I`` and ``D.T`` is the inverse."""
    n = check_int("n", n, lo=1)
    a = np.arange(n, dtype=np.float64)[:, None]
    h = np.arange(n, dtype=np.float64)[None, :]
    d = np.sqrt(2.0 / n) * np.cos(np.pi * (2.0 * h + 1.0) * a / (2.0 * n))
    d[0] = np.sqrt(1.0 / n)
    return d


def block_size(n: int, chunk: int) -> int:
    """The block length of a dimension of ``n`` entries: the largest divisor of ``n`` that is
    at most ``chunk`` (``n`` when ``n <= chunk``; 1 for a prime ``n > chunk``)."""
    n = check_int("n", n, lo=1)
    chunk = check_int("chunk", chunk, lo=1)
    return next(b for b in range(min(n, chunk), 0, -1) if n % b == 0)


def _warn_small_blocks(shapes: tuple[tuple[int, ...], ...], chunk: int) -> None:
    """Warn where a dimension longer than ``chunk`` is cut into blocks shorter than
    ``chunk / 2`` (a prime length: blocks of 1): the authors' rule, kept, but such a tensor
    compresses little or not at all (blocks of 1 send 5 bytes an entry against float32's 4)."""
    for shape in shapes:
        size = math.prod(shape)
        dims = (size // shape[-1], shape[-1]) if len(shape) >= 2 else (size,)
        for n in dims:
            b = block_size(n, chunk) if n > 0 else n
            if n > chunk and 2 * b < chunk:
                warnings.warn(
                    f"demo: chunk={chunk} cuts a dimension of {n} (a tensor of shape {shape}) "
                    f"into blocks of {b}, the largest divisor of {n} that is at most {chunk}: "
                    f"that tensor is compressed little or not at all; a chunk of at least {n}, "
                    f"or near a divisor of {n}, blocks it better",
                    stacklevel=4,
                )
                break


def _index_dtype(coefficients: int) -> Any:
    """The narrowest unsigned type holding in-block numbers ``0 .. coefficients - 1``."""
    for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
        if coefficients <= np.iinfo(dtype).max + 1:
            return dtype
    raise ValueError(f"a block of {coefficients} coefficients is past uint32 indices")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """Where one parameter tensor sits and how it is blocked (all static)."""

    offset: int  # first entry in the fused vector
    rows: int  # R: the matrix is [R, S]
    cols: int  # S
    b1: int  # block rows
    b2: int  # block columns
    k: int  # coefficients kept per block, min(k, b1 b2)
    at: int  # first kept value in the payload's values
    group: int  # which index array (0: uint8, 1: uint16, 2: uint32)
    index_at: int  # first index in that array

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def blocks(self) -> int:
        return (self.rows // self.b1) * (self.cols // self.b2)

    @property
    def coefficients(self) -> int:
        return self.b1 * self.b2


_GROUPS = (jnp.uint8, jnp.uint16, jnp.uint32)


def _plan(shapes: tuple[tuple[int, ...], ...], chunk: int, k: int) -> tuple[_Leaf, ...]:
    """Every tensor's blocks and its place in the fused vector and in the payload."""
    out, offset, at, index_at = [], 0, 0, [0, 0, 0]
    for shape in shapes:
        size = math.prod(shape)
        if size == 0:  # a zero-size leaf: nothing to send
            continue
        rows, cols = (size // shape[-1], shape[-1]) if len(shape) >= 2 else (1, size)
        b1, b2 = block_size(rows, chunk), block_size(cols, chunk)
        kept = min(k, b1 * b2)
        group = _GROUPS.index(_index_dtype(b1 * b2))
        leaf = _Leaf(offset, rows, cols, b1, b2, kept, at, group, index_at[group])
        out.append(leaf)
        offset += size
        at += leaf.blocks * kept
        index_at[group] += leaf.blocks * kept
    return tuple(out)


def _to_blocks(x: jax.Array, leaf: _Leaf) -> jax.Array:
    """``f32[R S]`` -> ``f32[blocks, C]`` DCT coefficients, blocks row-major over the matrix."""
    d1 = jnp.asarray(dct_matrix(leaf.b1), jnp.float32)
    d2 = jnp.asarray(dct_matrix(leaf.b2), jnp.float32)
    x = x.reshape(leaf.rows // leaf.b1, leaf.b1, leaf.cols // leaf.b2, leaf.b2)
    coef = jnp.einsum("ihjw,ah,bw->ijab", x, d1, d2, precision=_HIGHEST)
    return coef.reshape(leaf.blocks, leaf.coefficients)


def _from_blocks(coef: jax.Array, leaf: _Leaf) -> jax.Array:
    """Inverse of :func:`_to_blocks`: ``f32[blocks, C]`` -> ``f32[R S]``."""
    d1 = jnp.asarray(dct_matrix(leaf.b1), jnp.float32)
    d2 = jnp.asarray(dct_matrix(leaf.b2), jnp.float32)
    rb, cb = leaf.rows // leaf.b1, leaf.cols // leaf.b2
    coef = coef.reshape(rb, cb, leaf.b1, leaf.b2)
    x = jnp.einsum("ijab,ah,bw->ihjw", coef, d1, d2, precision=_HIGHEST)
    return x.reshape(leaf.size)


def _scatter(coef_shape: tuple[int, int], idx: jax.Array, vals: jax.Array) -> jax.Array:
    """``f32[blocks, C]`` zeros holding ``vals[i, j]`` at ``[i, idx[i, j]]``."""
    rows = jnp.arange(coef_shape[0])[:, None]
    return jnp.zeros(coef_shape, jnp.float32).at[rows, idx].set(vals, unique_indices=True)


def demo(
    axis_name: Any,
    *,
    lr: float,
    beta: float = 0.999,
    chunk: int = 64,
    k: int = 32,
    sign: bool = True,
    weight_decay: float = 0.0,
    average: str = "senders",
) -> WholeOptimizer:
    """DeMo (Decoupled Momentum Optimization) as a whole optimizer (see the module docstring).

    Args:
      axis_name: data-parallel mesh axis, bound by the enclosing ``shard_map``.
      lr: step size ``> 0`` (the paper's language models: 4e-4 with ``sign=True``).
      beta: momentum decay in ``[0, 1)`` (the paper's 0.999).
      chunk: the longest block side, ``>= 2`` (the paper's 64): each dimension is cut into
        blocks of its largest divisor ``<= chunk``.
      k: coefficients kept per block, ``1 <= k <= chunk`` (the paper's 32; a block of fewer
        than ``k`` coefficients is sent whole).
      sign: step by ``lr sign(Q)`` (the paper's choice) or, False, by ``lr Q``.
      weight_decay: decoupled weight decay ``wd >= 0``: ``x <- x (1 - lr wd)`` each step.
      average: ``"senders"`` (each coefficient divided by the workers that sent it, as the
        authors' code) or ``"workers"`` (divided by ``N``).

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` with :class:`DeMoState`: its updates are the step
      to add to the parameters, ``-lr (sign(Q) + wd x)``, identical on every worker; use it
      alone (or before ``optax.identity()``). ``update`` needs ``params`` when
      ``weight_decay > 0``. Logged as one ``allgather`` of the payload (module docstring):
      each worker sends ``N - 1`` times it.
    """
    lr = check_float("lr", lr, lo=0.0, lo_open=True)
    beta = check_float("beta", beta, lo=0.0, hi=1.0, hi_open=True)
    chunk = check_int("chunk", chunk, lo=2)
    k = check_int("k", k, lo=1, hi=chunk)
    if not isinstance(sign, bool):
        raise TypeError(f"sign must be True or False, got {sign!r}")
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    check_choice("average", average, AVERAGES)

    def init_fn(params):
        layout, d = init_layout("demo", params)
        if d == 0:
            raise ValueError("demo: the parameters have no entries (d = 0): nothing to train")
        if d >= 2**31:
            raise ValueError(f"demo: {d} parameter entries; at most 2**31 - 1 (int32 places)")
        _warn_small_blocks(layout.shapes, chunk)
        state = DeMoState(jnp.zeros((d,), jnp.float32), empty_log(), layout)
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        if weight_decay > 0.0 and params is None:
            raise ValueError("demo: weight_decay > 0 needs update(grads, state, params)")
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("demo", updates, axis_name, state.layout)
        plan = _plan(state.layout.shapes, chunk, k)
        m = beta * state.momentum + flat  # f32[d]

        # ExtractFastComponents: per block, the k coefficients of largest magnitude.
        values, indices, sent = [], ([], [], []), []
        for leaf in plan:
            coef = _to_blocks(m[leaf.offset : leaf.offset + leaf.size], leaf)  # f32[B, C]
            _, idx = lax.top_k(jnp.abs(coef), leaf.k)  # int32[B, k]; ties: the lower number
            vals = jnp.take_along_axis(coef, idx, axis=1)  # f32[B, k]
            finite = jnp.all(jnp.isfinite(coef), axis=1, keepdims=True)
            vals = jnp.where(finite, vals, jnp.nan)  # a non-finite block sends NaN
            sent.append(_from_blocks(_scatter(coef.shape, idx, vals), leaf))  # IDCT(q)
            values.append(vals.reshape(-1))
            indices[leaf.group].append(idx.reshape(-1).astype(_GROUPS[leaf.group]))
        present = [g for g in range(len(_GROUPS)) if indices[g]]
        # float32[K] values, then uint8[K_8], uint16[K_16], uint32[K_32] (those present)
        payload = (jnp.concatenate(values), tuple(jnp.concatenate(indices[g]) for g in present))
        momentum = m - jnp.concatenate(sent)  # m <- m - IDCT(q): leaves in order, f32[d]

        # Synchronize: every worker's payload, averaged coefficient by coefficient.
        got_values, got_indices = all_gather(payload, axis_name)  # [N, K], ([N, K_w], ...)
        positions = []  # int32[N, K]: each kept value's place in the fused coefficients
        for leaf in plan:
            idx = got_indices[present.index(leaf.group)]
            idx = idx[:, leaf.index_at : leaf.index_at + leaf.blocks * leaf.k]
            base = leaf.offset + leaf.coefficients * jnp.arange(leaf.blocks, dtype=jnp.int32)
            pos = base[None, :, None] + idx.astype(jnp.int32).reshape(n, leaf.blocks, leaf.k)
            positions.append(pos.reshape(n, -1))
        positions = jnp.concatenate(positions, axis=1)

        def add(w, carry):  # one worker's values at a time: distinct places within each
            total, count = carry
            total = total.at[positions[w]].add(got_values[w], unique_indices=True)
            if count is not None:
                count = count.at[positions[w]].add(1, unique_indices=True)
            return total, count

        senders = jnp.zeros(m.shape, jnp.int32) if average == "senders" else None
        total, count = lax.fori_loop(0, n, add, (jnp.zeros_like(m), senders))  # rank order
        # The same gathered payloads added in the same order: identical on every worker
        # (the loop types its carry as varying).
        total, count = replicated((total, count), axis_name)
        if count is not None:  # over the workers that sent each coefficient
            mean = jnp.where(count > 0, total / jnp.maximum(count, 1).astype(jnp.float32), 0.0)
        else:  # over all workers
            mean = total / n
        blocks = [mean[lf.offset : lf.offset + lf.size].reshape(lf.blocks, -1) for lf in plan]
        q = jnp.concatenate([_from_blocks(b, lf) for b, lf in zip(blocks, plan, strict=True)])

        direction = jnp.sign(q) if sign else q  # f32[d]
        if weight_decay > 0.0:
            check_layout("demo", state.layout, layout_of(params))
            p = [jnp.ravel(a).astype(jnp.float32) for a in jax.tree_util.tree_leaves(params)]
            direction = direction + weight_decay * jnp.concatenate(p)
        log = log_wire(empty_log(), all_gather_wire(payload, n))
        new_state = worker_state(DeMoState(momentum, log, state.layout), axis_name)
        return unflatten(-lr * direction), new_state

    return whole_optimizer("jaxcomm.demo", "lr", init_fn, update_fn)
