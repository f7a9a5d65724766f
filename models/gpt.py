"""A small GPT-style decoder-only language model in ``flax.linen``.

``GPT`` is built from standalone stages (``Embed``, ``Block`` x L, ``Head``) so a pipeline can
apply ``params["embed"]``, ``params["block_i"]`` and ``params["head"]`` one stage at a time.
Everything is float32 and deterministic (no dropout).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .common import check_positive_int

_F32 = jnp.float32
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of ``GPT``.

    ``vocab_size`` tokens, context of ``seq_len`` positions, ``num_layers`` blocks of ``width``
    channels split into ``num_heads`` attention heads, MLP hidden size ``mlp_ratio * width``.
    """

    vocab_size: int = 256
    seq_len: int = 64
    num_layers: int = 4
    width: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_positive_int("GPTConfig", field.name, getattr(self, field.name))
        if self.width % self.num_heads:
            raise ValueError(
                f"GPTConfig.width must be divisible by num_heads={self.num_heads}, "
                f"got width={self.width}"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head, ``width // num_heads``."""
        return self.width // self.num_heads


def _dense(features: int, name: str, std: float = _INIT_STD) -> nn.Dense:
    return nn.Dense(
        features,
        dtype=_F32,
        param_dtype=_F32,
        kernel_init=nn.initializers.normal(std),
        bias_init=nn.initializers.zeros,
        name=name,
    )


def _layer_norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=1e-5, dtype=_F32, param_dtype=_F32, name=name)


def _residual_std(cfg: GPTConfig) -> float:
    return _INIT_STD / math.sqrt(2 * cfg.num_layers)


class Embed(nn.Module):
    """Token embedding plus learned positional embedding: int32[B, T] -> f32[B, T, width].

    ``T`` may be at most ``cfg.seq_len``; positions ``0..T-1`` are used.
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"Embed expects int tokens of shape [B, T], got shape {tokens.shape}")
        length = tokens.shape[1]
        if length > cfg.seq_len:
            raise ValueError(
                f"sequence length {length} exceeds GPTConfig.seq_len={cfg.seq_len}; "
                f"allowed: 1..{cfg.seq_len}"
            )
        tok = nn.Embed(
            cfg.vocab_size,
            cfg.width,
            dtype=_F32,
            param_dtype=_F32,
            embedding_init=nn.initializers.normal(_INIT_STD),
            name="tok",
        )(tokens.astype(jnp.int32))
        pos = self.param("pos", nn.initializers.normal(_INIT_STD), (cfg.seq_len, cfg.width), _F32)
        return tok + pos[None, :length]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: f32[B, T, W] -> f32[B, T, W].

    Position ``t`` attends only to positions ``<= t``.
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        batch, length, _ = x.shape
        qkv = _dense(3 * cfg.width, "qkv")(x)
        qkv = qkv.reshape(batch, length, 3, cfg.num_heads, cfg.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
        mask = jnp.tril(jnp.ones((length, length), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(_F32).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, cfg.width)
        return _dense(cfg.width, "proj", _residual_std(cfg))(out)


class FeedForward(nn.Module):
    """Position-wise MLP with GELU: f32[B, T, W] -> f32[B, T, W], hidden ``mlp_ratio * W``."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = nn.gelu(_dense(cfg.mlp_ratio * cfg.width, "fc")(x))
        return _dense(cfg.width, "proj", _residual_std(cfg))(h)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: f32[B, T, W] -> f32[B, T, W].

    ``x + attn(ln_1(x))`` followed by ``x + mlp(ln_2(x))``.
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(_F32)
        x = x + CausalSelfAttention(self.cfg, name="attn")(_layer_norm("ln_1")(x))
        return x + FeedForward(self.cfg, name="mlp")(_layer_norm("ln_2")(x))


class Head(nn.Module):
    """Final LayerNorm and linear projection to logits: f32[B, T, W] -> f32[B, T, vocab_size]."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _layer_norm("ln_f")(x.astype(_F32))
        return _dense(self.cfg.vocab_size, "out")(x)


class GPT(nn.Module):
    """Decoder-only LM: int32[B, T] tokens -> f32[B, T, vocab_size] next-token logits.

    Submodules are ``embed``, ``block_0`` .. ``block_{num_layers-1}`` and ``head``; each can be
    applied alone with ``Embed``/``Block``/``Head`` and the matching entry of ``params``.
    """

    cfg: GPTConfig = GPTConfig()

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = Embed(self.cfg, name="embed")(tokens)
        for i in range(self.cfg.num_layers):
            h = Block(self.cfg, name=f"block_{i}")(h)
        return Head(self.cfg, name="head")(h)
