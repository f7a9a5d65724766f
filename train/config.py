"""Experiment configuration: one YAML file per experiment, overridable from the command line.

A config is a frozen, typed :class:`Config` (pydantic). Scalars sit at the top
(``workers: 8``); each choosable part is a section naming its choice and that choice's
fields, or just its name for the defaults::

    model: {name: gpt, num_layers: 4, width: 128}
    optimizer: {name: adamw, lr: 3e-3, schedule: {name: cosine, warmup_steps: 30}}
    aggregator: {name: ar_topk, ratio: 0.01}      # or: aggregator: ring
    sync: {method: diloco, period: 30, compress: sparseloco}
    boundary: {name: aqsgd, forward: {name: quantize, bits: 3}}

The choices are registries (:data:`MODELS`, :data:`train.aggregators.AGGREGATORS`,
:data:`SYNCS`, :data:`BOUNDARIES`, :data:`ROW_CODECS`): one class each, whose fields are
typed and described (``python -m train --list-keys`` prints them). Files and ``--set
a.b.c=value`` overrides may only name fields that exist; unknown keys and values are errors
with the closest spelling. The flat keys of earlier versions (``task``, ``lr``,
``aggregator_args``, ``fw_bits``, ``boundary_args``, ...) still load, each with a warning
that shows its new spelling (:data:`LEGACY_KEYS`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BeforeValidator, Field, SerializeAsAny, ValidationError, model_validator

from jaxcomm._src._checks import did_you_mean
from jaxcomm._src.codec import CODECS

from . import CONFIGS_DIR, RUN
from .aggregators import (
    AGGREGATORS,
    CODEC_CHOICES,
    MAX_SEED,
    Aggregator,
    CodecChoice,
    codec_choice,
)
from .registry import Choice, Ints, Mapping, Number, Registry, Section, first_error

__all__ = [
    "Config",
    "load_config",
    "apply_overrides",
    "MODELS",
    "SYNCS",
    "BOUNDARIES",
    "ROW_CODECS",
    "LEGACY_KEYS",
]


# ---------------------------------------------------------------------------------- models


class Model(Choice):
    """A model family and its hyperparameters."""

    #: The datasets the model trains on.
    datasets: ClassVar[tuple[str, ...]] = ()

    def build(self) -> Any:
        """The :class:`models.Task` of this model."""
        from .models import build_task

        return build_task(self.key, **{k: getattr(self, k) for k in type(self).model_fields})


MODELS: Registry[Model] = Registry("model", Model, default="gpt")


@MODELS.register("gpt")
class GPTModel(Model):
    """A decoder-only transformer over bytes (:class:`models.GPT`), for ``shakespeare`` and
    ``shakespeare_complete``."""

    datasets: ClassVar[tuple[str, ...]] = ("shakespeare", "shakespeare_complete")
    vocab_size: int = Field(256, ge=1, description="tokens (256: bytes)")
    seq_len: int = Field(64, ge=1, description="context length in tokens")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    width: int = Field(128, ge=1, description="channels of the residual stream")
    num_heads: int = Field(4, ge=1, description="attention heads (dividing width)")
    mlp_ratio: int = Field(4, ge=1, description="MLP hidden size as a multiple of width")


@MODELS.register("mlp")
class MLPModel(Model):
    """A ReLU multilayer perceptron classifier (:class:`models.MLP`), for ``digits``."""

    datasets: ClassVar[tuple[str, ...]] = ("digits",)
    features: Ints = Field((128, 128), description="hidden layer widths")
    num_classes: int = Field(10, ge=1, description="output classes")


@MODELS.register("cnn")
class CNNModel(Model):
    """A ResNet classifier (:class:`models.ResNet`), for ``digits`` and
    ``synthetic_imagenet`` (random 224x224x3 images, 1000 classes: costing at ImageNet's
    shapes)."""

    datasets: ClassVar[tuple[str, ...]] = ("digits", "synthetic_imagenet")
    channels: Ints = Field((16, 32), description="channels of each stage")
    blocks_per_stage: int | Ints = Field(1, description="residual blocks per stage")
    num_classes: int = Field(10, ge=1, description="output classes")
    bottleneck: bool = Field(False, description="bottleneck blocks (ResNet-50) over basic ones")
    imagenet_stem: bool = Field(False, description="the 7x7 stride-2 stem and max pool")


# ------------------------------------------------------------------------------- optimizer


class Schedule(Section):
    """The learning rate over the optimizer's own steps (a resumed run continues it)."""

    name: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="``constant`` (``lr`` after any warm-up), ``cosine`` or ``linear`` (after "
        "the warm-up, a decay from ``lr`` to ``floor * lr`` over ``decay_steps``, then the "
        "floor)",
    )
    warmup_steps: int = Field(
        0, ge=0, description="steps of linear warm-up from ``warmup_from * lr`` (0: none)"
    )
    warmup_from: Number = Field(0.0, ge=0, le=1, description="the warm-up's first rate / lr")
    floor: Number = Field(0.1, ge=0, le=1, description="the rate at the end of a decay / lr")
    decay_steps: int = Field(
        0, ge=0, description="steps of decay after the warm-up (0: to the run's last step)"
    )

    def resolved(self, steps: int) -> dict[str, Any] | None:
        """The schedule with ``decay_steps`` counted for a run of ``steps`` steps, or None
        for a constant rate with no warm-up."""
        if self.name == "constant" and not self.warmup_steps:
            return None
        out: dict[str, Any] = {"kind": self.name, "warmup_steps": self.warmup_steps}
        if self.warmup_steps:
            out["warmup_from"] = self.warmup_from
        if self.name != "constant":
            decay = self.decay_steps or steps - 1 - self.warmup_steps
            if decay < 1:
                raise ValueError(
                    f"optimizer.schedule={self.name!r} decays over the steps after the "
                    f"warm-up, but steps={steps} leaves none after warmup_steps="
                    f"{self.warmup_steps} (the last step is {steps - 1}); lower "
                    "optimizer.schedule.warmup_steps or set optimizer.schedule.decay_steps"
                )
            out.update(decay_steps=decay, floor=self.floor)
        return out


