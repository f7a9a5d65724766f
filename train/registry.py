"""Typed config sections and the registries of choosable parts.

A config is made of frozen, typed sections (pydantic models with ``extra="forbid"``). A
choosable part (an aggregator, a synchronisation, a boundary codec, a model) is one
registered section class per choice, named by its ``name`` (or ``method``) key; a YAML
value ``aggregator: ring`` is the choice with its defaults, ``aggregator: {name: ar_topk,
ratio: 0.01}`` sets its fields. Adding a choice is one class::

    @AGGREGATORS.register("my_agg")
    class MyAgg(Aggregator):
        \"\"\"What it does (the first line is its ``--help`` entry).\"\"\"

        ratio: Number = Field(0.1, description="share of entries sent")

        def build(self, ctx):
            return mylib.my_agg(ctx.axis, ratio=self.ratio)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    SerializeAsAny,
    ValidationError,
    model_serializer,
    model_validator,
)

from jaxcomm._src._checks import did_you_mean

__all__ = [
    "Section",
    "Choice",
    "Registry",
    "Number",
    "Numbers",
    "Ints",
    "Mapping",
    "first_error",
    "number",
]

# A number as people write it; YAML 1.1 reads 1e-3 and 1e30 (no dot) as strings.
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def number(value: Any) -> Any:
    """``value`` as a float when it is a number as people write it (``1e-3``, ``3``); other
    values unchanged (the field's type check names them). Infinity and NaN are refused."""
    if isinstance(value, str) and _NUMBER.match(value):
        value = float(value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _numbers_inside(value: Any) -> Any:
    """Text that is a number as people write it (``1e-3``) as floats, through mappings and
    lists (a free-form mapping's values: adaptive candidates, straggler settings)."""
    if isinstance(value, str) and _NUMBER.match(value) and not value.strip().isdigit():
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers_inside(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_inside(v) for v in value]
    return value


#: A free-form mapping (checked by the class it configures), numbers read as written.
Mapping = Annotated[dict, BeforeValidator(_numbers_inside)]
#: A float field that also takes ``1e-3`` written in YAML (read as text) and integers.
Number = Annotated[float, BeforeValidator(number)]
#: A tuple of numbers, given as a YAML list.
Numbers = Annotated[tuple[Number, ...], BeforeValidator(_tuple)]
#: A tuple of integers, given as a YAML list.
Ints = Annotated[tuple[int, ...], BeforeValidator(_tuple)]


class Section(BaseModel):
    """A frozen, typed part of a config: unknown keys are errors; integers, booleans and
    text are not converted into each other (``workers: "8"`` is refused, ``lr: 1e-3`` is
    a number)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = list(cls.model_fields)
            unknown = sorted(set(data) - set(known) - {getattr(cls, "key_field", "")})
            if unknown:
                raise cls.unknown_key(unknown[0])
        return data

    @classmethod
    def unknown_key(cls, key: str) -> ValueError:
        """The error for a key this section does not have."""
        known = list(cls.model_fields)
        return ValueError(f"unknown key {key!r}{did_you_mean(key, known)}; known: {known}")

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (YAML/JSON), every field written out."""
        return self.model_dump(mode="json")


class Choice(Section):
    """A registered choice of a :class:`Registry` (its ``name`` key is the registry's)."""

    #: The registry key the choice was registered under (set by :meth:`Registry.register`)
    #: and the name of the field that holds it in a config (``name`` or ``method``).
    key: ClassVar[str] = ""
    key_field: ClassVar[str] = "name"

    @model_serializer(mode="wrap")
    def _with_key(self, handler: Any) -> dict[str, Any]:
        return {self.key_field: self.key, **handler(self)}

    @classmethod
    def summary(cls) -> str:
        """The first sentence of the class docstring (its ``--help`` entry)."""
        text = " ".join((cls.__doc__ or "").split())
        return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


C = TypeVar("C", bound=Choice)


class Registry(Generic[C]):
    """Named :class:`Choice` classes of one kind, keyed by ``field`` (``name``, or
    ``method`` for synchronisations).

    ``annotation`` is the type of a config field holding one of them: a name alone
    (``"ring"``), a mapping with the key and the choice's fields, or an instance.
    """

    def __init__(self, kind: str, base: type[C], field: str = "name", default: str = ""):
        self.kind, self.base, self.field, self.default = kind, base, field, default
        self._classes: dict[str, type[C]] = {}

    def register(self, name: str):
        """Class decorator: register a subclass of the registry's base under ``name``."""

        def deco(cls: type[C]) -> type[C]:
            if not issubclass(cls, self.base):
                raise TypeError(f"{cls.__name__} must subclass {self.base.__name__}")
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            cls.key, cls.key_field = name, self.field
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._classes)

    def __iter__(self) -> Iterator[tuple[str, type[C]]]:
        return iter(self._classes.items())

    def __getitem__(self, name: str) -> type[C]:
        if name not in self._classes:
            raise ValueError(
                f"{self.kind} must be one of {list(self._classes)}, got {name!r}"
                + did_you_mean(name, self._classes)
            )
        return self._classes[name]

    def parse(self, value: Any) -> Any:
        """An instance of the choice ``value`` names (see the class docstring)."""
        if isinstance(value, self.base):
            return value
        if isinstance(value, str):
            return self[value]()
        if isinstance(value, dict):
            if self.field not in value and self.default:
                value = {self.field: self.default, **value}
            if self.field not in value:
                raise ValueError(
                    f"{self.kind} {value!r} needs {self.field}: one of {list(self._classes)}"
                )
            fields = {k: v for k, v in value.items() if k != self.field}
            return self[value[self.field]].model_validate(fields)
        raise ValueError(
            f"{self.kind} must be a name (one of {list(self._classes)}) or a mapping with "
            f"{self.field}, got {value!r}"
        )

    @property
    def annotation(self) -> Any:
        """The field type: any registered choice, written out with its key."""
        return Annotated[SerializeAsAny[self.base], BeforeValidator(self.parse)]


def first_error(e: ValidationError, prefix: str = "") -> str:
    """One line for the first error of a validation: where, what is wrong, what was given."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    where = ".".join(x for x in (prefix, *loc) if x)
    kind, msg = err["type"], err["msg"]
    if kind == "missing":
        return f"{where} is required"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"{where}: {msg}" if where and not msg.startswith(where) else msg
    given = err.get("input")
    hint = ""
    if kind == "literal_error":
        allowed = [
            a.strip().strip("'") for a in err["ctx"]["expected"].replace(" or ", ",").split(",")
        ]
        hint = did_you_mean(given, [a for a in allowed if a])
    return f"{where}: {msg[0].lower() + msg[1:]}, got {given!r}{hint}"
