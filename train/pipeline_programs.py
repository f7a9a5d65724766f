"""The pipeline's programs: the GPipe step over every device, the validation loss, and the
programs of the parameter groups one stage owns: the embedding (stage 0) and the head (the
last stage).

Their parameters keep a slot on every stage (``[D, S, ...]``), but their optimizer state
and their update live on the owner stage's devices only: a ``data``-axis sub-mesh whose
arrays are views of the owner stage's shards (the same device buffers, nothing copied).
Checkpoints save that state over the whole mesh (zeros off the owner stage), so every
process writes its part of global arrays.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

from .distributed import to_host
from .pipeline import gpt_pipeline_loss
from .programs import AXIS, all_finite, structs

if TYPE_CHECKING:
    from .pipeline_layout import Pipeline

__all__ = [
    "OwnedGroups",
    "build_step",
    "build_eval",
    "squeeze_cell",
    "expand_cell",
    "STAGE",
    "OWNED",
]

STAGE = "stage"
OWNED = ("embed", "head")  # parameters used by one stage only: stage 0 and the last


def squeeze_cell(tree: Any) -> Any:
    """One device's ``[1, 1, ...]`` block of ``[D, S, ...]`` leaves as ``[...]``."""
    return jax.tree_util.tree_map(lambda a: a[0, 0], tree)


def expand_cell(tree: Any) -> Any:
    """``[...]`` leaves as one device's ``[1, 1, ...]`` block."""
    return jax.tree_util.tree_map(lambda a: a[None, None], tree)


def _is_keyed(node: Any) -> bool:
    return hasattr(node, "_replace") and getattr(node, "key", None) is not None


def _salted(state: Any, salt: Any) -> Any:
    """``state`` with the PRNG key of every keyed aggregator state folded with ``salt``, so
    that parameter groups and stages (each its own data-parallel group) draw independent
    rounding noise from one seed."""

    def fix(node):
        if not _is_keyed(node):
            return node
        key = jax.random.fold_in(jax.random.wrap_key_data(node.key), salt)
        return node._replace(key=jax.random.key_data(key))

    return jax.tree_util.tree_map(fix, state, is_leaf=_is_keyed)


class OwnedGroups:
    """Views, updates and saved form of pipeline layout ``p``'s one-stage groups."""

    names = OWNED

    def __init__(self, p: Pipeline):
        self.p = p
        self.sub_mesh = {
            name: jax.sharding.Mesh(
                p.mesh.devices[:, self.owner(name)], (AXIS,), p.mesh.axis_types[:1]
            )
            for name in self.names
        }

    def owner(self, name: str) -> int:
        """The stage that uses parameter group ``name`` (``embed``: 0, ``head``: the last)."""
        return 0 if name == "embed" else self.p.stages - 1

    def view(self, tree: Any, name: str) -> Any:
        """``[D, S, ...]`` arrays as ``[D, 1, ...]`` arrays on ``name``'s owner sub-mesh,
        made of the owner stage's shards (the same device buffers, nothing copied)."""
        devices = list(self.p.mesh.devices[:, self.owner(name)])
        sharding = NamedSharding(self.sub_mesh[name], P(AXIS))
        if self.p.abstract:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(
                    (a.shape[0], 1, *a.shape[2:]), a.dtype, sharding=sharding
                ),
                tree,
            )

        def one(a):
            shards = {sh.device: sh.data for sh in a.addressable_shards}
            return jax.make_array_from_single_device_arrays(
                (a.shape[0], 1, *a.shape[2:]),
                sharding,
                [shards[d] for d in devices if d in shards],
                dtype=a.dtype,
            )

        return jax.tree_util.tree_map(one, tree)

    def merged(self, full: Any, owned: Any) -> Any:
        """``full`` (``[D, S, ...]``) with its owner-stage shards replaced by ``owned``'s."""

        def one(a, b):
            new = {sh.device: sh.data for sh in b.addressable_shards}
            arrays = [new.get(sh.device, sh.data) for sh in a.addressable_shards]
            return jax.make_array_from_single_device_arrays(
                a.shape, a.sharding, arrays, dtype=a.dtype
            )

        return jax.tree_util.tree_map(one, full, owned)

    def place(self, log: Any, name: str) -> Any:
        """A ``[D, 1, ...]`` log of ``name``'s sub-mesh as a ``[D, S, ...]`` host log."""
        s = self.owner(name)

        def one(a):
            a = to_host(a)
            out = np.zeros((a.shape[0], self.p.stages, *a.shape[2:]), a.dtype)
            out[:, s] = a[:, 0]
            return out

        return jax.tree_util.tree_map(one, log)

    def spread(self, tree: Any, name: str) -> Any:
        """``[D, 1, ...]`` arrays of ``name``'s sub-mesh as ``[D, S, ...]`` arrays of the
        whole mesh: the owner stage's shards as they are, zeros on the other stages."""
        p, owner = self.p, self.owner(name)
        if p.abstract:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(
                    (a.shape[0], p.stages, *a.shape[2:]), a.dtype, sharding=p.sharded
                ),
                tree,
            )

        def one(a):
            held = {sh.device: sh.data for sh in a.addressable_shards}
            parts = []
            for d, st in p.local_cells:
                dev = p.mesh.devices[d, st]
                if st == owner:
                    parts.append(held[dev])
                else:
                    parts.append(jax.device_put(np.zeros((1, 1, *a.shape[2:]), a.dtype), dev))
            shape = (a.shape[0], p.stages, *a.shape[2:])
            return jax.make_array_from_single_device_arrays(shape, p.sharded, parts, dtype=a.dtype)

        return jax.tree_util.tree_map(one, tree)

    def init_state(self, stacked: Any, group_tx: dict[str, Any]) -> dict[str, Any]:
        """Every group's optimizer state: the blocks' on the whole mesh, the owned groups'
        on their sub-meshes, each group's (and stage's) random keys salted apart."""
        p = self.p

        def init(mesh, spec, tree, salt, tx):
            f = jax.shard_map(
                lambda q: expand_cell(_salted(tx.init(squeeze_cell(q)), salt())),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
                check_vma=False,
            )
            if p.abstract:
                return structs(jax.eval_shape(jax.jit(f), tree), NamedSharding(mesh, spec))
            return jax.jit(f)(tree)

        s = p.stages
        stage = lambda: jax.lax.axis_index(STAGE)  # noqa: E731
        spec = P(AXIS, STAGE)
        opt_state = {"blocks": init(p.mesh, spec, stacked["blocks"], stage, group_tx["blocks"])}
        for i, name in enumerate(self.names):
            view = self.view(stacked[name], name)
            opt_state[name] = init(
                self.sub_mesh[name], P(AXIS), view, lambda i=i: s + i, group_tx[name]
            )
        return opt_state

    def build_step(self, tx: optax.GradientTransformation, name: str) -> Any:
        """Average and apply ``name``'s gradients over ``data`` on its owner stage's devices:
        ``(params, opt_state, grads) -> (params, opt_state, finite)``, ``[D, 1, ...]``."""

        def per_device(params, opt_state, grads):
            q, s, g = squeeze_cell(params), squeeze_cell(opt_state), squeeze_cell(grads)
            updates, s = tx.update(g, s, q)
            q = optax.apply_updates(q, updates)
            ok = all_finite(q).astype(jnp.int32)
            return expand_cell(q), expand_cell(s), expand_cell(ok)

        step = jax.shard_map(
            per_device,
            mesh=self.sub_mesh[name],
            in_specs=(P(AXIS), P(AXIS), P(AXIS)),
            out_specs=(P(AXIS), P(AXIS), P(AXIS)),
            check_vma=False,
        )
        return jax.jit(step)


