"""The aggregators a config can name (``aggregator: ...``), one registered class each.

Every class's fields are its factory's keyword arguments (defaults and ranges as the
factory's); :meth:`Aggregator.build` calls the factory over the trainer's ``data`` axis.
The same registry names DiLoCo's pseudo-gradient compressors (``sync.compress``), so every
aggregator here runs every step and on DiLoCo's outer step alike.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Literal

import optax
from pydantic import Field, create_model, model_validator

import jaxcomm
from jaxcomm._src.network import Network

from .registry import Choice, Number, Registry

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "BuildContext",
    "CODEC_CHOICES",
    "CodecChoice",
    "MAX_SEED",
    "codec_choice",
]

# The largest seed: NumPy's and JAX's generators take any value below it on every platform.
MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What an aggregator's factory may need beyond its own fields: the mesh axis it
    averages over, the run's seed (the default of a ``seed`` field) and the network of
    step 0 (an automatic collective choice)."""

    axis: Any = "data"
    seed: int = 0
    network: Network = dataclasses.field(default_factory=lambda: Network.parse("1ms,1Gbps"))


class Aggregator(Choice):
    """An aggregator: what crosses the ``data`` axis each step (see the module)."""

    #: True for an aggregator that is the whole optimizer (it applies its own step sizes,
    #: so the trainer's ``optimizer`` must be ``none``).
    whole_optimizer: ClassVar[bool] = False
    # A whole optimizer whose state does not hold the step it applied (no error feedback
    # of the step), so a learning-rate schedule may scale its output afterwards.
    schedulable: ClassVar[bool] = False
    #: True where each worker keeps its own gradient (``none``: a sync wrapper averages).
    local: ClassVar[bool] = False
    #: Fields that are step sizes: they shape no state, so a resumed run may change them
    #: (e.g. a smaller step after a non-finite stop).
    step_sizes: ClassVar[tuple[str, ...]] = ()

    def build(self, ctx: BuildContext) -> optax.GradientTransformation:
        """The transform over ``ctx.axis`` (its factory's errors name this aggregator)."""
        try:
            return self._build(ctx)
        except (TypeError, ValueError) as e:
            raise ValueError(f"aggregator {self.key!r}: {e}") from e

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        raise NotImplementedError

    def arguments(self) -> dict[str, Any]:
        """The factory's keyword arguments this config sets (every field)."""
        return {k: getattr(self, k) for k in type(self).model_fields}

    def error_fed_codec(self) -> tuple[jaxcomm.codecs.Codec, float] | None:
        """``(codec, decay)`` where this aggregator is a codec with error feedback whose
        payloads can be all-gathered (what replica groups exchange), else None."""
        return None

    @model_validator(mode="after")
    def _factory_accepts(self) -> Aggregator:
        self.build(BuildContext())  # the factory's own checks, at load time
        return self


AGGREGATORS: Registry[Aggregator] = Registry("aggregator", Aggregator)


class _Seeded(Aggregator):
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="the random stream's seed (unset: the run's seed)"
    )

    def arguments(self) -> dict[str, Any]:
        return {k: v for k, v in super().arguments().items() if k != "seed"}

    def _seed(self, ctx: BuildContext) -> int:
        return ctx.seed if self.seed is None else self.seed


@AGGREGATORS.register("none")
class Local(Aggregator):
    """Each worker keeps its own gradient: local SGD, DiLoCo (a ``sync`` averages the
    parameters at its scheduled steps)."""

    local: ClassVar[bool] = True

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return optax.identity()


class _Dense(Aggregator):
    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.dense_all_reduce(ctx.axis, reduce=self.key)


@AGGREGATORS.register("psum")
class Psum(_Dense):
    """Float32 mean by XLA's all-reduce (costed as a ring)."""


@AGGREGATORS.register("ring")
class Ring(_Dense):
    """Float32 mean by a ring all-reduce (reduce-scatter, then all-gather)."""


@AGGREGATORS.register("tree")
class Tree(_Dense):
    """Float32 mean by a binary-tree reduce and broadcast."""


