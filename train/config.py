"""Experiment configuration: one YAML file per experiment, overridable from the command line.

A config is a frozen :class:`Config`. Files and ``--set key=value`` overrides may only name
fields that exist (``model.width=64`` reaches into the ``model`` mapping); values are parsed
as YAML and must have the field's type. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from jaxcomm._checks import check_choice, did_you_mean

__all__ = ["Config", "load_config", "apply_overrides"]

TASKS = ("gpt", "mlp", "cnn")
DATASETS = {
    "gpt": ("shakespeare", "shakespeare_complete"),
    "mlp": ("digits",),
    "cnn": ("digits", "synthetic_imagenet"),
}
OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw", "muon")
LR_SCHEDULES = ("constant", "cosine", "linear")
DENSE_AGGREGATORS = ("psum", "ring", "tree")
# Gradient aggregators followed by an optimizer.
# Top-k sparsifiers (error-fed), also followed by an optimizer.
TOPK_AGGREGATORS = ("ar_topk", "lw_topk", "ms_topk")
# "none": each worker keeps its own gradient (local SGD; needs ``sync``).
GRADIENT_AGGREGATORS = (*DENSE_AGGREGATORS, "ec_quantized", *TOPK_AGGREGATORS, "none")
# Sync wrappers around the optimizer (``sync: {method: ...}``).
SYNC_METHODS = ("local_sgd", "enp", "dreamddp", "diloco")
SYNC_KEYS = ("method", "period", "fill_bubbles", "reduce", "fused")
# DiLoCo's own keys (``sync: {method: diloco, ...}``) and how its pseudo-gradients travel.
DILOCO_KEYS = (
    "outer_lr",
    "outer_momentum",
    "fragments",
    "pattern",
    "overlap",
    "alpha",
    "compress",
    "warmup_steps",
)
DILOCO_COMPRESS = ("none", "int8", "int4", "sparseloco", "ar_topk", "statistical")
# ``boundary_args`` of ``boundary: aqsgd``: the codec of each direction and of first visits.
BOUNDARY_KEYS = (
    "fw_chunk", "fw_k", "fw_bucket", "fw_rank",
    "bw_chunk", "bw_k", "bw_bucket", "bw_rank",
    "first_bits", "bw_memory",
)  # fmt: skip
# Aggregators that are the whole optimizer (they apply their own step sizes).
OPTIMIZING_AGGREGATORS = ("marsit", "signsgd_mv", "ef_signsgd", "ssdm", "cascading_sign")
AGGREGATORS = GRADIENT_AGGREGATORS + OPTIMIZING_AGGREGATORS


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one training run needs.

    Attributes:
      name: run name, one folder name (no ``/``, not ``.`` or ``..``); ``out_dir``
        defaults to ``runs/<name>``.
      task: model family, one of ``gpt``, ``mlp``, ``cnn``.
      model: keyword arguments of the model (e.g. ``num_layers``, ``width`` for ``gpt``).
      dataset: ``shakespeare`` (byte-level text, for ``gpt``), ``shakespeare_complete``
        (the complete works, four times as much text, with a held-out test split; for
        ``gpt``), ``digits`` (8x8 images) or
        ``synthetic_imagenet`` (random 224x224x3 images, 1000 classes, for ``cnn``: costing
        at ImageNet's shapes).
      workers: data-parallel workers (devices on the ``data`` mesh axis).
      global_batch: samples per step over all workers (a multiple of ``workers``).
      steps: optimizer steps to run (the final step count, also when resuming).
      seed: seeds parameter init and the data order (an integer in [0, 2**32 - 1]).
      optimizer: ``sgd``, ``momentum``, ``adam``, ``adamw`` or ``muon`` after a dense
        aggregator; ``none`` with an aggregator that is the whole optimizer; ``lr`` its
        learning rate (the peak of ``lr_schedule``). ``muon`` is ``optax.contrib.muon``:
        Muon (momentum 0.95 without Nesterov's look-ahead, as the MuLoCo authors' code;
        five Newton-Schulz steps, shape-scaled) on the 2-D weight matrices of the hidden
        layers at ``muon_lr``, AdamW at ``lr`` on the rest (embeddings, the output head,
        biases, norms), as the Muon and MuLoCo setups; ``stages: 1`` only.
      muon_lr: Muon's learning rate with ``optimizer: muon`` (its peak; it follows
        ``lr_schedule`` as ``lr`` does).
      lr_schedule: the learning rate over the optimizer's steps: ``constant`` (``lr``
        throughout, after any warm-up), ``cosine`` or ``linear`` (after the warm-up, a
        decay from ``lr`` to ``lr_floor * lr`` over ``lr_decay_steps``, then the floor).
        The step is the optimizer's own update count, so a resumed run continues the
        schedule where it stopped. Not with ``optimizer: none`` (an aggregator that is the
        whole optimizer applies the step sizes of its own arguments).
      lr_warmup_steps: optimizer steps of linear warm-up from ``lr_warmup_from * lr`` to
        ``lr`` (0: none).
      lr_warmup_from: the warm-up's first learning rate as a fraction of ``lr``, in [0, 1].
      lr_floor: the learning rate at the end of a ``cosine`` or ``linear`` decay as a
        fraction of ``lr``, in [0, 1].
      lr_decay_steps: steps of the decay after the warm-up (0: to the run's final step,
        ``steps - 1 - lr_warmup_steps``, so the last step runs at the floor).
      weight_decay: ``adamw``'s decoupled weight decay (scaled by the scheduled learning
        rate, as ``optax.adamw``; unset: optax's 1e-4); with ``sgd`` or ``momentum`` added
        to the gradient as ``optax.add_decayed_weights`` (SGD's classic weight decay,
        through the momentum); refused with ``adam`` (use ``adamw``) and ``none``.
      clip_norm: clip the gradient to this global L2 norm before the optimizer (0: off):
        after the aggregator, so on the averaged gradient; with a ``sync`` wrapper (local
        SGD, DiLoCo) on each worker's own gradient, which is what its inner optimizer
        steps on (the averaged one during DiLoCo's ``warmup_steps``). Not with
        ``optimizer: none`` nor ``stages > 1`` (each stage would clip its own layers).
      aggregator: gradient aggregation: ``psum``, ``ring`` or ``tree`` (dense),
        ``ec_quantized`` (error-compensated ``bits``-bit, default 4) or the top-k
        sparsifiers ``ar_topk`` (``{ratio, select: star|var, reduce:
        ring|tree|allgather|auto}``; ``auto`` chooses on the network of step 0 unless
        ``network`` is given), ``lw_topk`` and ``ms_topk`` (``{ratio}``), each followed by
        ``optimizer``; ``none`` (each worker steps on its own gradient: local SGD, with
        ``sync``); or ``marsit``, ``signsgd_mv``, ``ef_signsgd``, ``ssdm``,
        ``cascading_sign`` (each a complete optimizer with its own step sizes in
        ``aggregator_args``, so ``optimizer`` must be ``none``); ``aggregator_args`` are the
        factory's keyword arguments (e.g. ``{local_lr: 0.1, global_lr: 0.001,
        full_sync_every: 10}`` for ``marsit``).
      network: network schedule, e.g. ``"1ms,1Gbps"`` or ``"0:1ms,10Gbps;100:50ms,1Gbps"``,
        or ``c1`` / ``c2``: the AR-Topk paper's changing networks scaled to ``steps``
        (:meth:`jaxcomm.NetworkSchedule.preset`).
      overlap: model communication as hidden behind compute (``max``) instead of added.
      compute: what a step's compute time is: ``measured`` (this host's time for the
        step) or a device of :data:`jaxcomm.DEVICES`, optionally with the matrix dtype
        (``v100``, ``a100:tf32``): the roofline of the compiled step's flops and memory
        bytes (:func:`jaxcomm.program_cost`), so the simulated time depends on the config
        alone. ``mfu`` (unset: the device's calibrated value, else 0.5) and
        ``memory_efficiency`` are the roofline's shares of peak.
      stragglers: deterministic stragglers and latency jitter in the simulated clock, the
        keyword arguments of :class:`jaxcomm.network.Stragglers` (``seed``,
        ``compute_sigma``, ``slow: {worker: multiplier}``, ``latency_jitter``); ``{}`` for
        none. The slowest device's compute decides when the step's collectives start.
      eval_every: steps between validation passes (0: only at the end); ``eval_batches``
        batches each.
      checkpoint_every: steps between Orbax checkpoints (0: only at the end);
        ``keep_checkpoints`` newest kept.
      out_dir: where metrics, plots and checkpoints go ("" means ``runs/<name>``).
      progress: show a progress bar (false: a plain line every 30 seconds instead).
      async_steps: dispatch step ``t + 1`` before reading step ``t``'s metrics on the host
        (read one step late; a checkpoint or evaluation step is read before the next is
        dispatched). ``false`` waits for every step. Trainers whose host work feeds the
        next step (the pipeline's message buffers, the adaptive ratio's controller) always
        wait.
      train_samples: train on the first N samples only (0: all), e.g. to fine-tune over
        several epochs of the same samples.
      stages: pipeline stages (``gpt`` only; 1 = pure data parallelism); the mesh is
        ``workers x stages`` devices.
      microbatches: GPipe microbatches per step per data replica.
      boundary: what crosses a stage boundary: ``fp32``, ``directq`` or ``aqsgd``;
        ``fw_bits``/``bw_bits`` the forward (activation or delta) and backward (activation
        gradient) bits; ``bw_bits: 0`` sends gradients in float32.
      boundary_args: ``boundary: aqsgd`` only, the codec of each direction (``{}``: the
        paper's, per-token stochastic quantization): ``fw_chunk`` and ``fw_k`` send each
        delta as chunk-wise top-``fw_k`` of ``fw_chunk`` entries with ``fw_bits``-bit values
        (:func:`jaxcomm.topk_rows`; the buffer keeps what is not sent), ``fw_rank`` as a
        rank-``fw_rank`` matrix with ``fw_bits``-bit factors (:func:`jaxcomm.lowrank_rows`),
        ``fw_bucket`` quantizes it in buckets of that many elements instead of one per
        token; ``bw_chunk``/``bw_k``/``bw_rank``/``bw_bucket`` the same for the activation
        gradient (values at ``bw_bits``, float32 when 0 for top-k; without ``bw_memory``
        nothing feeds back what top-k or a rank drops); ``bw_memory: true`` sends each
        gradient as a delta against a per-sample gradient memory (kept beside the message
        buffer, as large), so what the backward codec drops is sent at later visits (not
        in the paper);
        ``first_bits`` sends first visits quantized to that many bits instead of float32
        (a deviation from the paper).
      estimate: what ``python -m train.estimate`` reports beside the step at ``network``
        (training ignores it): ``networks``, more networks to estimate the same step on,
        and ``baseline``, config keys that make a second config estimated beside them (e.g.
        ``{boundary: fp32, network: "1ms,10Gbps"}``), with each one's speed relative to it.
      buffer_bits: AQ-SGD message buffer storage bits (0 = float32).
      buffer_dir: keep the message buffers as zarr under this folder ("" = in memory).
      sync: a sync wrapper around the optimizer (local SGD, needs ``aggregator: none``):
        ``{method, period, fill_bubbles, reduce, fused}``: ``method`` is ``local_sgd``
        (FLSGD: every layer averaged at the last step of each period), ``enp`` (partial
        local SGD, equal-number partition) or ``dreamddp`` (the DreamDDP schedule of the
        profiled per-layer backward and communication times on the network of step 0,
        bubbles filled unless ``fill_bubbles: false``); ``period`` is ``H``;
        ``fused: true`` (``local_sgd`` only) averages the whole model as one message after
        the whole backward instead of layer by layer; ``reduce``
        (``ring``, ``tree`` or ``psum``) averages each layer. The layers are timed on the
        ``compute`` device (the roofline of their backward prefixes), or on this host when
        ``compute`` is ``measured``. ``method: diloco`` runs :func:`jaxcomm.diloco` (see
        ``train/diloco.py``) with the keys ``outer_lr`` (0.7), ``outer_momentum`` (0.9,
        Nesterov), ``fragments`` (1), ``pattern`` (``strided``), ``overlap`` (0 inner
        steps), ``alpha`` (0.5 with overlap, else 0) and ``compress`` (``none``, ``int8``,
        ``int4``, ``sparseloco``, ``ar_topk`` or ``statistical``: MuLoCo's 2-bit, with
        ``optimizer: muon``; or a mapping with ``method`` and that codec's arguments),
        and ``warmup_steps`` (0): a data-parallel warm start, that many
        first steps averaging every step's gradients with a float32 all-reduce (``reduce``,
        ``ring`` by default) before DiLoCo's periods start from the model reached (the
        DiLoCo paper starts from a pre-trained model). ``{}`` for none. Layers are
        ``models.layer_groups`` of the parameters.
      adaptive: AR-Topk's adaptive compression ratio (``aggregator: ar_topk``): the keyword
        arguments of :class:`jaxcomm.adaptive.AdaptiveRatio` (``candidates``,
        ``trial_steps``, ``gain_threshold``, ``network_threshold``, ``min_interval``,
        ``objectives``, ``normalize``); ``{}`` for a fixed ``ratio``.
      init_params: start from the model parameters in this ``params.msgpack`` (every run
        writes one into its ``out_dir``) instead of a random init, e.g. to fine-tune a
        briefly pre-trained model; the architecture must match ("" = random init).
    """

    name: str = "default"
    task: str = "gpt"
    model: dict = dataclasses.field(default_factory=dict)
    dataset: str = "shakespeare"
    workers: int = 8
    global_batch: int = 32
    steps: int = 200
    seed: int = 0
    optimizer: str = "adam"
    lr: float = 3e-3
    muon_lr: float = 0.02
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_warmup_from: float = 0.0
    lr_floor: float = 0.1
    lr_decay_steps: int = 0
    weight_decay: float | None = None
    clip_norm: float = 0.0
    aggregator: str = "ring"
    aggregator_args: dict = dataclasses.field(default_factory=dict)
    network: str = "1ms,1Gbps"
    overlap: bool = False
    compute: str = "measured"
    mfu: float | None = None
    memory_efficiency: float = 0.8
    stragglers: dict = dataclasses.field(default_factory=dict)
    eval_every: int = 0
    eval_batches: int = 4
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    out_dir: str = ""
    progress: bool = True
    async_steps: bool = True
    train_samples: int = 0
    stages: int = 1
    microbatches: int = 4
    boundary: str = "fp32"
    fw_bits: int = 4
    bw_bits: int = 8
    boundary_args: dict = dataclasses.field(default_factory=dict)
    estimate: dict = dataclasses.field(default_factory=dict)
    buffer_bits: int = 0
    buffer_dir: str = ""
    init_params: str = ""
    adaptive: dict = dataclasses.field(default_factory=dict)
    sync: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("task", self.task, TASKS)
        _choice("dataset", self.dataset, DATASETS[self.task])
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("aggregator", self.aggregator, AGGREGATORS)
        for name in ("workers", "global_batch", "steps", "eval_batches", "keep_checkpoints"):
            _positive(name, getattr(self, name))
        for name in ("eval_every", "checkpoint_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed}")
        seed = self.aggregator_args.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(
                f"aggregator_args.seed must be an integer in [0, {MAX_SEED}], got {seed!r}"
            )
        _check_name(self.name)

        if self.global_batch % self.workers:
            raise ValueError(
                f"global_batch must be a multiple of workers={self.workers}, "
                f"got {self.global_batch}"
            )
        if (self.aggregator in OPTIMIZING_AGGREGATORS) != (self.optimizer == "none"):
            raise ValueError(
                f"aggregator={self.aggregator!r} with optimizer={self.optimizer!r}: "
                f"{', '.join(OPTIMIZING_AGGREGATORS)} apply their own step sizes and need "
                f"optimizer='none'; {', '.join(GRADIENT_AGGREGATORS)} need an optimizer"
            )
        if self.compute != "measured":
            self.roofline()  # a clear error for an unknown device, dtype or share
            _, _, dtype = self.compute.partition(":")
            if dtype not in ("", "fp32", "tf32"):
                raise ValueError(
                    f"compute={self.compute!r}: the models compute in float32, so their matrix "
                    f"products run at the fp32 (or, on A100/H100, tf32) peak, not {dtype!r}; "
                    "allowed dtypes: fp32, tf32"
                )
        elif self.mfu is not None:
            raise ValueError(f"mfu={self.mfu!r} needs compute=<device>, got compute='measured'")
        self.straggler_model()  # a clear error for bad straggler settings
        if self.adaptive:
            if self.sync:
                raise ValueError(
                    f"adaptive={self.adaptive!r} with sync={self.sync!r}: the adaptive ratio "
                    "tunes the top-k aggregator that runs every step, and local SGD runs no "
                    "aggregator (it averages parameters at scheduled steps); choose one"
                )
            if self.aggregator != "ar_topk":
                raise ValueError(
                    f"adaptive={self.adaptive!r} chooses AR-Topk's ratio and needs "
                    f"aggregator='ar_topk'; got aggregator={self.aggregator!r}"
                )
            self.adaptive_model()
        self.sync_settings()  # a clear error for bad sync settings
        if self.train_samples < 0:
            raise ValueError(f"train_samples must be >= 0, got {self.train_samples}")
        _positive("stages", self.stages)
        _positive("microbatches", self.microbatches)
        _choice("boundary", self.boundary, ("fp32", "directq", "aqsgd"))
        for name, lo in (("fw_bits", 1), ("bw_bits", 0), ("buffer_bits", 0)):
            value = getattr(self, name)
            if not lo <= value <= 8:
                raise ValueError(f"{name} must be an integer in [{lo}, 8], got {value}")
        self.boundary_codecs()  # a clear error for bad boundary_args
        self.estimate_baseline()  # and for a bad estimate
        if self.stages > 1:
            if self.task != "gpt":
                raise ValueError(f"stages={self.stages} needs task='gpt', got {self.task!r}")
            if self.global_batch % (self.workers * self.microbatches):
                raise ValueError(
                    f"global_batch must be a multiple of workers * microbatches = "
                    f"{self.workers * self.microbatches}, got {self.global_batch}"
                )
        if self.init_params and not Path(self.init_params).is_file():
            raise ValueError(f"init_params must name an existing file, got {self.init_params!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.muon_lr < math.inf:
            raise ValueError(f"muon_lr must be a finite number > 0, got {self.muon_lr!r}")
        self.optimizer_settings()  # a clear error for a bad schedule, decay or clip
        self.network_schedule()  # a clear error for a bad network
        blocked = next((p for p in (self.run_dir, *self.run_dir.parents) if p.is_file()), None)
        if blocked is not None:
            raise ValueError(
                f"out_dir {str(self.run_dir)!r} cannot be a folder: {str(blocked)!r} is a file; "
                "choose a folder for the run's outputs (--set out_dir=...)"
            )

    @property
    def run_dir(self) -> Path:
        """The output folder of this run."""
        return Path(self.out_dir or f"runs/{self.name}")

    def network_schedule(self):
        """The :class:`jaxcomm.NetworkSchedule` of ``network``."""
        from jaxcomm.network import NetworkSchedule

        if self.network.strip().lower() in ("c1", "c2"):
            return NetworkSchedule.preset(self.network.strip(), self.steps)
        return NetworkSchedule.parse(self.network)

    def estimate_baseline(self) -> Config | None:
        """The config ``estimate.baseline`` makes (None without one); checks ``estimate``."""
        est = self.estimate
        if not isinstance(est, dict):
            raise ValueError(f"estimate must be a mapping, got {est!r}")
        known = ["networks", "baseline"]
        unknown = sorted(set(est) - set(known))
        if unknown:
            raise ValueError(
                f"estimate: unknown keys {unknown}{did_you_mean(unknown[0], known)}; known: {known}"
            )
        nets = est.get("networks", [])
        if not isinstance(nets, list) or not all(isinstance(n, str) for n in nets):
            raise ValueError(f"estimate.networks must be a list of network strings, got {nets!r}")
        from jaxcomm.network import NetworkSchedule

        for n in nets:
            NetworkSchedule.parse(n)
        base = est.get("baseline")
        if base is None:
            return None
        if not isinstance(base, dict) or not base:
            raise ValueError(f"estimate.baseline must be a mapping of config keys, got {base!r}")
        bad = sorted(set(base) - set(_FIELDS) | ({"estimate"} & set(base)))
        if bad:
            raise _unknown(bad[0], [k for k in _FIELDS if k != "estimate"])
        return dataclasses.replace(self, **base, estimate={})

    def boundary_codecs(self) -> tuple[Any, Any, Any] | None:
        """``(forward, backward, first)`` :class:`jaxcomm.RowCodec` s of ``boundary_args``
        (``backward``/``first`` None: float32), or None when ``boundary_args`` is empty."""
        args = self.boundary_args
        if not args:
            return None
        if not isinstance(args, dict):
            raise ValueError(f"boundary_args must be a mapping, got {args!r}")
        if self.boundary != "aqsgd":
            raise ValueError(
                f"boundary_args={args!r} chooses the codecs of AQ-SGD's deltas and needs "
                f"boundary='aqsgd'; got boundary={self.boundary!r}"
            )
        unknown = sorted(set(args) - set(BOUNDARY_KEYS))
        if unknown:
            raise ValueError(
                f"boundary_args: unknown keys {unknown}{did_you_mean(unknown[0], BOUNDARY_KEYS)}; "
                f"known: {list(BOUNDARY_KEYS)}"
            )
        memory = args.get("bw_memory", False)
        if not isinstance(memory, bool):
            raise ValueError(f"boundary_args.bw_memory must be true or false, got {memory!r}")
        for key, value in args.items():
            if key != "bw_memory":
                _positive(f"boundary_args.{key}", value)
        import jaxcomm

        def side(prefix: str, bits: int) -> Any:
            chunk, k, bucket = (args.get(f"{prefix}_{n}") for n in ("chunk", "k", "bucket"))
            rank = args.get(f"{prefix}_rank")
            if rank is not None:
                if chunk is not None or k is not None or bucket is not None:
                    raise ValueError(
                        f"boundary_args: {prefix}_rank sends a low-rank code; it excludes "
                        f"{prefix}_chunk, {prefix}_k and {prefix}_bucket"
                    )
                if not bits:
                    raise ValueError(
                        f"boundary_args.{prefix}_rank={rank} needs {prefix}_bits >= 1 (the "
                        "factors' bits), got 0"
                    )
                return jaxcomm.lowrank_rows(rank, bits)
            if (chunk is None) != (k is None):
                raise ValueError(
                    f"boundary_args: {prefix}_chunk and {prefix}_k go together (chunk-wise "
                    f"top-k), got {prefix}_chunk={chunk!r} and {prefix}_k={k!r}"
                )
            if chunk is not None and bucket is not None:
                raise ValueError(
                    f"boundary_args: {prefix}_bucket quantizes every element and "
                    f"{prefix}_chunk/{prefix}_k sends a top-k; choose one"
                )
            if chunk is not None:
                if not 2 <= chunk or not k <= chunk:
                    raise ValueError(
                        f"boundary_args: need 2 <= {prefix}_chunk and {prefix}_k <= "
                        f"{prefix}_chunk, got {prefix}_chunk={chunk} and {prefix}_k={k}"
                    )
                return jaxcomm.topk_rows(chunk, k, bits or None)
            if not bits:
                if bucket is not None:
                    raise ValueError(
                        f"boundary_args.{prefix}_bucket={bucket} quantizes, but {prefix}_bits "
                        "is 0 (float32)"
                    )
                return None
            return jaxcomm.quantized_rows(bits, bucket)

        forward = side("fw", self.fw_bits)
        backward = side("bw", self.bw_bits)
        if memory and backward is None:
            raise ValueError(
                "boundary_args.bw_memory needs a compressed backward (bw_bits >= 1): a "
                "float32 gradient loses nothing that a memory could keep"
            )
        first = args.get("first_bits")
        if first is not None and first > 8:
            raise ValueError(f"boundary_args.first_bits must be in [1, 8], got {first}")
        return forward, backward, (jaxcomm.quantized_rows(first) if first else None)

    def adaptive_model(self):
        """The :class:`jaxcomm.adaptive.AdaptiveRatio` of ``adaptive`` (None when empty)."""
        if not self.adaptive:
            return None
        from jaxcomm.adaptive import AdaptiveRatio

        try:
            return AdaptiveRatio(**self.adaptive)
        except TypeError as e:
            raise ValueError(f"adaptive {self.adaptive!r}: {e}") from e

    def sync_settings(self) -> dict[str, Any]:
        """``sync`` with its defaults filled in, checked (``{}`` when there is none)."""
        if not self.sync:
            if self.aggregator == "none":
                raise ValueError(
                    "aggregator='none' (each worker keeps its own gradient) needs a sync "
                    "wrapper, e.g. sync={method: local_sgd, period: 5}; otherwise the "
                    "workers never agree"
                )
            return {}
        keys = SYNC_KEYS + (DILOCO_KEYS if self.sync.get("method") == "diloco" else ())
        unknown = sorted(set(self.sync) - set(keys))
        if unknown:
            raise ValueError(
                f"sync: unknown keys {unknown} for method={self.sync.get('method')!r}; "
                f"known: {list(keys)}{did_you_mean(unknown[0], keys)}"
            )
        out = {"fill_bubbles": True, "reduce": "ring", "fused": False, **self.sync}
        if "method" in out:
            _choice("sync.method", out["method"], SYNC_METHODS)
        if "method" not in out or "period" not in out:
            raise ValueError(f"sync={self.sync!r} needs method and period")
        _positive("sync.period", out["period"])
        if out["method"] == "diloco":
            out = _diloco_settings(out, self.sync)
        _choice("sync.reduce", out["reduce"], DENSE_AGGREGATORS)
        for key in ("fill_bubbles", "fused"):
            if not isinstance(out[key], bool):
                raise ValueError(f"sync.{key} must be true or false, got {out[key]!r}")
        if out["fused"] and out["method"] != "local_sgd":
            raise ValueError(
                f"sync.fused averages the whole model as one message, which only "
                f"method='local_sgd' does; got method={out['method']!r}"
            )
        if self.overlap and self.stages == 1 and out["method"] == "diloco":
            raise ValueError(
                "overlap=true with sync.method=diloco and stages=1: DiLoCo's clock hides a "
                "transfer behind sync.overlap inner steps (its own key); set overlap=false "
                "and sync.overlap to the inner steps a transfer may take"
            )
        if self.overlap and self.stages == 1:
            raise ValueError(
                "overlap=true with sync and stages=1: data-parallel local SGD follows "
                "DreamDDP's iteration timeline, whose averaging overlaps the backward pass by "
                "construction; set overlap=false"
            )
        if out["method"] == "diloco" and self.stragglers:
            raise ValueError(
                f"stragglers={self.stragglers!r} with sync.method=diloco: DiLoCo's clock does "
                "not model each worker's own pace between synchronisations (it would make "
                "every inner step wait for the slowest worker); use stragglers with "
                "local_sgd or dreamddp"
            )
        if self.stages != 1 and self.stragglers:
            raise ValueError(
                f"stragglers={self.stragglers!r} with sync={self.sync!r} and stages="
                f"{self.stages}: between averagings each pipeline replica would run at its own "
                "pace, which the pipeline's clock does not model (it would make every step "
                "wait for the slowest replica); use stragglers with sync on stages=1, or "
                "stragglers with a pipeline that aggregates every step"
            )
        if self.aggregator != "none":
            raise ValueError(
                f"sync={self.sync!r} needs aggregator='none' (each worker steps on its own "
                f"gradient; the sync wrapper averages parameters), got "
                f"aggregator={self.aggregator!r}"
            )
        if self.stages != 1 and out.get("fused"):
            raise ValueError(
                f"sync.fused=true with stages={self.stages}: a pipeline's parameter groups live "
                "on different devices and cannot travel as one message; leave fused out"
            )
        return out

    def lr_settings(self) -> dict[str, Any] | None:
        """The learning-rate schedule, resolved (``decay_steps`` counted), or None for a
        constant ``lr`` with no warm-up; checks the ``lr_*`` keys."""
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for key in ("lr_warmup_steps", "lr_decay_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {v!r}")
        for key in ("lr_warmup_from", "lr_floor"):
            v = getattr(self, key)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{key} must be a fraction of lr in [0, 1], got {v!r}")
        warmup, kind = self.lr_warmup_steps, self.lr_schedule
        if kind == "constant" and not warmup:
            return None
        out: dict[str, Any] = {"kind": kind, "warmup_steps": warmup}
        if warmup:
            out["warmup_from"] = self.lr_warmup_from
        if kind != "constant":
            decay = self.lr_decay_steps or self.steps - 1 - warmup
            if decay < 1:
                raise ValueError(
                    f"lr_schedule={kind!r} decays over the steps after the warm-up, but "
                    f"steps={self.steps} leaves none after lr_warmup_steps={warmup} (the "
                    f"last step is {self.steps - 1}); lower lr_warmup_steps or set "
                    "lr_decay_steps"
                )
            out.update(decay_steps=decay, floor=self.lr_floor)
        return out

    def optimizer_settings(self) -> dict[str, Any]:
        """The optimizer's settings beyond ``optimizer`` and ``lr`` that are not the
        defaults (a resumed run must match them): ``lr_schedule`` (:meth:`lr_settings`),
        ``weight_decay``, ``clip_norm``; checked against ``optimizer`` and ``stages``."""
        out: dict[str, Any] = {}
        schedule = self.lr_settings()
        if schedule is not None:
            out["lr_schedule"] = schedule
        wd, clip = self.weight_decay, self.clip_norm
        if wd is not None:
            if not 0.0 <= wd < math.inf:
                raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")
            out["weight_decay"] = wd
        if clip is not None and clip != 0:
            if not 0.0 < clip < math.inf:
                raise ValueError(f"clip_norm must be a finite number >= 0 (0: off), got {clip!r}")
            out["clip_norm"] = clip
        if self.optimizer == "none":
            for key, given in (
                ("lr_schedule", self.lr_schedule != "constant"),
                ("lr_warmup_steps", self.lr_warmup_steps != 0),
                ("weight_decay", wd is not None),
                ("clip_norm", "clip_norm" in out),
            ):
                if given:
                    raise ValueError(
                        f"{key}={getattr(self, key)!r} with aggregator={self.aggregator!r}: "
                        f"{self.aggregator} is the whole optimizer (optimizer='none') and "
                        "applies its own step sizes from aggregator_args; the trainer has no "
                        f"optimizer to give a {key} to; leave {key} unset"
                    )
        if self.optimizer == "muon":
            out["muon_lr"] = self.muon_lr
            if self.stages > 1:
                raise ValueError(
                    f"optimizer='muon' with stages={self.stages}: a pipeline stacks its "
                    "stages' layers, so a stage's weight matrices are not 2-D leaves; use "
                    "muon with stages=1"
                )
        elif self.muon_lr != Config.muon_lr:
            raise ValueError(
                f"muon_lr={self.muon_lr!r} with optimizer={self.optimizer!r}: muon_lr is "
                "Muon's learning rate; set optimizer='muon' or leave muon_lr unset"
            )
        if wd is not None and self.optimizer == "adam":
            raise ValueError(
                f"weight_decay={wd!r} with optimizer='adam': Adam's L2 penalty is not "
                "decoupled weight decay; use optimizer='adamw' (or leave weight_decay unset)"
            )
        if "clip_norm" in out and self.stages > 1:
            raise ValueError(
                f"clip_norm={clip!r} with stages={self.stages}: each pipeline stage steps its "
                "own layers, so the global norm of the gradient is not on any one device; "
                "clip with stages=1"
            )
        return out

    def roofline(self) -> Any:
        """The :class:`jaxcomm.Roofline` of ``compute`` (``None`` when ``measured``)."""
        return None if self.compute == "measured" else _roofline(self)

    def straggler_model(self) -> Any:
        """The :class:`jaxcomm.network.Stragglers` of ``stragglers`` (``None`` when empty)."""
        if not self.stragglers:
            return None
        from jaxcomm.network import Stragglers

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

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (for YAML/JSON)."""
        return dataclasses.asdict(self)


def _roofline(cfg: Config) -> Any:
    from jaxcomm.compute import roofline

    device, _, dtype = cfg.compute.partition(":")
    return roofline(device, dtype=dtype or "fp32", mfu=cfg.mfu, efficiency=cfg.memory_efficiency)


def _choice(name: str, value: Any, allowed: tuple) -> None:
    check_choice(name, value, allowed)


def key_docs() -> list[tuple[str, Any, str]]:
    """``(key, default, meaning)`` of every config key, the meaning read from
    :class:`Config`'s docstring (a key described inside another's entry points to it)."""
    doc = Config.__doc__ or ""
    body = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    entries: list[tuple[str, str]] = []
    for line in body.splitlines():
        m = re.match(r"^      (\w+): (.*)$", line)
        if m:
            entries.append((m.group(1), m.group(2).strip()))
        elif entries and line.strip():
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    own = dict(entries)
    out = []
    for f in dataclasses.fields(Config):
        text = own.get(f.name)
        if text is None:
            text = next((f"see ``{k}``" for k, t in entries if f"``{f.name}``" in t), "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f.name, default, text))
    return out


# The largest seed: NumPy's and JAX's generators take any value below it on every platform.
MAX_SEED = 2**32 - 1


def _check_name(name: Any) -> None:
    """A run name is one folder name: ``runs/<name>`` stays inside ``runs/``."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
        or len(name) > 255
    ):
        raise ValueError(
            f"name must be one folder name (no '/', not '.' or '..', at most 255 characters), "
            f"got {name!r}; to write the run elsewhere, set out_dir=<folder>"
        )


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _unknown(key: str, allowed: list[str]) -> ValueError:
    hint = did_you_mean(key, allowed)  # first: the list after it is long
    return ValueError(f"unknown config key {key!r}{hint} (allowed keys: {sorted(allowed)})")