def build_step(p: Pipeline, tx: optax.GradientTransformation) -> dict[bool, Any]:
    """Pipeline layout ``p``'s jitted step per boundary mode, running ``tx`` on the
    blocks' gradients: ``seen=False`` (some sample of the step is on
    its first visit: AQ-SGD sends float32) and ``seen=True`` (deltas)."""
    loss_fn = gpt_pipeline_loss(p.gpt_cfg, boundary=p.boundary)

    def per_device(blocks, owned, opt_state, batch, bstate, key, seen):
        p = {"blocks": squeeze_cell(blocks), **squeeze_cell(owned)}
        s, b, st = squeeze_cell(opt_state), squeeze_cell(batch), squeeze_cell(bstate)
        k = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
        # jax.value_and_grad, and the gradient memory's new rows with bw_memory.
        grad_fn = jaxcomm.pipeline.gpipe_value_and_grad(loss_fn)
        (loss, (st, log)), grads = grad_fn(p, b, st, k, seen)
        # Only the blocks are averaged and updated here; the embedding's and head's
        # gradients go to the programs of their own stages (see the module docstring).
        updates, new_s = tx.update(grads["blocks"], s, p["blocks"])
        new_blocks = optax.apply_updates(p["blocks"], updates)
        ok = all_finite((loss, grads, new_blocks)).astype(jnp.int32)
        # The loss (the same on every stage of a replica) and the finite flag of each
        # device go to the host, which averages them: no collective in the step for them.
        metrics, finite = {"loss": expand_cell(loss)}, expand_cell(ok)
        owned_grads = {name: grads[name] for name in OWNED}
        return (
            expand_cell(new_blocks),
            expand_cell(new_s),
            expand_cell(owned_grads),
            metrics,
            finite,
        ) + (
            expand_cell(st),
            expand_cell(log),
        )

    def build(seen: bool) -> Any:
        sharded = P(AXIS, STAGE)
        step = jax.shard_map(
            functools.partial(per_device, seen=seen),
            mesh=p.mesh,
            in_specs=(sharded, sharded, sharded, P(AXIS), sharded, P()),
            out_specs=(sharded,) * 7,
            check_vma=False,
        )
        return jax.jit(step, donate_argnums=(0, 2))

    modes = (False, True) if p.boundary.uses_buffer else (False,)
    return {seen: build(seen) for seen in modes}


def build_eval(p: Pipeline) -> Any:
    """The pipeline's validation loss (FP32 boundaries, no buffer), averaged over ``data``."""
    loss_fn = gpt_pipeline_loss(p.gpt_cfg)

    def per_device(params, batch, bstate):
        loss, _ = loss_fn(
            squeeze_cell(params),
            squeeze_cell(batch),
            squeeze_cell(bstate),
            jax.random.key(0),
            backward=False,
        )
        return {"loss": jax.lax.pmean(loss, AXIS)}

    f = jax.shard_map(
        per_device,
        mesh=p.mesh,
        in_specs=(P(AXIS, STAGE), P(AXIS), P(AXIS, STAGE)),
        out_specs=P(),
        check_vma=False,
    )
    return jax.jit(f)