def _schedule(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class Optimizer(Section):
    """The optimizer each worker (or the averaged gradient) steps with."""

    name: Literal["none", "sgd", "momentum", "adam", "adamw", "muon"] = Field(
        "adam",
        description="``sgd``, ``momentum`` (0.9), ``adam``, ``adamw`` or ``muon`` "
        "(``optax.contrib.muon`` on the hidden layers' 2-D weight matrices at ``muon_lr``, "
        "momentum 0.95 without Nesterov's look-ahead as the MuLoCo authors' code, AdamW at "
        "``lr`` on the rest; ``stages: 1`` only); ``none`` with an aggregator that is the "
        "whole optimizer",
    )
    lr: Number = Field(3e-3, gt=0, description="learning rate (the schedule's peak)")
    schedule: Annotated[Schedule, BeforeValidator(_schedule)] = Field(
        Schedule(),
        description="the learning-rate schedule (a name alone: its defaults); with ``none`` "
        "it multiplies the whole optimizer's update, its peak 1 (the aggregator's own step "
        "sizes are the peak)",
    )
    weight_decay: Number | None = Field(
        None,
        ge=0,
        description="``adamw``'s (and ``muon``'s) decoupled weight decay, times the scheduled "
        "rate (unset: optax's 1e-4 for adamw, none for muon); with ``sgd``/``momentum`` added "
        "to the gradient (classic weight decay); refused with ``adam`` and ``none``",
    )
    clip_norm: Number = Field(
        0.0,
        ge=0,
        description="clip the gradient to this global L2 norm before the optimizer (0: off): "
        "the averaged gradient, or each worker's own under a ``sync`` wrapper or before an "
        "aggregator that is the whole optimizer (``none``)",
    )
    muon_lr: Number = Field(0.02, gt=0, description="Muon's learning rate (``name: muon``)")

    @model_validator(mode="after")
    def _consistent(self) -> Optimizer:
        if self.name == "none":
            for key in ("weight_decay",):
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(
                        f"optimizer.{key} with optimizer none: an aggregator that is the whole "
                        "optimizer applies its own step sizes and decay (its own fields; "
                        "optimizer.schedule scales its update, peaking at 1, and "
                        "optimizer.clip_norm clips each worker's gradient before it); leave "
                        f"optimizer.{key} unset"
                    )
        if self.weight_decay is not None and self.name == "adam":
            raise ValueError(
                f"optimizer.weight_decay={self.weight_decay!r} with adam: Adam's L2 penalty is "
                "not decoupled weight decay; use optimizer adamw (or leave weight_decay unset)"
            )
        if self.muon_lr != type(self).model_fields["muon_lr"].default and self.name != "muon":
            raise ValueError(
                f"optimizer.muon_lr={self.muon_lr!r} with optimizer {self.name!r}: muon_lr is "
                "Muon's learning rate; set optimizer.name=muon or leave muon_lr unset"
            )
        return self

    def settings(self, steps: int) -> dict[str, Any]:
        """What a checkpoint must match beyond ``name`` and ``lr``: the resolved schedule,
        ``weight_decay``, ``clip_norm`` and ``muon_lr`` where they are not the defaults."""
        out: dict[str, Any] = {}
        schedule = self.schedule.resolved(steps)
        if schedule is not None:
            out["lr_schedule"] = schedule
        if self.weight_decay is not None:
            out["weight_decay"] = self.weight_decay
        if self.clip_norm:
            out["clip_norm"] = self.clip_norm
        if self.name == "muon":
            out["muon_lr"] = self.muon_lr
        return out


def _optimizer(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


# ------------------------------------------------------------------------ boundary codecs


class RowCodec(Choice):
    """How one pipeline boundary message travels, row by row (a sample's activations or
    their gradient)."""

    def build(self) -> Any:
        """The :class:`jaxcomm.pipeline.RowCodec` (None: float32)."""
        raise NotImplementedError


ROW_CODECS: Registry[RowCodec] = Registry("codec", RowCodec)


@ROW_CODECS.register("fp32")
class Fp32Rows(RowCodec):
    """Float32, as computed."""

    def build(self) -> Any:
        return None


@ROW_CODECS.register("quantize")
class QuantizeRows(RowCodec):
    """``bits``-bit quantization, one scale per token (or per ``bucket`` elements)."""

    bits: int = Field(ge=1, le=8, description="bits of each code")
    bucket: int | None = Field(None, ge=1, description="elements per scale (unset: a token)")

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.quantized_rows(self.bits, self.bucket)


@ROW_CODECS.register("chunk_topk")
class ChunkTopkRows(RowCodec):
    """Chunk-wise top-``k`` of every ``chunk`` entries, values at ``bits`` bits."""

    chunk: int = Field(ge=2, description="entries per chunk")
    k: int = Field(ge=1, description="entries sent per chunk (at most chunk)")
    bits: int | None = Field(None, ge=1, le=8, description="value bits (unset: float32)")

    @model_validator(mode="after")
    def _k_fits(self) -> ChunkTopkRows:
        if self.k > self.chunk:
            raise ValueError(f"k must be at most chunk={self.chunk}, got {self.k}")
        return self

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.topk_rows(self.chunk, self.k, self.bits)


@ROW_CODECS.register("lowrank")
class LowRankRows(RowCodec):
    """A rank-``rank`` factorisation of each sample, factors at ``bits`` bits."""

    rank: int = Field(ge=1, description="rank of the factorisation")
    bits: int = Field(ge=1, le=8, description="bits of the factors' codes")

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.lowrank_rows(self.rank, self.bits)


class LibraryRows(RowCodec, CodecChoice):
    """Any other codec of :mod:`jaxcomm.codecs`, applied to each row."""

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.RowCodec(self.codec())


# Every other library codec, by its own name and settings (a new codec needs no code here).
for _name, _cls in CODECS.items():
    if _name not in ROW_CODECS.names():
        ROW_CODECS.register(_name)(codec_choice(_cls, LibraryRows))

CodecField = ROW_CODECS.annotation


class Boundary(Choice):
    """What crosses a pipeline stage boundary (``stages > 1``)."""

    forward: CodecField = Field(
        QuantizeRows(bits=4), description="the forward codec (activations or their deltas)"
    )
    backward: CodecField = Field(
        QuantizeRows(bits=8), description="the backward codec (activation gradients)"
    )

    def build(self) -> Any:
        """The :class:`jaxcomm.pipeline.Boundary`."""
        raise NotImplementedError

    def _plain_backward(self) -> int | None:
        bw = self.backward
        if isinstance(bw, Fp32Rows):
            return None
        if not isinstance(bw, QuantizeRows) or bw.bucket is not None:
            raise ValueError(
                f"boundary {self.key}: the backward codec must be quantize (per token) or "
                f"fp32, got {bw.to_dict()}; other codecs need boundary aqsgd"
            )
        return bw.bits


BOUNDARIES: Registry[Boundary] = Registry("boundary", Boundary)


@BOUNDARIES.register("fp32")
class Fp32Boundary(Boundary):
    """Activations in float32; the gradients back by ``backward``."""

    forward: CodecField = Field(Fp32Rows(), description="float32 (the only forward codec)")
    backward: CodecField = Field(
        QuantizeRows(bits=8), description="the backward codec: quantize per token, or fp32"
    )

    @model_validator(mode="after")
    def _fp32_forward(self) -> Fp32Boundary:
        if not isinstance(self.forward, Fp32Rows):
            raise ValueError("boundary fp32 sends float32 activations; its forward is fp32")
        self._plain_backward()
        return self

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.fp32_boundary(self._plain_backward())


@BOUNDARIES.register("directq")
class DirectQBoundary(Boundary):
    """DirectQ: each activation quantized per token, no message buffer (AQ-SGD's
    baseline)."""

    @model_validator(mode="after")
    def _per_token(self) -> DirectQBoundary:
        fw = self.forward
        if not isinstance(fw, QuantizeRows) or fw.bucket is not None:
            raise ValueError(
                f"boundary directq quantizes each token: its forward is quantize with no "
                f"bucket, got {fw.to_dict()}"
            )
        self._plain_backward()
        return self

    def build(self) -> Any:
        import jaxcomm

        return jaxcomm.pipeline.directq_boundary(self.forward.bits, self._plain_backward())


@BOUNDARIES.register("aqsgd")
class AQSGDBoundary(Boundary):
    """AQ-SGD: deltas against a per-sample message buffer (the paper's codec: quantize per
    token both ways, first visits in float32)."""

    first: CodecField = Field(
        Fp32Rows(), description="a sample's first visit (quantize: a deviation from the paper)"
    )
    memory: bool = Field(
        False,
        description="send each gradient as a delta against a per-sample gradient memory (as "
        "large as the buffer), so what the backward codec drops goes at later visits (not "
        "in the paper)",
    )
    buffer_bits: int = Field(0, ge=0, le=8, description="message buffer storage bits (0: fp32)")
    buffer_dir: str = Field("", description="keep the buffers as zarr here ('': in memory)")

    @model_validator(mode="after")
    def _codecs(self) -> AQSGDBoundary:
        if isinstance(self.forward, Fp32Rows):
            raise ValueError("boundary aqsgd sends compressed deltas: its forward is not fp32")
        if self.memory and isinstance(self.backward, Fp32Rows):
            raise ValueError(
                "boundary.memory needs a compressed backward codec: a float32 gradient loses "
                "nothing that a memory could keep"
            )
        if not isinstance(self.first, (Fp32Rows, QuantizeRows)):
            raise ValueError(f"boundary.first is fp32 or quantize, got {self.first.to_dict()}")
        return self

    def paper(self) -> bool:
        """Whether this is the paper's codec (per-token quantization both ways, float32
        first visits, no memory), run by :func:`jaxcomm.pipeline.aqsgd_boundary`."""
        plain = lambda c: isinstance(c, QuantizeRows) and c.bucket is None  # noqa: E731
        return (
            plain(self.forward)
            and (plain(self.backward) or isinstance(self.backward, Fp32Rows))
            and isinstance(self.first, Fp32Rows)
            and not self.memory
        )

    def build(self) -> Any:
        import jaxcomm

        if self.paper():
            return jaxcomm.pipeline.aqsgd_boundary(self.forward.bits, self._plain_backward())
        return jaxcomm.pipeline.delta_boundary(
            self.forward.build(),
            self.backward.build(),
            first=self.first.build(),
            backward_memory=self.memory,
        )


# ---------------------------------------------------------------------- synchronisations


class Sync(Choice):
    """A synchronisation wrapped around the optimizer (``aggregator: none``): the workers
    step on their own gradients and average at scheduled steps."""

    period: int = Field(ge=1, description="H: steps between averagings")
    reduce: Literal["psum", "ring", "tree"] = Field(
        "ring", description="the float32 collective each averaging uses"
    )


SYNCS: Registry[Sync] = Registry("sync", Sync, field="method")


@SYNCS.register("local_sgd")
class LocalSGDSync(Sync):
    """Local SGD (FLSGD): every layer averaged at the last step of each period."""

    fused: bool = Field(
        False,
        description="average the whole model as one message after the whole backward, not "
        "layer by layer",
    )


@SYNCS.register("enp")
class ENPSync(Sync):
    """Partial local SGD with the equal-number partition of the layers over the period."""


@SYNCS.register("dreamddp")
class DreamDDPSync(Sync):
    """DreamDDP: the layers averaged on the schedule of the profiled backward and
    communication times on the network of step 0."""

    fill_bubbles: bool = Field(True, description="fill the schedule's idle link time")


# DiLoCo's named compressors: presets of registered aggregators (the papers' settings).
COMPRESS_PRESETS: dict[str, dict[str, Any]] = {
    "int8": {"name": "ec_quantized", "bits": 8, "bucket_size": 512},
    "int4": {"name": "ec_quantized", "bits": 4, "bucket_size": 512},
    "sparseloco": {"name": "chunk_topk", "chunk": 4096, "k": 64, "bits": 2, "decay": 0.95},
    "ar_topk": {"name": "ar_topk", "ratio": 0.01},
    "statistical": {"name": "statistical_quantized", "bits": 2, "sigmas": 6.0, "decay": 0.9},
}


def _compress(value: Any) -> Any:
    """A DiLoCo compressor: ``none``/None, a preset name, an aggregator name, or a mapping
    (``method`` is the earlier spelling of ``name``) whose name may be a preset."""
    if value is None or value == "none":
        return None
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict):
        value = dict(value)
        if "method" in value and "name" not in value:
            value["name"] = value.pop("method")
        if value.get("name") == "none":
            if len(value) > 1:
                raise ValueError(f"compress none takes no arguments, got {value!r}")
            return None
        name = value.get("name")
        if name not in COMPRESS_PRESETS and name not in AGGREGATORS.names():
            allowed = ["none", *COMPRESS_PRESETS, *AGGREGATORS.names()]
            raise ValueError(
                f"compress must be none, a preset ({', '.join(COMPRESS_PRESETS)}) or an "
                f"aggregator ({', '.join(AGGREGATORS.names())}), got {name!r}"
                + did_you_mean(name, allowed)
            )
        preset = COMPRESS_PRESETS.get(name)
        if preset is not None:
            fixed = sorted({"bits"} & set(value)) if value["name"] in ("int8", "int4") else []
            if fixed:
                raise ValueError(f"compress {value['name']} sets bits itself, got {value!r}")
            value = {**preset, **{k: v for k, v in value.items() if k != "name"}}
        return AGGREGATORS.parse(value)
    return value


@SYNCS.register("diloco")
class DiLoCoSync(Sync):
    """DiLoCo and Streaming DiLoCo (:func:`jaxcomm.diloco`): pseudo-gradients every
    ``period`` steps, an outer Nesterov step; fragments, overlap and compression."""

    outer_lr: Number = Field(0.7, gt=0, description="the outer step's learning rate")
    outer_momentum: Number = Field(
        0.9, ge=0, lt=1, description="the outer step's Nesterov momentum (0: plain SGD)"
    )
    fragments: int = Field(1, ge=1, description="Streaming DiLoCo's fragments of the layers")
    pattern: Literal["strided", "sequential"] = Field(
        "strided", description="which layers form a fragment"
    )
    overlap: int = Field(
        0, ge=0, description="tau: inner steps a fragment's pseudo-gradient travels"
    )
    alpha: Number | None = Field(
        None, ge=0, lt=1, description="the merge's weight of the local model (unset: 0.5 with "
        "overlap, else 0)"
    )  # fmt: skip
    compress: Annotated[SerializeAsAny[Aggregator] | None, BeforeValidator(_compress)] = Field(
        None,
        description="how pseudo-gradients travel: unset/none (float32 by ``reduce``), "
        "``int8``/``int4`` (error-fed quantized all-reduce), ``sparseloco`` (chunk top-64 "
        "of 4,096 at 2 bits, decay 0.95), ``ar_topk`` (ratio 0.01), ``statistical`` "
        "(MuLoCo's 2 bits), or any aggregator with its fields",
    )
    warmup_steps: int = Field(
        0, ge=0, description="data-parallel steps (a float32 all-reduce each) before the first "
        "period (DiLoCo starts from a trained model)"
    )  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> DiLoCoSync:
        if self.overlap >= self.period:
            raise ValueError(
                f"sync.overlap must be an integer in [0, period - 1] = [0, {self.period - 1}] "
                f"(inner steps a fragment's pseudo-gradient travels), got {self.overlap}"
            )
        if self.compress is not None and self.reduce != "ring":
            raise ValueError(
                f"sync.reduce applies to compress none (the float32 all-reduce); compress "
                f"{self.compress.key!r} has its own collective"
            )
        if self.compress is not None and self.compress.whole_optimizer:
            raise ValueError(
                f"sync.compress {self.compress.key!r} is a whole optimizer, not a compressor"
            )
        if self.compress is not None and self.compress.local:
            raise ValueError("sync.compress none is written compress: none")
        return self


# ---------------------------------------------------------------------------------- groups


class Groups(Section):
    """This run is one replica group of several (separate programs joined by torchft):
    the ``sync`` (DiLoCo) runs between the groups, the ``aggregator`` every step between
    this group's own workers (see ``docs/groups.md``)."""

    lighthouse: str = Field(description="the torchft lighthouse, ``http://host:port``")
    slot: int = Field(ge=0, description="this group's slot, 0..count-1 (its share of the data)")
    count: int = Field(ge=1, description="groups the run is made for (their data shares)")
    host: str = Field("127.0.0.1", description="the address other groups reach this one on")
    timeout_s: Number = Field(30.0, gt=0, description="a collective's, commit's and heal's limit")
    quorum_timeout_s: Number = Field(120.0, gt=0, description="the longest wait for a quorum")
    connect_timeout_s: Number = Field(60.0, gt=0, description="the longest wait to connect")
    retries: int = Field(3, ge=0, description="an exchange tried again after a lost member")
    start_timeout_s: Number = Field(
        60.0, ge=0, description="at the start, how long to wait for all ``count`` groups"
    )
    rejoin: bool = Field(
        False,
        description="a restart into a running run: start only once a live group heals this "
        "one (error after ``start_timeout_s``), never train alone",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Groups:
        if self.slot >= self.count:
            raise ValueError(
                f"groups.slot must be in 0..count-1 = 0..{self.count - 1}, got {self.slot}"
            )
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"groups.lighthouse must be an address http://host:port, got {self.lighthouse!r}"
            )
        return self


# ---------------------------------------------------------------------------------- config

# Keys of earlier versions: where each now lives (they still load, with a warning).
LEGACY_KEYS: dict[str, str] = {
    "task": "model.name",
    "lr": "optimizer.lr",
    "muon_lr": "optimizer.muon_lr",
    "weight_decay": "optimizer.weight_decay",
    "clip_norm": "optimizer.clip_norm",
    "lr_schedule": "optimizer.schedule.name",
    "lr_warmup_steps": "optimizer.schedule.warmup_steps",
    "lr_warmup_from": "optimizer.schedule.warmup_from",
    "lr_floor": "optimizer.schedule.floor",
    "lr_decay_steps": "optimizer.schedule.decay_steps",
    "aggregator_args": "aggregator.<field>",
    "fw_bits": "boundary.forward.bits",
    "bw_bits": "boundary.backward.bits",
    "boundary_args": "boundary.forward/backward/first/memory",
    "buffer_bits": "boundary.buffer_bits",
    "buffer_dir": "boundary.buffer_dir",
}


class Config(Section):
    """Everything one training run needs (see the module docstring for the shape)."""

    name: str = Field(
        "default",
        description="run name, one folder name (no ``/``, not ``.`` or ``..``); ``out_dir`` "
        "defaults to ``runs/<name>``",
    )
    model: MODELS.annotation = Field(GPTModel(), description="the model (``name``: gpt, mlp, cnn)")
    dataset: str = Field(
        "shakespeare",
        description="``shakespeare`` (byte-level text), ``shakespeare_complete`` (the "
        "complete works, with a held-out test split), ``digits`` (8x8 images) or "
        "``synthetic_imagenet``; each model names the ones it takes",
    )
    workers: int = Field(8, ge=1, description="data-parallel workers (``data`` mesh axis)")
    global_batch: int = Field(32, ge=1, description="samples per step over all workers")
    steps: int = Field(200, ge=1, description="optimizer steps (the final count, also resumed)")
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="seeds the init, the data order and random codecs"
    )
    optimizer: Annotated[Optimizer, BeforeValidator(_optimizer)] = Field(
        Optimizer(), description="the optimizer after the aggregator (a name alone: defaults)"
    )
    aggregator: AGGREGATORS.annotation = Field(
        AGGREGATORS.parse("ring"),
        description="what crosses the ``data`` axis each step: a name (its defaults) or a "
        "mapping with its fields; ``none`` keeps each worker's gradient (with ``sync``)",
    )
    network: str = Field(
        "1ms,1Gbps",
        description="``LATENCY,BANDWIDTH`` (``1ms,1Gbps``), a schedule "
        "``STEP:LATENCY,BANDWIDTH;...``, or ``c1``/``c2``: the AR-Topk paper's changing "
        "networks scaled to ``steps``",
    )
    overlap: bool = Field(
        False, description="communication hidden behind compute (``max``) instead of added"
    )
    compute: str = Field(
        "measured",
        description="a step's compute time: ``measured`` (this host) or a device of "
        "``jaxcomm.compute.DEVICES`` with an optional dtype (``v100``, ``a100:tf32``): the "
        "roofline "
        "of the compiled step",
    )
    mfu: Number | None = Field(
        None, gt=0, le=1, description="the roofline's share of peak flops (unset: calibrated)"
    )
    memory_efficiency: Number = Field(
        0.8, gt=0, le=1, description="the roofline's share of peak memory bandwidth"
    )
    stragglers: Mapping = Field(
        {},
        description="deterministic stragglers and latency jitter: ``jaxcomm.network."
        "Stragglers``' fields (``seed``, ``compute_sigma``, ``slow``, ``latency_jitter``)",
    )
    eval_every: int = Field(0, ge=0, description="steps between validations (0: at the end)")
    eval_batches: int = Field(4, ge=1, description="batches of each validation")
    checkpoint_every: int = Field(50, ge=0, description="steps between checkpoints (0: end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    out_dir: str = Field("", description="the run's folder ('': ``runs/<name>``)")
    progress: bool = Field(True, description="a progress bar (false: a line every 30 s)")
    async_steps: bool = Field(
        True, description="dispatch step t + 1 before reading step t's metrics"
    )
    train_samples: int = Field(0, ge=0, description="train on the first N samples (0: all)")
    stages: int = Field(1, ge=1, description="pipeline stages (gpt; 1: data parallel only)")
    microbatches: int = Field(4, ge=1, description="GPipe microbatches per step per replica")
    boundary: BOUNDARIES.annotation = Field(
        Fp32Boundary(),
        description="what crosses a stage boundary: ``fp32``, ``directq`` or ``aqsgd`` with "
        "a codec each way",
    )
    estimate: Mapping = Field(
        {},
        description="``python -m train.estimate``'s extras: ``networks`` (more networks) and "
        "``baseline`` (config keys of a second config estimated beside)",
    )
    init_params: str = Field(
        "", description="start from this ``params.msgpack`` ('': a random init)"
    )
    adaptive: Mapping = Field(
        {},
        description="AR-Topk's adaptive ratio (``aggregator: ar_topk``): "
        "``jaxcomm.adaptive.AdaptiveRatio``'s fields (``candidates``, ``trial_steps``, ...)",
    )
    sync: Annotated[SerializeAsAny[Sync] | None, BeforeValidator(lambda v: _sync(v))] = Field(
        None,
        description="a synchronisation around the optimizer (``method``: local_sgd, enp, "
        "dreamddp, diloco), with ``aggregator: none``",
    )
    groups: Groups | None = Field(
        None,
        description="run as one replica group of several (``sync: diloco`` between groups, "
        "over torchft); unset: one program",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ValueError(first_error(e)) from None

    @classmethod
    def unknown_key(cls, key: str) -> ValueError:
        return _unknown(key)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = translate_legacy(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        check_config(self)
        return self

    # ------------------------------------------------------------------ derived

    @property
    def run_dir(self) -> Path:
        """The output folder of this run."""
        return Path(self.out_dir or f"runs/{self.name}")

    @property
    def task(self) -> str:
        """The model family (``gpt``, ``mlp``, ``cnn``)."""
        return self.model.key

    @property
    def lr(self) -> float:
        """The optimizer's learning rate (its schedule's peak)."""
        return self.optimizer.lr

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` (any config keys, validated)."""
        return Config(**{**self.to_dict(), **changes})

    def network_schedule(self) -> Any:
        """The :class:`jaxcomm.network.NetworkSchedule` of ``network``."""
        from jaxcomm._src.network import NetworkSchedule

        if self.network.strip().lower() in ("c1", "c2"):
            return NetworkSchedule.preset(self.network.strip(), self.steps)
        return NetworkSchedule.parse(self.network)

    def roofline(self) -> Any:
        """The :class:`jaxcomm.compute.Roofline` of ``compute`` (``None`` when ``measured``)."""
        if self.compute == "measured":
            return None
        from jaxcomm._src.compute import roofline

        device, _, dtype = self.compute.partition(":")
        return roofline(
            device, dtype=dtype or "fp32", mfu=self.mfu, efficiency=self.memory_efficiency
        )

    def straggler_model(self) -> Any:
        """The :class:`jaxcomm.network.Stragglers` of ``stragglers`` (``None`` when empty)."""
        if not self.stragglers:
            return None
        import dataclasses

        from jaxcomm._src.network import Stragglers

        known = {f.name for f in dataclasses.fields(Stragglers)}
        unknown = sorted(set(self.stragglers) - known)
        if unknown:
            raise ValueError(
                f"stragglers: unknown keys {unknown}; known: {sorted(known)}"
                + did_you_mean(unknown[0], known)
            )
        model = Stragglers(**self.stragglers)
        workers = self.workers * self.stages
        bad = [w for w in model.slow if w >= workers]
        if bad:
            raise ValueError(f"stragglers.slow: workers {bad} do not exist among {workers}")
        return model

    def adaptive_model(self) -> Any:
        """The :class:`jaxcomm.adaptive.AdaptiveRatio` of ``adaptive`` (None when empty)."""
        if not self.adaptive:
            return None
        from jaxcomm._src.adaptive import AdaptiveRatio

        try:
            return AdaptiveRatio(**self.adaptive)
        except TypeError as e:
            raise ValueError(f"adaptive {self.adaptive!r}: {e}") from e

    def estimate_baseline(self) -> Config | None:
        """The config ``estimate.baseline`` makes (None without one); checks ``estimate``."""
        est = self.estimate
        known = ["networks", "baseline"]
        unknown = sorted(set(est) - set(known))
        if unknown:
            raise ValueError(
                f"estimate: unknown keys {unknown}{did_you_mean(unknown[0], known)}; known: {known}"
            )
        nets = est.get("networks", [])
        if not isinstance(nets, list) or not all(isinstance(n, str) for n in nets):
            raise ValueError(f"estimate.networks must be a list of network strings, got {nets!r}")
        from jaxcomm._src.network import NetworkSchedule

        for n in nets:
            NetworkSchedule.parse(n)
        base = est.get("baseline")
        if base is None:
            return None
        if not isinstance(base, dict) or not base:
            raise ValueError(f"estimate.baseline must be a mapping of config keys, got {base!r}")
        if "estimate" in base:
            raise ValueError("estimate.baseline cannot set estimate")
        data = self.to_dict()
        data.update(estimate={})
        for key, value in base.items():
            _set_path(data, key.split("."), value)
        return Config(**data)


def _sync(value: Any) -> Any:
    if value is None or value == {}:
        return None
    return SYNCS.parse(value)


def check_config(cfg: Config) -> None:
    """The rules between sections (each section checks its own fields)."""
    _check_name(cfg.name)
    model, agg, opt, sync = cfg.model, cfg.aggregator, cfg.optimizer, cfg.sync
    if cfg.dataset not in model.datasets:
        raise ValueError(
            f"dataset must be one of {model.datasets} for model {model.key!r}, got "
            f"{cfg.dataset!r}{did_you_mean(cfg.dataset, model.datasets)}"
        )
    if cfg.global_batch % cfg.workers:
        raise ValueError(
            f"global_batch must be a multiple of workers={cfg.workers}, got {cfg.global_batch}"
        )
    if agg.whole_optimizer != (opt.name == "none"):
        raise ValueError(
            f"aggregator {agg.key!r} with optimizer {opt.name!r}: "
            f"{', '.join(n for n, c in AGGREGATORS if c.whole_optimizer)} apply their own step "
            "sizes and need optimizer none; the others need an optimizer"
        )
    if (
        opt.name == "none"
        and opt.schedule.resolved(cfg.steps) is not None
        and not getattr(agg, "schedulable", False)
    ):
        raise ValueError(
            f"optimizer.schedule with aggregator {agg.key!r}: its state keeps the step it "
            "applied (error feedback of the step), so a schedule scaling its output after it "
            "would be neither applied nor remembered; only "
            f"{', '.join(n for n, c in AGGREGATORS if c.schedulable)} take a schedule"
        )
    if cfg.compute != "measured":
        cfg.roofline()  # a clear error for an unknown device, dtype or share
        _, _, dtype = cfg.compute.partition(":")
        if dtype not in ("", "fp32", "tf32"):
            raise ValueError(
                f"compute={cfg.compute!r}: the models compute in float32, so their matrix "
                f"products run at the fp32 (or, on A100/H100, tf32) peak, not {dtype!r}; "
                "allowed dtypes: fp32, tf32"
            )
    elif cfg.mfu is not None:
        raise ValueError(f"mfu={cfg.mfu!r} needs compute=<device>, got compute='measured'")
    cfg.straggler_model()
    if cfg.adaptive:
        if sync is not None:
            raise ValueError(
                f"adaptive={cfg.adaptive!r} with sync {sync.key!r}: the adaptive ratio tunes "
                "the top-k aggregator that runs every step, and local SGD runs no aggregator "
                "(it averages parameters at scheduled steps); choose one"
            )
        if agg.key != "ar_topk":
            raise ValueError(
                f"adaptive={cfg.adaptive!r} chooses AR-Topk's ratio and needs aggregator "
                f"ar_topk; got aggregator {agg.key!r}"
            )
        cfg.adaptive_model()
    elif agg.key == "ar_topk" and agg.ratio is None:
        raise ValueError("aggregator ar_topk needs ratio (e.g. {name: ar_topk, ratio: 0.01})")
    _check_sync(cfg)
    if cfg.stages > 1:
        if model.key != "gpt":
            raise ValueError(f"stages={cfg.stages} needs model gpt, got {model.key!r}")
        if cfg.global_batch % (cfg.workers * cfg.microbatches):
            raise ValueError(
                f"global_batch must be a multiple of workers * microbatches = "
                f"{cfg.workers * cfg.microbatches}, got {cfg.global_batch}"
            )
        if opt.name == "muon":
            raise ValueError(
                f"optimizer muon with stages={cfg.stages}: a pipeline stacks its stages' "
                "layers, so a stage's weight matrices are not 2-D leaves; use muon with stages=1"
            )
        if opt.clip_norm:
            raise ValueError(
                f"optimizer.clip_norm={opt.clip_norm!r} with stages={cfg.stages}: each pipeline "
                "stage steps its own layers, so the global norm of the gradient is not on any "
                "one device; clip with stages=1"
            )
    opt.settings(cfg.steps)  # a schedule that fits the run
    cfg.estimate_baseline()
    if cfg.init_params and not Path(cfg.init_params).is_file():
        raise ValueError(f"init_params must name an existing file, got {cfg.init_params!r}")
    cfg.network_schedule()  # a clear error for a bad network
    blocked = next((p for p in (cfg.run_dir, *cfg.run_dir.parents) if p.is_file()), None)
    if blocked is not None:
        raise ValueError(
            f"out_dir {str(cfg.run_dir)!r} cannot be a folder: {str(blocked)!r} is a file; "
            "choose a folder for the run's outputs (--set out_dir=...)"
        )


def _check_groups(cfg: Config) -> None:
    g, sync = cfg.groups, cfg.sync
    if not isinstance(sync, DiLoCoSync):
        raise ValueError(
            "groups needs sync.method=diloco (the outer step between the groups), got "
            f"sync={None if sync is None else sync.key!r}"
        )
    if cfg.aggregator.local and cfg.workers > 1:
        raise ValueError(
            f"groups with workers={cfg.workers}: the aggregator averages this group's own "
            "workers every step, so it cannot be none; use e.g. aggregator: ring"
        )
    if cfg.stages > 1 and cfg.boundary.key == "aqsgd":
        raise ValueError(
            f"groups with stages={cfg.stages} and boundary aqsgd: its per-sample message "
            "buffers are not part of a heal's live state, so a healed group would not hold "
            "what its peer holds; use boundary fp32 or directq inside a group"
        )
    if sync.warmup_steps:
        raise ValueError(
            "groups with sync.warmup_steps: a data-parallel warm start spans every worker; "
            "warm the model in one program and start the groups from it (init_params)"
        )
    starts = [(p + 1) * sync.period // sync.fragments - 1 for p in range(sync.fragments)]
    gap = min([b - a for a, b in zip(starts, starts[1:], strict=False)]
              + [sync.period - starts[-1] + starts[0]])  # fmt: skip
    if sync.overlap >= gap:
        raise ValueError(
            f"groups: sync.overlap={sync.overlap} with fragments={sync.fragments} and "
            f"period={sync.period}: a fragment's exchange must merge before the next "
            f"fragment's starts, {gap} steps later at the closest; choose overlap < {gap}"
        )
    if cfg.stragglers or cfg.overlap:
        raise ValueError(
            "groups with stragglers or overlap=true: a group measures its own steps and "
            "overlaps its exchanges for real (sync.overlap); leave both unset"
        )
    if sync.compress is not None and sync.compress.error_fed_codec() is None:
        raise ValueError(
            f"groups with sync.compress {sync.compress.key!r}: between groups a compressor "
            "is an error-fed codec whose payloads are all-gathered: int8, int4, sparseloco, "
            "statistical, chunk_topk, ec_quantized, statistical_quantized or error_fed"
        )
    if cfg.global_batch % cfg.workers:
        raise ValueError(
            f"groups: global_batch={cfg.global_batch} (this group's batch) must be a "
            f"multiple of workers={cfg.workers}"
        )
    del g


def _check_sync(cfg: Config) -> None:
    if cfg.groups is not None:
        _check_groups(cfg)
        return
    sync = cfg.sync
    if sync is None:
        if cfg.aggregator.local:
            raise ValueError(
                "aggregator none (each worker keeps its own gradient) needs a sync wrapper, "
                "e.g. sync={method: local_sgd, period: 5}; otherwise the workers never agree"
            )
        return
    if not cfg.aggregator.local:
        raise ValueError(
            f"sync {sync.key!r} needs aggregator none (each worker steps on its own gradient; "
            f"the sync wrapper averages parameters), got aggregator {cfg.aggregator.key!r}"
        )
    diloco = isinstance(sync, DiLoCoSync)
    if cfg.overlap and cfg.stages == 1 and diloco:
        raise ValueError(
            "overlap=true with sync.method=diloco and stages=1: DiLoCo's clock hides a "
            "transfer behind sync.overlap inner steps (its own key); set overlap=false "
            "and sync.overlap to the inner steps a transfer may take"
        )
    if cfg.overlap and cfg.stages == 1:
        raise ValueError(
            "overlap=true with sync and stages=1: data-parallel local SGD follows "
            "DreamDDP's iteration timeline, whose averaging overlaps the backward pass by "
            "construction; set overlap=false"
        )
    if diloco and cfg.stragglers:
        raise ValueError(
            f"stragglers={cfg.stragglers!r} with sync.method=diloco: DiLoCo's clock does "
            "not model each worker's own pace between synchronisations (it would make "
            "every inner step wait for the slowest worker); use stragglers with "
            "local_sgd or dreamddp"
        )
    if cfg.stages != 1 and cfg.stragglers:
        raise ValueError(
            f"stragglers={cfg.stragglers!r} with sync {sync.key!r} and stages={cfg.stages}: "
            "between averagings each pipeline replica would run at its own pace, which the "
            "pipeline's clock does not model (it would make every step wait for the slowest "
            "replica); use stragglers with sync on stages=1, or stragglers with a pipeline "
            "that aggregates every step"
        )
    if cfg.stages != 1 and getattr(sync, "fused", False):
        raise ValueError(
            f"sync.fused=true with stages={cfg.stages}: a pipeline's parameter groups live "
            "on different devices and cannot travel as one message; leave fused out"
        )


def _check_name(name: str) -> None:
    """A run name is one folder name: ``runs/<name>`` stays inside ``runs/``."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 255:
        raise ValueError(
            f"name must be one folder name (no '/', not '.' or '..', at most 255 characters), "
            f"got {name!r}; to write the run elsewhere, set out_dir=<folder>"
        )


def translate_legacy(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the keys of earlier versions (:data:`LEGACY_KEYS`) moved to their new
    places, warning once per key with its new spelling."""
    old = [k for k in data if k in LEGACY_KEYS]
    if not old and not isinstance(data.get("optimizer", {}), str):
        return data
    data = dict(data)
    for key in old:
        warnings.warn(
            f"config key {key!r} is now {LEGACY_KEYS[key]!r}; the old spelling will go",
            FutureWarning,
            stacklevel=2,
        )

    def section(key: str, default: str) -> dict[str, Any]:
        value = data.get(key, default)
        if isinstance(value, Section):
            value = value.to_dict()
        return {"name": value} if isinstance(value, str) else dict(value)

    if "task" in data:
        model = (
            dict(data["model"]) if isinstance(data.get("model"), dict) else section("model", "gpt")
        )
        task = data.pop("task")
        # An earlier config's model fields (no name) are its task's; a model of another
        # family (a base config's) keeps only the fields the task's family has.
        if model.get("name", task) != task and task in MODELS.names():
            model = {k: v for k, v in model.items() if k in MODELS[task].model_fields}
        data["model"] = {**model, "name": task}
    opt_keys = {"lr", "muon_lr", "weight_decay", "clip_norm"}
    sched_keys = {"lr_schedule": "name", "lr_warmup_steps": "warmup_steps",
                  "lr_warmup_from": "warmup_from", "lr_floor": "floor",
                  "lr_decay_steps": "decay_steps"}  # fmt: skip
    if opt_keys & set(data) or sched_keys.keys() & set(data) or "optimizer" in data:
        opt = section("optimizer", "adam")
        for key in sorted(opt_keys & set(data)):
            value = data.pop(key)
            if not (key == "clip_norm" and value is None):
                opt[key] = value
        sched = opt.get("schedule", {})
        sched = {"name": sched} if isinstance(sched, str) else dict(sched)
        for key, new in sched_keys.items():
            if key in data:
                sched[new] = data.pop(key)
        if sched:
            opt["schedule"] = sched
        data["optimizer"] = opt
    if "aggregator_args" in data:
        agg = section("aggregator", "ring")
        args = data.pop("aggregator_args") or {}
        data["aggregator"] = {**agg, **args}
    bkeys = ("fw_bits", "bw_bits", "boundary_args", "buffer_bits", "buffer_dir")
    if any(k in data for k in bkeys):
        data["boundary"] = _legacy_boundary(data, section("boundary", "fp32"))
    return data


def _legacy_boundary(data: dict[str, Any], boundary: dict[str, Any]) -> dict[str, Any]:
    """The boundary section of the earlier flat keys (``boundary``, ``fw_bits``,
    ``bw_bits``, ``boundary_args``, ``buffer_bits``, ``buffer_dir``)."""
    fw_bits, bw_bits = data.pop("fw_bits", 4), data.pop("bw_bits", 8)
    for key, bits, low in (("fw_bits", fw_bits, 1), ("bw_bits", bw_bits, 0)):
        if isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= 8:
            raise ValueError(f"{key} must be an integer in [{low}, 8], got {bits!r}")
    args = dict(data.pop("boundary_args", None) or {})
    buffers = {k: data.pop(k) for k in ("buffer_bits", "buffer_dir") if k in data}
    name = boundary["name"]
    out: dict[str, Any] = {"name": name}
    if args and name != "aqsgd":
        raise ValueError(
            f"boundary_args={args!r} chooses the codecs of AQ-SGD's deltas and needs "
            f"boundary aqsgd; got boundary {name!r}"
        )

    def side(prefix: str, bits: int) -> dict[str, Any]:
        chunk, k, bucket = (args.pop(f"{prefix}_{n}", None) for n in ("chunk", "k", "bucket"))
        rank = args.pop(f"{prefix}_rank", None)
        if rank is not None:
            if chunk is not None or k is not None or bucket is not None:
                raise ValueError(
                    f"{prefix}_rank sends a low-rank code; it excludes {prefix}_chunk, "
                    f"{prefix}_k and {prefix}_bucket"
                )
            return {"name": "lowrank", "rank": rank, "bits": bits}
        if chunk is not None or k is not None:
            if chunk is None or k is None:
                raise ValueError(f"{prefix}_chunk and {prefix}_k go together (a top-k code)")
            if bucket is not None:
                raise ValueError(
                    f"{prefix}_bucket quantizes whole rows; {prefix}_chunk with {prefix}_k "
                    "sends a top-k code: choose one"
                )
            return {"name": "chunk_topk", "chunk": chunk, "k": k, "bits": bits or None}
        if not bits:
            if bucket is not None:
                raise ValueError(
                    f"{prefix}_bucket={bucket} quantizes, but {prefix}_bits is 0 (float32)"
                )
            return {"name": "fp32"}
        return {"name": "quantize", "bits": bits, "bucket": bucket}

    if name != "fp32":
        out["forward"] = side("fw", fw_bits)
    out["backward"] = side("bw", bw_bits) if name == "aqsgd" else (
        {"name": "quantize", "bits": bw_bits} if bw_bits else {"name": "fp32"}
    )  # fmt: skip
    if name == "aqsgd":
        if "first_bits" in args:
            first = args.pop("first_bits")
            if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first <= 8:
                raise ValueError(
                    f"boundary_args.first_bits must be a positive integer up to 8, got {first!r}"
                )
            out["first"] = {"name": "quantize", "bits": first}
        if "bw_memory" in args:
            out["memory"] = args.pop("bw_memory")
        out.update(buffers)
    if args:
        known = [f"{p}_{n}" for p in ("fw", "bw") for n in ("chunk", "k", "bucket", "rank")]
        known += ["first_bits", "bw_memory"]
        unknown = sorted(args)
        raise ValueError(f"boundary_args: unknown keys {unknown}" + did_you_mean(unknown[0], known))
    return out


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``data[path[0]][path[1]]... = value``, a section given by name alone taken as
    ``{name: ...}`` on the way."""
    head, rest = path[0], path[1:]
    if not rest:
        data[head] = value
        return
    inner = data.get(head)
    if isinstance(inner, str):
        key = "method" if head == "sync" else "name"
        inner = {key: inner}
    if inner is None:
        inner = {}
    if not isinstance(inner, dict):
        raise ValueError(f"config key {head!r} is not a mapping; cannot set {'.'.join(path)!r}")
    inner = dict(inner)
    if rest in (["name"], ["method"]) and head != "optimizer" and inner.get(rest[0]) != value:
        inner = {}  # another choice: the old one's fields are not the new one's
    _set_path(inner, rest, value)
    data[head] = inner


def key_docs() -> list[tuple[str, Any, str]]:
    """``(key, default, meaning)`` of every config key and every registered choice's
    fields (``aggregator.ratio (ar_topk)``), from the classes' field descriptions; the
    default of a required field is ``...``."""
    out: list[tuple[str, Any, str]] = []

    def fields(prefix: str, cls: type, owner: str = "") -> None:
        for name, f in cls.model_fields.items():
            default = ... if f.is_required() else f.get_default(call_default_factory=True)
            if isinstance(default, Section):
                default = default.to_dict()
            label = f"{prefix}{name}" + (f" ({owner})" if owner else "")
            out.append((label, default, f.description or ""))

    registries = {"model": MODELS, "aggregator": AGGREGATORS, "sync": SYNCS,
                  "boundary": BOUNDARIES}  # fmt: skip
    for name, f in Config.model_fields.items():
        default = f.get_default(call_default_factory=True)
        if isinstance(default, Section):
            default = default.to_dict()
        choices = registries.get(name)
        text = f.description or ""
        if choices is not None:
            text += "; one of: " + ", ".join(f"``{n}`` ({c.summary()})" for n, c in choices)
        out.append((name, default, text))
        if choices is not None:
            for key, cls in choices:
                fields(f"{name}.", cls, key)
        elif name == "optimizer":
            fields("optimizer.", Optimizer)
            fields("optimizer.schedule.", Schedule)
        elif name == "groups":
            fields("groups.", Groups)
    for key, cls in ROW_CODECS:
        fields("boundary.<forward|backward|first>.", cls, key)
    for key, cls in CODEC_CHOICES:
        fields("aggregator.codec.", cls, key)
    return out


# The most values a config may expand to (YAML aliases repeat a value without its size).
MAX_YAML_VALUES = 100_000


# The deepest a config nests (mappings and lists inside each other).
MAX_YAML_DEPTH = 64


class _SelfReference(Exception):
    pass


def _yaml_values(node: Any, memo: dict[int, int], open_: set[int], depth: int = 0) -> int:
    """How many values ``node`` expands to, aliases counted at their full size."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise _SelfReference
    if depth > MAX_YAML_DEPTH:
        raise ValueError(f"nests deeper than {MAX_YAML_DEPTH} levels")
    open_.add(key)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_yaml_values(v, memo, open_, depth + 1) for v in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(
            _yaml_values(k, memo, open_, depth + 1) + _yaml_values(v, memo, open_, depth + 1)
            for k, v in node.value
        )
    open_.discard(key)
    memo[key] = n
    return n


def _load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)``, refusing text that is not YAML, refers to itself, nests
    deeper than :data:`MAX_YAML_DEPTH` or expands to more than :data:`MAX_YAML_VALUES`
    values (one line naming ``what``)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            try:
                size = _yaml_values(node, {}, set())
            except _SelfReference:
                raise ValueError(
                    f"{what} refers to itself (a YAML alias inside its anchor)"
                ) from None
            except ValueError as e:
                raise ValueError(f"{what} {e}") from None
            if size > MAX_YAML_VALUES:
                raise ValueError(
                    f"{what} expands to {size:,} values (each YAML alias counted at its full "
                    f"size); a config holds at most {MAX_YAML_VALUES:,}"
                )
        return yaml.safe_load(text)
    except RecursionError:  # nested too deep for the YAML reader itself
        raise ValueError(f"{what} nests deeper than {MAX_YAML_DEPTH} levels") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what} is not valid YAML{at}: {problem}") from None


def resume_command(run_dir: str | Path, launcher: str | None = None) -> str:
    """The command that continues the run in ``run_dir`` (shell-quoted), for messages: by
    ``launcher``, else ``python -m train``, or ``python -m train.launch --processes N`` in a
    process that ``train.launch`` started."""
    import os
    import shlex

    from .distributed import ENV_LAUNCHED

    if launcher is None:
        n = os.environ.get(ENV_LAUNCHED)
        launcher = f"{RUN}.launch --processes {n}" if n else RUN
    return f"{launcher} --resume {shlex.quote(str(run_dir))}"


def out_dir_override(folder: str) -> str:
    """The ``--set`` override that names run folder ``folder`` as it is written: quoted, so
    YAML reads no comment (``#``), mapping (``: ``) or boolean (``true``, ``2024``) in it."""
    return f"out_dir={json.dumps(str(folder))}"


def read_saved_config(path: str | Path) -> dict[str, Any]:
    """The mapping a run saved as ``config.json`` at ``path``; ValueError when it is not
    readable JSON or not a mapping."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{str(path)!r} is not a readable config") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} does not hold a config mapping")
    return data


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """A config from a mapping of its keys (a run's saved ``config.json``), with overrides."""
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping, got {data!r}")
    return apply_overrides(Config(**data), list(overrides or []))


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``key=value`` strings to ``cfg`` (``a.b.c=value`` reaches into sections; a
    value is read as YAML)."""
    if not overrides:
        return cfg
    data = cfg.to_dict()
    done: list[tuple[str, list[str]]] = []  # (override, path) already applied
    for item in overrides:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            shown = item.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            raise ValueError(f"override {shown!r} is not valid UTF-8 text") from None
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. steps=100)")
        key, text = item.split("=", 1)
        value = _load_yaml(text, f"override {item!r}") if text.strip() else ""
        path = key.strip().split(".")
        if path[0] not in Config.model_fields and path[0] not in LEGACY_KEYS:
            raise _unknown(path[0])
        if path[0] in LEGACY_KEYS and len(path) > 1:
            data = translate_legacy({**data, path[0]: {}})  # e.g. aggregator_args.ratio
            path = [LEGACY_KEYS[path[0]].split(".")[0], *path[1:]]
        for earlier, where in done:
            if len(where) > len(path) and where[: len(path)] == path:
                raise ValueError(
                    f"override {item!r} replaces {'.'.join(path)!r} after {earlier!r} set a "
                    f"field of it, which would be lost; give {item!r} first"
                )
        if path == ["optimizer"] and isinstance(value, str):
            path = ["optimizer", "name"]  # the optimizer's other fields are every one's
        _set_path(data, path, value)
        done.append((item, path))
    return Config(**data)


def _unknown(key: str) -> ValueError:
    allowed = list(Config.model_fields)
    hint = did_you_mean(key, allowed)  # first: the list after it is long
    old = did_you_mean(key, LEGACY_KEYS)
    if not hint and old:
        hint = f"; did you mean {LEGACY_KEYS[old.split(chr(39))[1]]!r}?"
    return ValueError(f"unknown config key {key!r}{hint} (allowed keys: {sorted(allowed)})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    if path is None:
        return apply_overrides(Config(), list(overrides or []))
    path = Path(path)
    if not path.is_file():
        shipped = sorted(q.name for q in CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []
        raise FileNotFoundError(
            f"config file {str(path)!r} does not exist"
            + (did_you_mean(path.name, shipped) or (f"; shipped: {', '.join(shipped)}"
                                                    if shipped else ""))
        )  # fmt: skip
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"config file {str(path)!r} is not text (YAML expected)") from None
    loaded = _load_yaml(text, f"config file {str(path)!r}")
    if loaded is None:
        raise ValueError(
            f"config file {str(path)!r} is empty; give the keys to change (see "
            "configs/dp_default.yaml), or leave out --config for the defaults"
        )
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {loaded!r}")
    top = [k for k in loaded if k not in Config.model_fields and k not in LEGACY_KEYS]
    if top:
        raise _unknown(str(top[0]))
    return apply_overrides(Config(**loaded), list(overrides or []))
