"""The typed config: registries, the earlier flat keys, round trips and overrides."""

import json
import warnings

import pytest

from train.aggregators import AGGREGATORS, CODEC_CHOICES, Aggregator, BuildContext
from train.config import (
    BOUNDARIES,
    LEGACY_KEYS,
    MODELS,
    ROW_CODECS,
    SYNCS,
    Config,
    apply_overrides,
    load_config,
)

# Each earlier flat key with a value, and the same setting in the typed shape.
LEGACY = [
    ({"task": "mlp", "dataset": "digits"}, {"model": "mlp", "dataset": "digits"}),
    ({"lr": 1e-3}, {"optimizer": {"lr": 1e-3}}),
    ({"optimizer": "muon", "muon_lr": 0.01}, {"optimizer": {"name": "muon", "muon_lr": 0.01}}),
    ({"optimizer": "adamw", "weight_decay": 0.1}, {"optimizer": {"name": "adamw",
                                                                  "weight_decay": 0.1}}),
    ({"clip_norm": 1.0}, {"optimizer": {"clip_norm": 1.0}}),
    ({"lr_schedule": "cosine", "lr_warmup_steps": 5, "lr_warmup_from": 0.1, "lr_floor": 0.2,
      "lr_decay_steps": 50},
     {"optimizer": {"schedule": {"name": "cosine", "warmup_steps": 5, "warmup_from": 0.1,
                                 "floor": 0.2, "decay_steps": 50}}}),
    ({"aggregator": "ar_topk", "aggregator_args": {"ratio": 0.1, "select": "var"}},
     {"aggregator": {"name": "ar_topk", "ratio": 0.1, "select": "var"}}),
    ({"stages": 2, "workers": 4, "boundary": "aqsgd", "fw_bits": 3, "bw_bits": 6},
     {"stages": 2, "workers": 4, "boundary": {"name": "aqsgd", "forward": {"name": "quantize",
      "bits": 3}, "backward": {"name": "quantize", "bits": 6}}}),
    ({"stages": 2, "workers": 4, "boundary": "aqsgd", "buffer_bits": 8, "buffer_dir": "b",
      "boundary_args": {"fw_chunk": 64, "fw_k": 4, "bw_rank": 2, "first_bits": 4,
                        "bw_memory": True}},
     {"stages": 2, "workers": 4, "boundary": {
         "name": "aqsgd", "forward": {"name": "chunk_topk", "chunk": 64, "k": 4, "bits": 4},
         "backward": {"name": "lowrank", "rank": 2, "bits": 8},
         "first": {"name": "quantize", "bits": 4}, "memory": True, "buffer_bits": 8,
         "buffer_dir": "b"}}),
    ({"stages": 2, "workers": 4, "boundary": "fp32", "bw_bits": 0},
     {"stages": 2, "workers": 4, "boundary": {"name": "fp32", "backward": "fp32"}}),
]  # fmt: skip