@AGGREGATORS.register("ec_quantized")
class ECQuantized(Aggregator):
    """Error-compensated ``bits``-bit all-to-all reduce-scatter and all-gather
    (:func:`jaxcomm.ec_quantized_all_reduce`)."""

    bits: int = Field(4, ge=1, le=8, description="bits of each code")
    bucket_size: int = Field(512, ge=1, description="entries sharing one float32 scale")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.ec_quantized_all_reduce(ctx.axis, **self.arguments())

    def error_fed_codec(self) -> tuple[jaxcomm.codecs.Codec, float]:
        return jaxcomm.codecs.QuantizeCodec(self.bits, self.bucket_size, stochastic=False), 1.0


@AGGREGATORS.register("ar_topk")
class ARTopk(Aggregator):
    """AR-Topk: shared top-k indices of a root worker, values by an all-reduce
    (:func:`jaxcomm.ar_topk`; error-fed)."""

    ratio: Number | None = Field(
        None, gt=0, le=1, description="share of entries sent (unset only with ``adaptive``)"
    )
    select: Literal["star", "var"] = Field("star", description="round-robin or largest root")
    reduce: Literal["ring", "tree", "allgather", "auto"] = Field(
        "ring", description="the values' collective; ``auto``: the alpha-beta model's cheapest"
    )
    network: str | None = Field(
        None, description="the network ``auto`` chooses on (unset: the run's network at step 0)"
    )
    method: Literal["auto", "exact", "approx", "threshold", "sample"] = Field(
        "auto", description="how the top-k is selected (:func:`jaxcomm.codecs.topk_indices`)"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        args = self.arguments()
        args["ratio"] = 0.01 if self.ratio is None else self.ratio  # adaptive sets its own
        args["network"] = Network.parse(self.network) if self.network else ctx.network
        if self.reduce != "auto":
            args["network"] = None
        return jaxcomm.ar_topk(ctx.axis, **args)


@AGGREGATORS.register("lw_topk")
class LWTopk(Aggregator):
    """Layer-wise top-k: each tensor's own top entries, all-gathered
    (:func:`jaxcomm.lw_topk`; error-fed)."""

    ratio: Number = Field(gt=0, le=1, description="share of each tensor's entries sent")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.lw_topk(ctx.axis, ratio=self.ratio)


@AGGREGATORS.register("ms_topk")
class MSTopk(Aggregator):
    """MSTopk: a threshold found by bisection, values and indices all-gathered
    (:func:`jaxcomm.ms_topk`; error-fed)."""

    ratio: Number = Field(gt=0, le=1, description="share of entries sent")
    rounds: int = Field(25, ge=1, description="bisection rounds of the threshold")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.ms_topk(ctx.axis, **self.arguments())


@AGGREGATORS.register("chunk_topk")
class ChunkTopk(Aggregator):
    """Top-``k`` of every ``chunk`` entries with quantized values, all-gathered
    (:func:`jaxcomm.chunk_topk`; SparseLoCo's compressor, error-fed)."""

    chunk: int = Field(4096, ge=2, description="entries per chunk")
    k: int = Field(64, ge=1, description="entries sent per chunk")
    bits: int | None = Field(2, ge=1, le=8, description="value bits (unset: float32)")
    decay: Number = Field(1.0, ge=0, le=1, description="error buffer decay each step")
    average: Literal["workers", "senders"] = Field(
        "workers", description="divide each entry by all workers or by those that sent it"
    )
    exchange: Literal["gather", "two_phase"] = Field(
        "gather", description="all-gather the payloads, or average segments and gather those"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.chunk_topk(ctx.axis, **self.arguments())

    def error_fed_codec(self) -> tuple[jaxcomm.codecs.Codec, float] | None:
        if self.average != "workers" or self.exchange != "gather":
            return None
        return jaxcomm.codecs.ChunkTopKCodec(self.chunk, self.k, self.bits), self.decay


@AGGREGATORS.register("statistical_quantized")
class StatisticalQuantized(Aggregator):
    """Error-fed ``bits``-bit statistical quantization, all-gathered
    (:func:`jaxcomm.statistical_quantized`; MuLoCo's compressor)."""

    bits: int = Field(2, ge=1, le=8, description="bits of each code")
    sigmas: Number = Field(6.0, gt=0, description="the codebook's range in standard deviations")
    decay: Number = Field(0.9, ge=0, le=1, description="error buffer decay each step")
    exchange: Literal["gather", "two_phase"] = Field(
        "gather", description="all-gather the payloads, or average segments and gather those"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.statistical_quantized(ctx.axis, **self.arguments())

    def error_fed_codec(self) -> tuple[jaxcomm.codecs.Codec, float] | None:
        if self.exchange != "gather":
            return None
        return jaxcomm.codecs.StatQuantizeCodec(self.bits, self.sigmas), self.decay


class CodecChoice(Choice):
    """A codec of :mod:`jaxcomm.codecs` by its name, with its settings as fields."""

    #: The library's codec class this config class stands for.
    codec_class: ClassVar[type] = type(None)

    def codec(self) -> jaxcomm.codecs.Codec:
        """The library codec these settings make."""
        return self.codec_class(**{k: getattr(self, k) for k in type(self).model_fields})

    @model_validator(mode="after")
    def _codec_accepts(self) -> CodecChoice:
        try:
            self.codec()
        except (TypeError, ValueError) as e:
            raise ValueError(f"codec {self.key!r}: {e}") from e
        return self


def codec_choice(codec_class: type, base: type[Choice]) -> type[Choice]:
    """A config class (subclass of ``base`` and :class:`CodecChoice`) for a library codec
    class: one field per setting of the dataclass, with its type, default and meaning, so a
    new codec needs no config code."""
    hints = typing.get_type_hints(codec_class)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(codec_class):
        if not f.metadata.get("config", True):
            continue
        default = ... if f.default is dataclasses.MISSING else f.default
        fields[f.name] = (hints[f.name], Field(default, description=f.metadata.get("doc", "")))
    bases = base if issubclass(base, CodecChoice) else (base, CodecChoice)
    name = codec_class.__name__.removesuffix("Codec") + base.__name__
    model = create_model(name, __base__=bases, __doc__=codec_class.__doc__, **fields)
    model.codec_class = codec_class
    return model


#: Every codec of :data:`jaxcomm.codecs.CODECS`, for a codec field of a config.
CODEC_CHOICES: Registry[CodecChoice] = Registry("codec", CodecChoice)
for _name, _cls in jaxcomm.codecs.CODECS.items():
    CODEC_CHOICES.register(_name)(codec_choice(_cls, CodecChoice))


@AGGREGATORS.register("error_fed")
class ErrorFed(_Seeded):
    """Any codec of :mod:`jaxcomm.codecs` with error feedback, all-gathered or in two
    phases (:func:`jaxcomm.error_fed`)."""

    codec: CODEC_CHOICES.annotation = Field(description="the codec (name and its settings)")
    exchange: Literal["gather", "two_phase"] = Field(
        "gather", description="all-gather the payloads, or average segments and gather those"
    )
    decay: Number = Field(1.0, ge=0, le=1, description="error buffer decay each step")
    average: Literal["workers", "senders"] = Field(
        "workers", description="divide each entry by all workers or by those that sent it"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        seed = ctx.seed if self.seed is None else self.seed
        args = {k: v for k, v in self.arguments().items() if k != "codec"}
        return jaxcomm.error_fed(self.codec.codec(), ctx.axis, seed=seed, **args)

    def error_fed_codec(self) -> tuple[jaxcomm.codecs.Codec, float] | None:
        codec = self.codec.codec()
        if self.average != "workers" or codec.needs_matrix or self.exchange != "gather":
            return None
        return codec, self.decay


@AGGREGATORS.register("powersgd")
class PowerSGD(Aggregator):
    """PowerSGD: rank-``rank`` factors of each gradient matrix by one warm-started power
    iteration, two float32 all-reduces (:func:`jaxcomm.powersgd`; error-fed)."""

    rank: int = Field(4, ge=1, description="columns of the factors")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="draws the first Q of every matrix")
    reduce: Literal["ring", "tree", "psum"] = Field("ring", description="both all-reduces")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.powersgd(ctx.axis, **self.arguments())


@AGGREGATORS.register("demo")
class DeMo(Aggregator):
    """DeMo: each worker's own momentum, its top-``k`` DCT coefficients of every block
    all-gathered, a sign step; a whole optimizer (:func:`jaxcomm.demo`)."""

    whole_optimizer: ClassVar[bool] = True
    schedulable: ClassVar[bool] = True  # its momentum holds gradients, not applied steps
    step_sizes: ClassVar[tuple[str, ...]] = ("lr", "beta", "weight_decay")
    lr: Number = Field(gt=0, description="step size")
    beta: Number = Field(0.999, ge=0, lt=1, description="momentum decay each step")
    chunk: int = Field(
        64, ge=2, description="longest block side (each dimension's largest divisor up to it)"
    )
    k: int = Field(32, ge=1, description="DCT coefficients sent per block (at most chunk)")
    sign: bool = Field(True, description="step by the sign of the averaged components")
    weight_decay: Number = Field(0.0, ge=0, description="decoupled weight decay (times lr)")
    average: Literal["senders", "workers"] = Field(
        "senders", description="divide each coefficient by the workers that sent it or by all"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.demo(ctx.axis, **self.arguments())


@AGGREGATORS.register("marsit")
class Marsit(_Seeded):
    """Marsit: one-bit ring all-reduce with the unbiased bit-wise merge, a whole optimizer
    (:func:`jaxcomm.marsit`)."""

    whole_optimizer: ClassVar[bool] = True
    step_sizes: ClassVar[tuple[str, ...]] = ("local_lr", "global_lr")
    local_lr: Number = Field(description="scales the worker's gradient before compensation")
    global_lr: Number = Field(description="scales the merged signs of one-bit rounds")
    full_sync_every: int = Field(ge=1, description="steps between full-precision rounds")
    topology: Literal["ring"] = Field(
        "ring", description="the one-bit collective (the torus needs a two-axis mesh)"
    )

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.marsit(ctx.axis, **self.arguments(), seed=self._seed(ctx))


@AGGREGATORS.register("signsgd_mv")
class SignSGDMV(Aggregator):
    """signSGD with majority vote, a whole optimizer (:func:`jaxcomm.signsgd_mv`)."""

    whole_optimizer: ClassVar[bool] = True
    step_sizes: ClassVar[tuple[str, ...]] = ("lr",)
    lr: Number = Field(gt=0, description="step size")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.signsgd_mv(ctx.axis, lr=self.lr)


@AGGREGATORS.register("ef_signsgd")
class EFSignSGD(Aggregator):
    """Error-feedback signSGD, a whole optimizer (:func:`jaxcomm.ef_signsgd`)."""

    whole_optimizer: ClassVar[bool] = True
    step_sizes: ClassVar[tuple[str, ...]] = ("lr",)
    lr: Number = Field(gt=0, description="step size")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.ef_signsgd(ctx.axis, lr=self.lr)


@AGGREGATORS.register("ssdm")
class SSDM(_Seeded):
    """Stochastic sign descent with momentum, a whole optimizer (:func:`jaxcomm.ssdm`)."""

    whole_optimizer: ClassVar[bool] = True
    step_sizes: ClassVar[tuple[str, ...]] = ("lr", "momentum")
    lr: Number = Field(gt=0, description="step size")
    momentum: Number = Field(0.9, ge=0, lt=1, description="momentum of the signed direction")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.ssdm(ctx.axis, **self.arguments(), seed=self._seed(ctx))


@AGGREGATORS.register("cascading_sign")
class CascadingSign(_Seeded):
    """Cascading stochastic signs at every ring hop, a whole optimizer (the naive baseline
    the Marsit paper argues against; :func:`jaxcomm.cascading_sign`)."""

    whole_optimizer: ClassVar[bool] = True
    step_sizes: ClassVar[tuple[str, ...]] = ("lr",)
    lr: Number = Field(gt=0, description="step size")

    def _build(self, ctx: BuildContext) -> optax.GradientTransformation:
        return jaxcomm.cascading_sign(ctx.axis, lr=self.lr, seed=self._seed(ctx))
