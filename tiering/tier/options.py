"""Options records: typed settings declared once, read alike from YAML and from Python.

A record is a frozen, keyword-only, slotted dataclass whose fields are declared with `option`:
the default, the help line, and how a YAML value is read (its kind and bounds). Everything else
is produced from that one declaration: reading a mapping into the record (`TierOptions.of`,
`read_fields`), the configuration's JSON Schema and its documentation table (`Field.schema`,
`Field.type_text`, `Field.default_text`).

    @dataclass(frozen=True, kw_only=True, slots=True)
    class RedisOptions(TierOptions):
        url: str = option("redis://127.0.0.1:6379/0", help="The server, as redis-py reads it.",
                          low=1, what="a URL like 'redis://host:6379/0'")
        ttl: float | None = option(None, kind="duration", help="Blocks expire after this.")

    RedisOptions.of({"ttl": "1h"}).ttl == 3600.0

Kinds: `flag` (true or false, nothing else), `integer` (`low` to `high`), `number` (finite,
above `low`, at most `high`), `size` (bytes or '8GiB', up to `MAX_SIZE`), `duration` (seconds or
'200ms', up to `MAX_SECONDS`): both positive, or with `zero` also 0, `text` (a string of at least
`low` characters), `path` (a non-empty string or an `os.PathLike`, read as a string), `choice`
(one of `choices`: the names themselves, or "module:NAME" of a tuple of them, imported when first
used), `any` (taken as it is). Without `kind`, the annotation says it: `bool` a flag, `int` an
integer, `float` a number, `str` text (a choice when `choices` is given); `X | None` admits null.
Every value read is in the unit the code takes: sizes in bytes, durations in seconds, so reading
a value already read gives it back unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Self, Union

from tiering.errors import ConfigError
from tiering.secrets import redact_text, secrets_in
from tiering.tier.format import CHECKSUMS, CODECS
from tiering.units import (
    DURATION_PATTERN,
    MAX_COUNT,
    MAX_SECONDS,
    MAX_SIZE,
    SIZE_PATTERN,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
    short_repr,
)

__all__ = [
    "KINDS",
    "REQUIRED",
    "Field",
    "TierOptions",
    "fields_of",
    "option",
    "read_fields",
]

KINDS: Final = ("flag", "integer", "number", "size", "duration", "text", "path", "choice", "any")
METADATA: Final = "kvtier"
"""The key of a dataclass field's metadata under which `option` puts its `Field`."""


