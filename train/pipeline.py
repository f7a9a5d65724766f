"""Pipeline-parallel GPT: the model's layers split into stages for
:func:`jaxcomm.pipeline.gpipe`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.pipeline import Boundary, gpipe

from .models import Block, Embed, GPTConfig, Head

__all__ = ["stage_params", "unstage_params", "gpt_pipeline_loss"]


def stage_params(params: Any, cfg: GPTConfig, num_stages: int) -> dict[str, Any]:
    """Restack GPT params for ``num_stages`` stages: every leaf gets a leading stage axis.

    Stage ``s`` holds blocks ``s*k .. s*k+k-1`` (``k = num_layers / num_stages``) as
    ``blocks: [S, k, ...]``; ``embed`` and ``head`` are copied to every stage (only stage 0
    uses ``embed`` and only stage ``S - 1`` uses ``head``; the others get zero gradients).
    """
    if num_stages < 1 or cfg.num_layers % num_stages:
        raise ValueError(
            f"num_stages must divide num_layers={cfg.num_layers}, got num_stages={num_stages}"
        )
    k = cfg.num_layers // num_stages

    def stack(trees):
        return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)

    blocks = [stack([params[f"block_{s * k + j}"] for j in range(k)]) for s in range(num_stages)]
    return {
        "embed": stack([params["embed"]] * num_stages),
        "blocks": stack(blocks),
        "head": stack([params["head"]] * num_stages),
    }


def unstage_params(staged: Any, cfg: GPTConfig) -> dict[str, Any]:
    """Inverse of :func:`stage_params`: the GPT's own layout (``embed``, ``block_i``, ``head``).

    ``embed`` is taken from stage 0 and ``head`` from the last stage, the copies that are used.
    """
    blocks = staged["blocks"]
    num_stages = jax.tree_util.tree_leaves(blocks)[0].shape[0]
    k = cfg.num_layers // num_stages
    out: dict[str, Any] = {"embed": jax.tree_util.tree_map(lambda a: a[0], staged["embed"])}
    for i in range(cfg.num_layers):
        s, j = divmod(i, k)
        out[f"block_{i}"] = jax.tree_util.tree_map(lambda a, s=s, j=j: a[s, j], blocks)
    out["head"] = jax.tree_util.tree_map(lambda a: a[-1], staged["head"])
    return out


def gpt_pipeline_loss(cfg: GPTConfig, *, boundary: Boundary | None = None, axis_name="stage"):
    """The per-device pipelined next-token loss of a GPT (see :func:`jaxcomm.pipeline.gpipe`).

    Inputs are ``{"tokens": int32[M, mb, seq_len + 1]}``; the activation at every boundary
    is ``f32[mb, seq_len, width]``.
    """

    def first(p, micro):
        return Embed(cfg).apply({"params": p["embed"]}, micro["tokens"][:, :-1])

    def stage(p, h):
        def body(h, block_params):
            return Block(cfg).apply({"params": block_params}, h), None

        return jax.lax.scan(body, h, p["blocks"])[0]

    def last(p, h, micro):
        logits = Head(cfg).apply({"params": p["head"]}, h)
        labels = micro["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return gpipe(first, stage, last, axis_name=axis_name, boundary=boundary)
