"""Tier options found from constructor signatures, for tier classes without an `Options` record.

Transitional: kvtier's tiers declare their options as `Options` records
(`tiering.options.TierOptions`); until every built-in tier does, a class with no `Options`
attribute at all has its options read from its constructors' keyword parameters, refined by
`_TIER_RULES`. This module goes away, with its one caller in `tiering.config.tiers`, once every
tier declares its record.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import types
import typing
from typing import Any, Union

from tiering.options import REQUIRED, Field
from tiering.units import MAX_SIZE

__all__ = ["signature_fields"]

# What a constructor annotation says of an option's YAML value: `bool` true/false, `int` a
# count, `float` a number, `int | str` a size, `float | str` a duration, `str` (or a path) text;
# `X | None` (or a None default) admits null too; anything else is taken as it is.
_BY_ANNOTATION: dict[frozenset[type], Field] = {
    frozenset({bool}): Field("flag"),
    frozenset({int}): Field("integer", high=MAX_SIZE),
    frozenset({float}): Field("number", low=-math.inf, high=math.inf),
    frozenset({int, float}): Field("number", low=-math.inf, high=math.inf),
    frozenset({int, str}): Field("size"),
    frozenset({float, str}): Field("duration"),
    frozenset({int, float, str}): Field("duration"),
    frozenset({str}): Field("text"),
    frozenset({str, os.PathLike}): Field("text", low=1, what="a path"),
}

# What an annotation cannot say (the names an option takes, a count that must be positive, a
# float that is a duration), by the class whose constructor declares the option.
_TIER_RULES: dict[str, dict[str, Field]] = {
    "tiering.tier.Tier": {
        "codec": Field("choice", choices="tiering.format:CODECS"),
        "checksum": Field("choice", choices="tiering.format:CHECKSUMS"),
        "concurrency": Field("integer", low=1, high=4096),
        "timeout": Field("duration", optional=True),
    },
    "tiers.file.FileTier": {
        "path": Field("text", low=1, what="a directory path"),
        "layout": Field("choice", choices="tiers.file:LAYOUTS"),
        "min_free": Field("size", zero=True),
    },
    "tiers.redis.RedisTier": {
        "url": Field("text", low=1, what="a URL like 'redis://host:6379/0'"),
        "socket_timeout": Field("duration"),
        "connect_timeout": Field("duration"),
    },
    "tiers.s3.S3Tier": {
        "bucket": Field("text", low=1, what="a bucket name"),
        "blocks_per_object": Field("integer", low=1, high=4096),
        "retries": Field("integer", high=100),
        "connect_timeout": Field("duration"),
        "read_timeout": Field("duration"),
    },
}
_NOT_OPTIONS = {"namespace", "secret", "name"}
"""Constructor parameters that are not tier options: given by the manager, `auth.secret`, or
`TierConfig` itself."""


def _annotation_field(hint: object, optional: bool) -> Field:
    union = typing.get_origin(hint) in (Union, types.UnionType)
    args = set(typing.get_args(hint)) if union else {hint}
    optional = optional or type(None) in args
    args.discard(type(None))
    plain = frozenset(typing.cast(type, typing.get_origin(a) or a) for a in args)
    found = _BY_ANNOTATION.get(plain)
    return dataclasses.replace(found or Field("any"), optional=optional or found is None)


@functools.cache
def signature_fields(cls: type) -> dict[str, Field]:
    """A tier class's options (keyword parameters of its and its bases' constructors), each
    with the most derived class's rule for it, else its most derived annotation; `default` is
    `REQUIRED` when some constructor has no default for it."""
    fields: dict[str, Field] = {}
    ruled: set[str] = set()
    required: set[str] = set()
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - a third party's unresolvable annotation: no typing
            hints = {}
        rules = _TIER_RULES.get(f"{klass.__module__}.{klass.__qualname__}", {})
        for p in inspect.signature(init).parameters.values():
            if p.kind is not p.KEYWORD_ONLY or p.name in _NOT_OPTIONS:
                continue
            if p.default is p.empty:
                required.add(p.name)
            defaults.setdefault(p.name, REQUIRED if p.default is p.empty else p.default)
            if p.name in rules and p.name not in ruled:
                fields[p.name] = rules[p.name]
                ruled.add(p.name)
            elif p.name not in fields:
                fields[p.name] = _annotation_field(hints.get(p.name, Any), p.default is None)
    return {
        name: dataclasses.replace(f, default=REQUIRED if name in required else defaults[name])
        for name, f in fields.items()
    }