# A number as people write it; YAML 1.1 reads 1e-3 and 1e30 (no dot) as strings.
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")
# float or None (mfu: None is the device's calibration or 0.5; weight_decay: the
# optimizer's own; clip_norm: off).
_OPTIONAL_FLOAT = ("mfu", "weight_decay", "clip_norm")


def _numbers(value: Any) -> Any:
    """Strings that are numbers as people write them (1e-3) as floats, inside mappings and
    lists too (aggregator arguments, adaptive candidates)."""
    if isinstance(value, str) and _NUMBER.match(value) and not value.strip().isdigit():
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _coerce(key: str, value: Any) -> Any:
    default = Config.__dataclass_fields__[key]
    if isinstance(value, (dict, list)):
        value = _numbers(value)
    kind = type(default.default) if default.default is not dataclasses.MISSING else dict
    if key in _OPTIONAL_FLOAT:
        if value is None:
            return None
        kind = float
    if kind is float and isinstance(value, str) and _NUMBER.match(value):
        return float(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"config key {key!r} must be of type {kind.__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def _merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in updates.items():
        if key not in _FIELDS:
            raise _unknown(key, list(_FIELDS))
        value = _coerce(key, value)
        out[key] = value
    return out


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``key=value`` strings (``a.b=value`` reaches into mapping fields) to ``cfg``."""
    data = cfg.to_dict()
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
        head, _, rest = key.strip().partition(".")
        if head not in _FIELDS:
            raise _unknown(head, list(_FIELDS))
        if rest:
            if not isinstance(data[head], dict):
                raise ValueError(f"config key {head!r} is not a mapping; cannot set {key!r}")
            data = _merge(data, {head: {**data[head], rest: value}})
        else:
            data = _merge(data, {head: value})
    return Config(**data)


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


# The configs shipped beside the package (a source checkout or an editable install).
_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def resume_command(run_dir: str | Path, launcher: str | None = None) -> str:
    """The command that continues the run in ``run_dir`` (shell-quoted), for messages: by
    ``launcher``, else ``python -m train``, or ``python -m train.launch --processes N`` in a
    process that ``train.launch`` started."""
    import os
    import shlex

    from train.distributed import ENV_LAUNCHED

    if launcher is None:
        n = os.environ.get(ENV_LAUNCHED)
        launcher = f"python -m train.launch --processes {n}" if n else "python -m train"
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
    return apply_overrides(Config(**_merge(Config().to_dict(), data)), list(overrides or []))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            shipped = sorted(q.name for q in _CONFIGS.glob("*.yaml")) if _CONFIGS.is_dir() else []
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
        data = _merge(Config().to_dict(), loaded)
    cfg = Config(**data) if data else Config()
    return apply_overrides(cfg, list(overrides or []))


def _diloco_settings(out: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``sync`` of ``method: diloco`` with its defaults (the DiLoCo paper's outer step:
    Nesterov SGD, lr 0.7, momentum 0.9; one fragment; no overlap; dense pseudo-gradients),
    checked; ``given`` is what the config set."""
    out = {
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "fragments": 1,
        "pattern": "strided",
        "overlap": 0,
        "alpha": None,
        "compress": "none",
        **out,
    }
    if out["fused"]:
        raise ValueError("sync.fused is local SGD's; DiLoCo sends each fragment as one message")
    if "fill_bubbles" in given:
        raise ValueError("sync.fill_bubbles is DreamDDP's; DiLoCo's fragments are not filled")
    warm = out.setdefault("warmup_steps", 0)
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        raise ValueError(
            f"sync.warmup_steps must be an integer >= 0 (data-parallel steps before DiLoCo's "
            f"first period), got {warm!r}"
        )
    for key in ("outer_lr", "outer_momentum"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ValueError(f"sync.{key} must be a finite number >= 0, got {v!r}")
    if out["outer_lr"] == 0:
        raise ValueError("sync.outer_lr must be > 0 (0 would never move the model), got 0")
    if out["outer_momentum"] >= 1:
        raise ValueError(f"sync.outer_momentum must be in [0, 1), got {out['outer_momentum']!r}")
    _positive("sync.fragments", out["fragments"])
    _choice("sync.pattern", out["pattern"], ("strided", "sequential"))
    ov = out["overlap"]
    if isinstance(ov, bool) or not isinstance(ov, int) or not 0 <= ov < out["period"]:
        raise ValueError(
            f"sync.overlap must be an integer in [0, period - 1] = [0, {out['period'] - 1}] "
            f"(inner steps a fragment's pseudo-gradient travels), got {ov!r}"
        )
    a = out["alpha"]
    if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < 1):
        raise ValueError(f"sync.alpha must be a number in [0, 1), got {a!r}")
    comp = out["compress"]
    method = comp.get("method") if isinstance(comp, dict) else comp
    if isinstance(comp, dict) and "method" not in comp:
        raise ValueError(f"sync.compress={comp!r} needs method: one of {list(DILOCO_COMPRESS)}")
    _choice("sync.compress", method, DILOCO_COMPRESS)
    if isinstance(comp, dict):
        fixed = {"none": set(comp) - {"method"}, "int8": {"bits"} & set(comp)}
        fixed["int4"] = fixed["int8"]
        if fixed.get(method):
            raise ValueError(
                f"sync.compress={comp!r}: {method!r} sets {sorted(fixed[method])} itself "
                "(int8 and int4 name their bits; none takes no arguments)"
            )
    if method != "none" and "reduce" in given:
        raise ValueError(
            f"sync.reduce applies to compress='none' (the float32 all-reduce); "
            f"compress={method!r} has its own collective"
        )
    return out
