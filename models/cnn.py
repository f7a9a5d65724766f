"""A small ResNet-style CNN classifier for small NHWC images, in ``flax.linen``.

Normalisation is GroupNorm (no BatchNorm), so the model state is only the ``params`` tree.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .common import check_positive_int, check_positive_int_tuple

_MAX_GROUPS = 8


def _group_norm(channels: int, name: str) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=math.gcd(channels, _MAX_GROUPS), name=name)


class Stem(nn.Module):
    """3x3 conv + GroupNorm + ReLU: f32[B, H, W, C_in] -> f32[B, H, W, channels]; with
    ``imagenet=True`` the ImageNet ResNets' 7x7 stride-2 conv then a 3x3 stride-2 max pool:
    f32[B, H, W, C_in] -> f32[B, H/4, W/4, channels]."""

    channels: int
    imagenet: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.imagenet:
            x = nn.Conv(
                self.channels, (7, 7), strides=(2, 2), padding="SAME", use_bias=False, name="conv"
            )(x)
            x = nn.relu(_group_norm(self.channels, "norm")(x))
            return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = nn.Conv(self.channels, (3, 3), padding="SAME", use_bias=False, name="conv")(x)
        return nn.relu(_group_norm(self.channels, "norm")(x))


class ResidualBlock(nn.Module):
    """Two 3x3 convs with a skip: f32[B, H, W, C_in] -> f32[B, H/stride, W/stride, channels].

    The skip is a 1x1 conv (with ``stride``) when the spatial size or channel count changes,
    otherwise the identity. Output is ``relu(norm(conv(relu(norm(conv(x))))) + skip(x))``.
    """

    channels: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        strides = (self.stride, self.stride)
        y = nn.Conv(
            self.channels, (3, 3), strides=strides, padding="SAME", use_bias=False, name="conv_1"
        )(x)
        y = nn.relu(_group_norm(self.channels, "norm_1")(y))
        y = nn.Conv(self.channels, (3, 3), padding="SAME", use_bias=False, name="conv_2")(y)
        y = _group_norm(self.channels, "norm_2")(y)
        skip = x
        if self.stride != 1 or x.shape[-1] != self.channels:
            skip = nn.Conv(self.channels, (1, 1), strides=strides, use_bias=False, name="proj")(x)
        return nn.relu(y + skip)


class BottleneckBlock(nn.Module):
    """1x1, 3x3 (with ``stride``), 1x1 convs with a skip, as in ResNet-50:
    f32[B, H, W, C_in] -> f32[B, H/stride, W/stride, 4 * channels].

    The skip is a 1x1 conv (with ``stride``) when the shape changes, otherwise the identity.
    """

    channels: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        out = 4 * self.channels
        strides = (self.stride, self.stride)
        y = nn.Conv(self.channels, (1, 1), use_bias=False, name="conv_1")(x)
        y = nn.relu(_group_norm(self.channels, "norm_1")(y))
        y = nn.Conv(
            self.channels, (3, 3), strides=strides, padding="SAME", use_bias=False, name="conv_2"
        )(y)
        y = nn.relu(_group_norm(self.channels, "norm_2")(y))
        y = nn.Conv(out, (1, 1), use_bias=False, name="conv_3")(y)
        y = _group_norm(out, "norm_3")(y)
        skip = x
        if self.stride != 1 or x.shape[-1] != out:
            skip = nn.Conv(out, (1, 1), strides=strides, use_bias=False, name="proj")(x)
        return nn.relu(y + skip)


class PoolHead(nn.Module):
    """Global average pool over H, W then Dense: f32[B, H, W, C] -> f32[B, num_classes]."""

    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.num_classes, name="dense")(x.mean(axis=(1, 2)))


class ResNet(nn.Module):
    """ResNet classifier: f32[B, H, W, C] NHWC images -> f32[B, num_classes] logits.

    Submodules ``stem``, ``stage{i}_block{j}`` for ``i < len(channels)``,
    ``j < blocks_per_stage`` (or ``blocks_per_stage[i]``; stage ``i`` has ``channels[i]``
    channels, times 4 at a bottleneck's output; its first block has stride 2 when ``i > 0``),
    and ``head``. ``bottleneck`` picks :class:`BottleneckBlock` over :class:`ResidualBlock`,
    ``imagenet_stem`` the 7x7/2 conv and max pool of the ImageNet ResNets: ResNet-50 is
    ``channels=(64, 128, 256, 512), blocks_per_stage=(3, 4, 6, 3), bottleneck=True,
    imagenet_stem=True, num_classes=1000`` (GroupNorm in place of BatchNorm).
    """

    channels: tuple[int, ...] = (16, 32)
    blocks_per_stage: int | tuple[int, ...] = 1
    num_classes: int = 10
    bottleneck: bool = False
    imagenet_stem: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "channels", check_positive_int_tuple("ResNet", "channels", self.channels)
        )
        blocks = self.blocks_per_stage
        if isinstance(blocks, int) and not isinstance(blocks, bool):
            check_positive_int("ResNet", "blocks_per_stage", blocks)
        else:
            blocks = check_positive_int_tuple("ResNet", "blocks_per_stage", blocks)
            if len(blocks) != len(self.channels):
                raise ValueError(
                    f"ResNet.blocks_per_stage must give one count per stage "
                    f"({len(self.channels)}), got {self.blocks_per_stage!r}"
                )
            object.__setattr__(self, "blocks_per_stage", blocks)
        check_positive_int("ResNet", "num_classes", self.num_classes)
        for name in ("bottleneck", "imagenet_stem"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ResNet.{name} must be a bool, got {getattr(self, name)!r}")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim != 4:
            raise ValueError(f"ResNet expects NHWC images of shape [B, H, W, C], got {x.shape}")
        h = Stem(self.channels[0], self.imagenet_stem, name="stem")(x.astype(jnp.float32))
        block = BottleneckBlock if self.bottleneck else ResidualBlock
        for i, channels in enumerate(self.channels):
            count = (
                self.blocks_per_stage
                if isinstance(self.blocks_per_stage, int)
                else self.blocks_per_stage[i]
            )
            for j in range(count):
                stride = 2 if i > 0 and j == 0 else 1
                h = block(channels, stride, name=f"stage{i}_block{j}")(h)
        return PoolHead(self.num_classes, name="head")(h)