class _Required:
    """Any thread (a constant): the default of an option that has none."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final[Any] = _Required()


@dataclass(frozen=True, slots=True)
class Field:
    """Any thread (a frozen value): how one value is read (`read` returns it in the unit the
    code takes, or raises `ConfigError` naming it), described (`describe`, `type_text`),
    documented (`help`, `default_text`) and written in a JSON Schema (`schema`). See the module
    docstring for the kinds."""

    kind: str
    low: float = 0
    high: float = MAX_COUNT
    choices: tuple[str, ...] | str = ()
    optional: bool = False
    """`null` is a value (None)."""
    zero: bool = False
    """A size or a duration may be 0."""
    what: str = ""
    """What a message says is expected, instead of the kind's own words."""
    help: str = ""
    default: Any = REQUIRED
    """The value when the mapping does not give one; `REQUIRED`: it must."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TypeError(f"unknown option kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def names(self) -> tuple[str, ...]:
        """The names a `choice` takes."""
        if isinstance(self.choices, tuple):
            return self.choices
        module, _, name = self.choices.partition(":")
        return tuple(getattr(importlib.import_module(module), name))

    def read(self, value: object, where: str) -> Any:
        value = _plain_number(value)
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{where}: expected {self.describe()}, got null")
        kind = self.kind
        if kind == "size":
            return parse_size(value, where, 0 if self.zero else 1)
        if kind == "duration":
            seconds = parse_duration(value, where, allow_zero=self.zero)
            if self.low and 0 < seconds < self.low:
                raise ConfigError(f"{where}: at least {self.low:g}s, got {short_repr(value)}")
            return seconds
        if kind == "flag":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {short_repr(value)}")
            return value
        if kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int) or value < self.low:
                raise ConfigError(f"{where}: expected {self.describe()}, got {short_repr(value)}")
            if value > self.high:
                raise ConfigError(
                    f"{where}: expected {self.describe()} up to {int(self.high):,}, "
                    f"got {short_repr(value)}"
                )
            return value
        if kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where}: expected {self.describe()}, got {short_repr(value)}")
            number = math.inf if isinstance(value, int) and abs(value) > 2**63 else float(value)
            if not math.isfinite(number) or not self.low < number <= self.high:
                raise ConfigError(f"{where}: expected {self.describe()}, got {short_repr(value)}")
            return number
        if kind == "text":
            if not isinstance(value, str) or len(value) < self.low:
                raise ConfigError(f"{where}: expected {self.describe()}, got {short_repr(value)}")
            return value
        if kind == "path":
            text = os.fspath(value) if isinstance(value, os.PathLike) else value
            if not isinstance(text, str) or not text or "\0" in text:
                raise ConfigError(f"{where}: expected {self.describe()}, got {short_repr(value)}")
            return text
        if kind == "choice":
            names = self.names()
            if value not in names:
                raise ConfigError(
                    f"{where}: expected one of {', '.join(names)}, got {short_repr(value)}"
                )
            return value
        return value

    def describe(self) -> str:
        """What a message says is expected."""
        if self.what:
            return self.what
        if self.kind == "integer":
            return "a positive integer" if self.low == 1 else f"an integer >= {int(self.low)}"
        if self.kind == "number":
            return "a positive number" if self.low == 0 else "a finite number"
        if self.kind == "text":
            return "a non-empty string" if self.low else "a string"
        return {
            "size": "a size",
            "duration": "a duration",
            "flag": "true or false",
            "path": "a path",
        }.get(self.kind, "a value")

    def type_text(self) -> str:
        """The value's type as a documentation table shows it."""
        if self.kind == "choice":
            text = " \\| ".join(f"`{name}`" for name in self.names())
        elif self.kind == "integer":
            text = f"integer {int(self.low)}..{int(self.high):,}"
        elif self.kind in ("size", "duration"):
            text = self.kind + (" (0 allowed)" if self.zero else "")
            if self.kind == "duration" and self.low:
                text += f", at least {self.low:g}s"
        elif self.kind == "number":
            text = "number > 0" if self.low == 0 else "number"
        else:
            text = {"flag": "true \\| false", "text": "string", "path": "path"}.get(
                self.kind, "any"
            )
        return text + (" \\| null" if self.optional else "")

    def default_text(self) -> str:
        """The default as a documentation table shows it (empty for a required option)."""
        default = self.default
        if default is REQUIRED:
            return "(required)"
        if default is None:
            return "null"
        if self.kind == "size" and isinstance(default, int):
            return f"`{format_size(default)}`"
        if self.kind == "duration" and isinstance(default, int | float):
            return f"`{format_duration(default)}`"
        if isinstance(default, bool):
            return f"`{str(default).lower()}`"
        if isinstance(default, str):
            return f"`{default}`" if default else '`""`'
        return f"`{default!r}`"

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of a value (what `read` accepts)."""
        schema: dict[str, Any]
        if self.kind == "size":
            schema = {
                "oneOf": [
                    {"type": "integer", "minimum": 0 if self.zero else 1, "maximum": MAX_SIZE},
                    {"type": "string", "pattern": rf"^\s*{SIZE_PATTERN}\s*$"},
                ]
            }
        elif self.kind == "duration":
            bound = "minimum" if self.zero else "exclusiveMinimum"
            schema = {
                "oneOf": [
                    {"type": "number", bound: 0, "maximum": MAX_SECONDS},
                    {"type": "string", "pattern": rf"^\s*{DURATION_PATTERN}\s*$"},
                ]
            }
        elif self.kind == "flag":
            schema = {"type": "boolean"}
        elif self.kind == "integer":
            schema = {"type": "integer", "minimum": int(self.low), "maximum": int(self.high)}
        elif self.kind == "number":
            schema = {"type": "number"}
            if math.isfinite(self.low):
                schema["exclusiveMinimum"] = self.low
            if math.isfinite(self.high):
                schema["maximum"] = self.high
        elif self.kind == "text":
            schema = {"type": "string"} | ({"minLength": int(self.low)} if self.low else {})
        elif self.kind == "path":
            schema = {"type": "string", "minLength": 1}
        elif self.kind == "choice":
            schema = {"enum": list(self.names())}
        else:
            schema = {}
        if self.help:
            schema = {"description": self.help} | schema
        if self.optional and schema:
            return {"anyOf": [schema, {"type": "null"}]}
        return schema


def option(
    default: Any = REQUIRED,
    *,
    help: str,
    kind: str | None = None,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] | str | None = None,
    what: str | None = None,
    optional: bool = False,
    zero: bool = False,
    repr: bool = True,
) -> Any:
    """A field of an options record (or of a configuration section): its `default` (none:
    `REQUIRED`), its one-line `help`, and how a value is read (see the module docstring). Its
    `Field` is completed from the annotation by `fields_of`. `default` is the value in the unit
    the code takes (bytes, seconds); only immutable defaults (None, numbers, strings, tuples).
    `repr=False` keeps the value out of the record's repr (a secret)."""
    if isinstance(default, list | dict | set):
        raise TypeError(f"option default {default!r} is mutable: give a tuple or None")
    spec: dict[str, Any] = {"help": help, "optional": optional, "zero": zero, "default": default}
    if kind is not None:
        spec["kind"] = kind
    if low is not None:
        spec["low"] = low
    if high is not None:
        spec["high"] = high
    if choices is not None:
        spec["choices"] = choices
    if what is not None:
        spec["what"] = what
    metadata = {METADATA: spec}
    if default is REQUIRED:
        return dataclasses.field(metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


_BY_TYPE: Final[dict[type, str]] = {bool: "flag", int: "integer", float: "number", str: "text"}


def _from_annotation(record: type, name: str, hint: object, spec: dict[str, Any]) -> Field:
    union = typing.get_origin(hint) in (Union, types.UnionType)
    args = list(typing.get_args(hint)) if union else [hint]
    nullable = type(None) in args
    plain = [a for a in args if a is not type(None)]
    kind = spec.get("kind")
    if kind is None:
        if "choices" in spec:
            kind = "choice"
        elif len(plain) == 1 and plain[0] in _BY_TYPE:
            kind = _BY_TYPE[typing.cast(type, plain[0])]
        else:
            raise TypeError(
                f"{record.__qualname__}.{name}: give option(kind=...): "
                f"the annotation {hint!r} does not say how to read it"
            )
    spec = spec | {"kind": kind, "optional": spec["optional"] or nullable}
    return Field(**spec)


def fields_of(record: type) -> dict[str, Field]:
    """The `Field` of every field of a dataclass `record` declared with `option`, by name, in
    declaration order (a subclass's fields after its bases')."""
    return _fields_of(record)


@functools.cache
def _fields_of(record: type) -> dict[str, Field]:
    hints = typing.get_type_hints(record)
    found = {}
    for f in dataclasses.fields(record):
        spec = f.metadata.get(METADATA)
        if spec is not None:
            found[f.name] = _from_annotation(record, f.name, hints[f.name], dict(spec))
    return found


def read_fields(
    mapping: Mapping[Any, Any], fields: Mapping[str, Field], prefix: str = ""
) -> dict[str, Any]:
    """The values of `mapping`, each read by its field (named `prefix` + its name in a message);
    a message that would quote a secret (a password, a key) masks it. Only the keys present are
    returned; the caller has refused the unknown ones."""
    read = {}
    for key, value in mapping.items():
        try:
            read[key] = fields[key].read(value, f"{prefix}{key}")
        except ConfigError as e:
            raise ConfigError(redact_text(str(e), secrets_in(value, str(key)))) from None
    return read


@dataclass(frozen=True, kw_only=True, slots=True)
class TierOptions:
    """Any thread (a frozen value): the options every secondary tier takes. A tier's own record
    subclasses its parent tier's, as a frozen, keyword-only, slotted dataclass whose new fields
    are declared with `option`."""

    capacity: int | None = option(
        None,
        kind="size",
        help="Bytes the tier may hold (null: unbounded, or as much as the backend has).",
    )
    codec: str = option("raw", choices=CODECS, help="How payloads are compressed when stored.")
    checksum: str = option(
        "xxh3", choices=CHECKSUMS, help="The checksum every stored payload carries."
    )
    read_only: bool = option(
        False, help="Serve reads only: no put, delete or eviction reaches the backend."
    )
    concurrency: int = option(
        16, low=1, high=4096, help="Calls of a batch that run at once against the backend."
    )
    timeout: float | None = option(
        5.0,
        kind="duration",
        help="Deadline of each call (null: none); the manager passes `faults.timeout`.",
    )

    @classmethod
    def of(cls, mapping: Mapping[str, Any], where: str = "") -> Self:
        """The record from `mapping`: Python values (bytes, seconds) or YAML ones (`8GiB`,
        `200ms`) alike. Raises `ConfigError` naming the field (`where.name`, or `name` when
        `where` is empty) for an unknown, a missing or a bad value."""
        fields = fields_of(cls)
        prefix = f"{where}." if where else ""
        unknown = sorted(
            key if isinstance(key, str) else short_repr(key) for key in mapping if key not in fields
        )
        if unknown:
            raise ConfigError(
                f"{prefix}{unknown[0]}: unknown option; expected one of {', '.join(sorted(fields))}"
            )
        for name, f in fields.items():
            if f.required and name not in mapping:
                raise ConfigError(f"{prefix}{name}: missing")
        return cls(**read_fields(mapping, fields, prefix))

    def with_values(self, mapping: Mapping[str, Any]) -> Self:
        """This record with the values of `mapping` (read as `of` reads them) in place of its
        own; `ConfigError` naming an unknown or a bad one. Nothing else is read again."""
        if not mapping:
            return self
        fields = fields_of(type(self))
        unknown = sorted(str(key) for key in mapping if key not in fields)
        if unknown:
            raise ConfigError(
                f"{unknown[0]}: unknown option; expected one of {', '.join(sorted(fields))}"
            )
        return dataclasses.replace(self, **read_fields(mapping, fields))


def _plain_number(value: object) -> object:
    """A number of another type than int or float (numpy's `int64`, `float32`: what Python
    callers building a tier often hold) as the int or float it is; anything else as it is. YAML
    yields none of these, so the loader reads exactly as before."""
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value