@pytest.mark.parametrize("old, new", LEGACY)
def test_an_earlier_key_loads_as_its_new_spelling_with_a_warning(old, new):
    with pytest.warns(FutureWarning) as said:
        before = Config(**old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling says nothing
        after = Config(**new)
    assert before.to_dict() == after.to_dict()
    named = {str(w.message).split("'")[1] for w in said}
    assert named == set(old) & set(LEGACY_KEYS)
    for w in said:
        key = str(w.message).split("'")[1]
        assert LEGACY_KEYS[key] in str(w.message)


def test_every_config_survives_its_saved_form():
    """A run saves ``config.json`` (``to_dict``) and resumes from it: every shipped config
    and a config with every section set come back equal."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cfgs = [load_config(p) for p in sorted((root / "configs").glob("*.yaml"))]
    cfgs.append(
        Config(
            aggregator="none",
            optimizer={"name": "adamw", "lr": 1e-3, "schedule": "cosine", "clip_norm": 1.0},
            sync={"method": "diloco", "period": 4, "fragments": 2, "overlap": 1,
                  "compress": {"name": "sparseloco", "k": 8}},
        )
    )  # fmt: skip
    for cfg in cfgs:
        saved = json.loads(json.dumps(cfg.to_dict()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert Config(**saved) == cfg


def test_overrides_reach_any_depth_and_a_name_alone_takes_defaults():
    cfg = apply_overrides(
        Config(aggregator="none", sync={"method": "diloco", "period": 4}),
        ["sync.compress=sparseloco", "sync.compress.k=16", "optimizer.schedule.name=linear"],
    )
    assert (cfg.sync.compress.key, cfg.sync.compress.k, cfg.sync.compress.chunk) == (
        "chunk_topk", 16, 4096
    )  # fmt: skip
    assert cfg.optimizer.schedule.name == "linear"
    # A choice named again starts from its defaults: its earlier fields do not carry over.
    cfg = apply_overrides(Config(aggregator={"name": "ar_topk", "ratio": 0.5}),
                          ["aggregator=lw_topk", "aggregator.ratio=0.2"])  # fmt: skip
    assert cfg.aggregator.to_dict() == {"name": "lw_topk", "ratio": 0.2}
    # The optimizer's fields are every optimizer's: a name alone changes the name only.
    cfg = apply_overrides(Config(optimizer={"name": "adam", "lr": 1e-4}), ["optimizer=sgd"])
    assert (cfg.optimizer.name, cfg.optimizer.lr) == ("sgd", 1e-4)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["aggregator=ar_topk", "aggregator.ratoi=0.1"], "unknown key 'ratoi'"),
        (["aggregator.ratio=0.1", "aggregator=ar_topk"], "would be lost; give 'aggregator="),
        (["aggregator={name: ar_topk, ratio: 0.1, selct: var}"], "did you mean 'select'"),
        (["aggregator={name: chunk_topk, chunk: 8, k: 0}"], "aggregator.k: input should be"),
        (["model={name: gpt, width: -1}"], "model.width: input should be greater"),
        (["model=mlp"], "dataset must be one of .* for model 'mlp'"),
        (["optimizer.lr=.inf"], "optimizer.lr: must be a finite number"),
        (["optimizer.lr=.nan"], "optimizer.lr: must be a finite number"),
        (["optimizer.lr=inf"], "optimizer.lr: input should be a valid number, got 'inf'"),
        (["workers=true"], "workers: input should be a valid integer"),
        (["boundary={name: directq, forward: {name: lowrank, rank: 2, bits: 4}}"],
         "directq quantizes each token"),
        (["boundary={name: aqsgd, forward: {name: chunk_topk, chunk: 4, k: 8}}"],
         "k must be at most chunk=4"),
        (["aggregator=none", "sync={method: diloco, period: 4, compress: marsit}"],
         "sync.compress.local_lr is required"),
        (["aggregator=none", "sync={method: diloco, period: 4, compress: {name: signsgd_mv, "
          "lr: 0.1}}"], "is a whole optimizer, not a compressor"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_in_one_line_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match) as refused:
        load_config(None, overrides)
    assert "\n" not in str(refused.value)


def test_every_registered_choice_loads_by_name_and_describes_its_fields():
    """Every choice of every registry: its class has a docstring (its --help line), its
    fields have descriptions, and its name alone (or with its required fields) loads."""
    required = {"lw_topk": {"ratio": 0.1}, "ms_topk": {"ratio": 0.1}, "ar_topk": {"ratio": 0.1},
                "marsit": {"local_lr": 0.1, "global_lr": 0.01, "full_sync_every": 2},
                "signsgd_mv": {"lr": 0.1}, "ef_signsgd": {"lr": 0.1}, "ssdm": {"lr": 0.1},
                "cascading_sign": {"lr": 0.1}, "quantize": {"bits": 4}, "demo": {"lr": 1e-3},
                "chunk_topk": {"chunk": 8, "k": 2}, "lowrank": {"rank": 2, "bits": 4},
                "diloco": {"period": 2}, "local_sgd": {"period": 2}, "enp": {"period": 2},
                "dreamddp": {"period": 2}, "topk": {"k": 2},
                "error_fed": {"codec": {"name": "chunk_topk", "chunk": 8, "k": 2}}}  # fmt: skip
    for registry in (AGGREGATORS, MODELS, SYNCS, BOUNDARIES, ROW_CODECS, CODEC_CHOICES):
        for name, cls in registry:
            assert cls.summary(), name
            for field, info in cls.model_fields.items():
                assert info.description, f"{name}.{field}"
            data = {registry.field: name, **required.get(name, {})}
            made = registry.parse(data)
            assert type(made) is cls and made.key == name
    # Every aggregator builds its transform from its fields alone.
    for name, _ in AGGREGATORS:
        made = AGGREGATORS.parse({"name": name, **required.get(name, {})})
        tx = made.build(BuildContext())
        assert callable(tx.init) and callable(tx.update), name
    assert issubclass(AGGREGATORS["ring"], Aggregator)
