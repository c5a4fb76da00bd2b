"""The configuration's JSON Schema and its documentation table, produced from its declarations.

`configs/kvtier.schema.json` is `json_schema()` (a test regenerates it and compares); the YAML
reference of the README is `markdown_table()`. Both come from the sections of
`tiering.config.schema` and each built-in tier type's `Options` record (one branch per variant
of a tier that has several, such as the file tier's layouts). Regenerate with
`python -m tiering.config --schema configs/kvtier.schema.json`; print the table with
`python -m tiering.config --markdown`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiering.config.schema import (
    ENV_PATTERN,
    NAME_PATTERN,
    SCHEMA_VERSION,
    AuthConfig,
    Config,
    TierConfig,
    sections_of,
)
from tiering.config.tiers import TIER_KEYS, option_fields, required, variants
from tiering.errors import ConfigError
from tiering.registry import builtin_tier_types, get_tier_class
from tiering.tier.options import Field, TierOptions, fields_of

__all__ = ["json_schema", "markdown_table", "write_json_schema"]

_SECRET = {"type": "string", "pattern": f"^{ENV_PATTERN}$"}
"""`auth.secret` is written as `${NAME}` only (the loader refuses a secret in the file)."""


def _tier_types() -> list[tuple[str, type | None]]:
    """Each built-in tier type with its class (None when its dependencies are missing)."""
    found: list[tuple[str, type | None]] = []
    for type_name in builtin_tier_types():
        try:
            found.append((type_name, get_tier_class(type_name)))
        except ConfigError:
            found.append((type_name, None))
    return found


def _base_tier_fields() -> dict[str, Field]:
    """The options every tier takes (those of the `Tier` base class's record)."""
    return {n: f for n, f in fields_of(TierOptions).items() if n not in TIER_KEYS}


# -- JSON Schema ----------------------------------------------------------------------------------


def _object(cls: type, help: str = "") -> dict[str, Any]:
    properties: dict[str, Any] = {name: f.schema() for name, f in fields_of(cls).items()}
    if cls is AuthConfig:
        properties["secret"] = {"description": fields_of(cls)["secret"].help} | _SECRET
    for name, (section, text) in sections_of(cls).items():
        properties[name] = _object(section, text)
    return ({"description": help} if help else {}) | {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


def _tier_branches(type_name: str, cls: type | None) -> Iterator[dict[str, Any]]:
    tier_keys = fields_of(TierConfig)
    found = [(None, "", ())] if cls is None else variants(cls)
    for index, (klass, chooser, values) in enumerate(found):
        options = {} if klass is None else option_fields(klass)
        properties: dict[str, Any] = {name: f.schema() for name, f in tier_keys.items()}
        properties["name"] = {"description": tier_keys["name"].help, "type": "string"}
        properties["name"]["pattern"] = f"^{NAME_PATTERN}$"
        properties["type"] = {"const": type_name}
        properties |= {name: f.schema() for name, f in sorted(options.items())}
        needed = ["name", "type", *required(options)]
        if chooser:
            described = {"description": options[chooser].help} if options[chooser].help else {}
            properties[chooser] = described | {"enum": list(values)}
            if index:  # only the default variant is what a mapping without the option selects
                needed.append(chooser)
        yield {
            "type": "object",
            "required": needed,
            "additionalProperties": False,
            "properties": properties,
        }


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file (`configs/kvtier.schema.json` is this, generated)."""
    properties: dict[str, Any] = {
        "version": {"description": fields_of(Config)["version"].help, "const": SCHEMA_VERSION}
    }
    for name, (section, text) in sections_of(Config).items():
        properties[name] = _object(section, text)
        if name == "primary":
            branches = [b for t, c in _tier_types() for b in _tier_branches(t, c)]
            properties["tiers"] = {
                "description": "The secondary tiers, in lookup order.",
                "type": "array",
                "items": {"oneOf": branches},
            }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvtier configuration",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


def write_json_schema(path: str | Path) -> None:
    Path(path).write_text(json.dumps(json_schema(), indent=2) + "\n")


# -- the documentation table ----------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(key: str, f: Field, type_text: str = "", note: str = "") -> str:
    kind = type_text or f.type_text()
    return f"| `{key}`{note} | {kind} | {f.default_text()} | {_cell(f.help)} |"


def _section_rows(prefix: str, cls: type) -> Iterator[str]:
    for name, f in fields_of(cls).items():
        if cls is AuthConfig and name == "secret":
            yield _row(f"{prefix}{name}", f, "`${NAME}` \\| null")
        else:
            yield _row(f"{prefix}{name}", f)
    for name, (section, _) in sections_of(cls).items():
        yield from _section_rows(f"{prefix}{name}.", section)


def _tier_rows() -> Iterator[str]:
    for name, f in fields_of(TierConfig).items():
        yield _row(f"tiers[].{name}", f)
    base = _base_tier_fields()
    for name, f in base.items():
        yield _row(f"tiers[].{name}", f, note=" (every type)")
    for type_name, cls in _tier_types():
        if cls is None:
            continue
        found = variants(cls)
        shared = option_fields(found[0][0])
        for name, f in shared.items():
            if base.get(name) != f:
                yield _row(f"tiers[].{name}", f, note=f" ({type_name})")
        for klass, chooser, values in found[1:]:
            label = f"({type_name}, {chooser}: {', '.join(values)})"
            for name, f in option_fields(klass).items():
                if shared.get(name) != f:
                    yield _row(f"tiers[].{name}", f, note=f" {label}")


def markdown_table() -> str:
    """Every key of the file, with its type, default and help, as a Markdown table: a tier
    type's own options are marked with the type (and the variant) that takes them."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    version = fields_of(Config)["version"]
    lines.append(_row("version", version, f"`{SCHEMA_VERSION}`"))
    for name, (section, _) in sections_of(Config).items():
        lines.extend(_section_rows(f"{name}.", section))
        if name == "primary":
            lines.extend(_tier_rows())
    return "\n".join(lines) + "\n"
