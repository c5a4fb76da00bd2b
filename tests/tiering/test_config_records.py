"""Tier options from `Options` records: the loader, the registry, the JSON Schema and the docs
table all read a tier class's record (after `variant`), and nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from tests.helpers.paths import ROOT
from tiering.config import markdown_table, parse_config, tier_from_config
from tiering.config.__main__ import main
from tiering.config.generate import _tier_branches
from tiering.config.schema import Config, sections_of
from tiering.config.tiers import option_fields, variants
from tiering.errors import ConfigError
from tiering.registry import register_tier
from tiering.tier.options import TierOptions, fields_of, option
from tiers.memory import MemoryTier

NAMESPACE = bytes(range(16))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShelfOptions(TierOptions):
    shape: str = option("narrow", choices=("narrow", "wide"), help="Which shelf.")
    label: str = option(low=1, what="a label", help="What the shelf says.")
    linger: float = option(1.5, kind="duration", help="How long a block stays.")


@dataclass(frozen=True, kw_only=True, slots=True)
class WideOptions(ShelfOptions):
    width: int = option(2 << 20, kind="size", help="Bytes across.")


class Shelf(MemoryTier):
    """Any thread: a test double of a tier with a record and two variants."""

    Options: ClassVar[type[TierOptions]] = ShelfOptions
    options: ShelfOptions

    @classmethod
    def variant(cls, options: Mapping[str, Any]) -> type[Shelf]:
        return WideShelf if options.get("shape") == "wide" else cls


class WideShelf(Shelf):
    Options: ClassVar[type[TierOptions]] = WideOptions
    options: WideOptions


@pytest.fixture(autouse=True)
def _shelf(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import tiering.registry as registry

    monkeypatch.setattr(registry.TIERS, "_table", dict(registry.TIERS._table))
    register_tier("shelf", Shelf)
    yield


def _tier(**options: object) -> dict[str, object]:
    return {"tiers": [{"name": "s", "type": "shelf", **options}]}


def test_the_loader_reads_the_variants_record() -> None:
    config = parse_config(_tier(label="x", shape="wide", width="1MiB", linger="2s", capacity=9))
    (tier,) = config.tiers
    assert tier.capacity == 9
    assert tier.options == {"label": "x", "shape": "wide", "width": 1 << 20, "linger": 2.0}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"tiers\[0\].label: missing \(a shelf tier needs it\)"),
        ({"label": ""}, r"tiers\[0\].label: expected a label, got ''"),
        ({"label": "x", "width": 5}, r"tiers\[0\].width: unknown option of a shelf tier; expected"),
        ({"label": "x", "shape": "tall"}, r"tiers\[0\].shape: expected one of narrow, wide"),
        ({"label": "x", "linger": "soon"}, r"tiers\[0\].linger: expected a duration"),
        ({"label": "x", "shape": "wide", "width": 0}, r"tiers\[0\].width: must be positive"),
        ({"label": "x", "capacity": "lots"}, r"tiers\[0\].capacity: expected a size like"),
        ({"label": "x", "secret": "k"}, r"tiers\[0\].secret: not a tier option"),
    ],
)
def test_the_loader_names_what_the_record_refuses(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_tier(**options))


def test_the_unknown_option_message_lists_the_variants_options() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_tier(label="x", colour=1))
    listed = str(info.value).split("expected one of ")[1].split(", ")
    assert "width" not in listed and {"label", "linger", "capacity", "write", "codec"} <= set(
        listed
    )


def test_the_registry_builds_the_variant_from_the_loaded_options() -> None:
    config = parse_config(_tier(label="x", shape="wide", width="1MiB", capacity="1MiB"))
    (cfg,) = config.tiers
    tier = tier_from_config(cfg, NAMESPACE, config)
    try:
        assert type(tier) is WideShelf and isinstance(tier.options, WideOptions)
        assert (tier.options.width, tier.options.capacity, tier.capacity) == (1 << 20,) + (
            1 << 20,
        ) * 2
        assert tier.name == "s"
    finally:
        asyncio.run(tier.close())


def test_a_tier_from_its_entry_refuses_an_option_the_variant_lacks() -> None:
    config = parse_config(_tier(label="x"))
    with pytest.raises(ConfigError, match=r"tier 's' \(shelf\): width: unknown option"):
        tier_from_config(config.tiers[0], NAMESPACE, config, width=1)


def test_the_variants_are_found_from_the_choice_that_selects_them() -> None:
    assert variants(Shelf) == [(Shelf, "shape", ("narrow",)), (WideShelf, "shape", ("wide",))]
    assert variants(MemoryTier) == [(MemoryTier, "", ())]
    assert "capacity" not in option_fields(Shelf)  # a key of TierConfig


def test_each_variant_has_a_schema_branch_of_its_own() -> None:
    import jsonschema

    narrow, wide = _tier_branches("shelf", Shelf)
    assert narrow["required"] == ["name", "type", "label"]
    assert wide["required"] == ["name", "type", "label", "shape"]
    assert "width" in wide["properties"] and "width" not in narrow["properties"]
    schema = {"oneOf": [narrow, wide]}
    jsonschema.validate({"name": "s", "type": "shelf", "label": "x"}, schema)
    jsonschema.validate(
        {"name": "s", "type": "shelf", "label": "x", "shape": "wide", "width": 3}, schema
    )
    for bad in (
        {"name": "s", "type": "shelf", "label": "x", "width": 3},
        {"name": "s", "type": "shelf", "label": "x", "shape": "wide", "width": "lots"},
        {"name": "S", "type": "shelf", "label": "x"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_schema_reads_sizes_as_the_loader_does() -> None:
    import json

    import jsonschema

    schema = json.loads((ROOT / "configs" / "kvtier.schema.json").read_text())
    for good in ("2kib", "8GiB", " 1.5 TB ", 4096):
        jsonschema.validate({"primary": {"capacity": good}}, schema)
        parse_config({"primary": {"capacity": good}})
    for bad in ("lots", "8 GiB please", "x8GiB"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"primary": {"capacity": bad}}, schema)
        with pytest.raises(ConfigError):
            parse_config({"primary": {"capacity": bad}})


def test_every_section_key_has_its_default_and_help_in_one_place() -> None:
    config = Config()
    for name, (cls, text) in sections_of(Config).items():
        assert text
        for key, f in fields_of(cls).items():
            assert f.help, f"{name}.{key}"
            assert getattr(getattr(config, name), key) == f.default, f"{name}.{key}"
    assert [f.name for f in dataclasses.fields(Config)] == [
        "version",
        "primary",
        "tiers",
        "promotion",
        "faults",
        "shutdown",
        "trace",
        "metrics",
        "auth",
    ]


def test_every_declared_section_is_read_from_the_file() -> None:
    """A section the schema declares is read, not accepted and then ignored: a value other
    than its default, given in the file, arrives in the record."""
    for name, (cls, _) in sections_of(Config).items():
        for key, f in fields_of(cls).items():
            if f.kind == "flag":
                value: object = not f.default
            elif f.kind in ("integer", "number", "duration") and f.default is not None:
                value = f.default + 1
            else:
                continue
            try:
                config = parse_config({name: {key: value}}, {})
            except ConfigError:
                continue  # out of the field's range: its own test says so
            assert getattr(getattr(config, name), key) == value, f"{name}.{key} was ignored"


def test_the_docs_table_has_every_key() -> None:
    table = markdown_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    keys = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}  # type: ignore[union-attr]
    assert {"version", "primary.capacity", "faults.breaker.latency", "auth.secret"} <= keys
    assert {"tiers[].write", "tiers[].codec", "tiers[].path", "tiers[].bucket"} <= keys
    assert all(row.count(" | ") == 3 for row in rows)
    assert "| `tiers[].codec` (every type) |" in table


def test_python_m_tiering_config_prints_the_table_and_writes_the_schema(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == markdown_table()
    target = tmp_path / "schema.json"
    assert main(["--schema", str(target)]) == 0
    assert target.read_text() == (ROOT / "configs" / "kvtier.schema.json").read_text()


def test_the_readme_reference_is_the_generated_table() -> None:
    """The README's YAML reference sits between `<!-- config-reference:begin -->` and
    `<!-- config-reference:end -->`, regenerated by `python -m tiering.config --markdown`."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(
        r"<!-- config-reference:begin -->\n(.*?)<!-- config-reference:end -->", readme, re.S
    )
    assert found is not None, "README.md lost its config-reference markers"
    assert found.group(1).strip() == markdown_table().strip(), (
        "regenerate: python -m tiering.config --markdown"
    )


def test_a_tier_is_built_with_the_record_the_loader_checked() -> None:
    """The loader reads a tier's options into its (variant's) record once; the tier receives
    that record, not a mapping it reads again: the same object when nothing is filled in, the
    record with the deployment's deadline when the entry gives none."""
    config = parse_config(_tier(label="x", shape="wide", width="1MiB", timeout="3s"))
    (cfg,) = config.tiers
    assert isinstance(cfg.record, WideOptions) and cfg.record.width == 1 << 20
    tier = tier_from_config(cfg, NAMESPACE, config)
    try:
        assert tier.options is cfg.record
    finally:
        asyncio.run(tier.close())
    config = parse_config({**_tier(label="x"), "faults": {"timeout": "250ms"}})
    (cfg,) = config.tiers
    tier = tier_from_config(cfg, NAMESPACE, config)
    try:
        assert tier.options == dataclasses.replace(cfg.record, timeout=0.25)
    finally:
        asyncio.run(tier.close())
