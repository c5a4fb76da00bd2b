"""Options records: one declaration reads YAML and Python values alike and names bad fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiering.errors import ConfigError
from tiering.tier.options import REQUIRED, Field, TierOptions, fields_of, option


@dataclass(frozen=True, kw_only=True, slots=True)
class DiskOptions(TierOptions):
    path: str = option(kind="path", help="Where blocks go.", what="a directory path")
    min_free: int = option(1 << 30, kind="size", zero=True, help="Free space to leave.")
    ttl: float | None = option(None, kind="duration", help="Blocks expire after this.")
    layout: str = option("files", choices=("files", "segments"), help="How blocks are laid out.")
    fsync: bool = option(False, help="Flush before acknowledging.")


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentOptions(DiskOptions):
    segment_size: int = option(64 << 20, kind="size", help="Bytes of a segment file.")


def test_the_base_record_holds_what_every_tier_takes() -> None:
    assert list(fields_of(TierOptions)) == [
        "capacity",
        "codec",
        "checksum",
        "read_only",
        "concurrency",
        "timeout",
    ]
    assert TierOptions.of({}) == TierOptions(
        capacity=None, codec="raw", checksum="xxh3", read_only=False, concurrency=16, timeout=5.0
    )


def test_yaml_and_python_values_read_alike() -> None:
    from_yaml = DiskOptions.of({"path": "/x", "min_free": "2GiB", "ttl": "1h", "timeout": "200ms"})
    from_python = DiskOptions.of({"path": Path("/x"), "min_free": 2 << 30, "ttl": 3600.0})
    assert from_yaml.min_free == from_python.min_free == 2 << 30
    assert from_yaml.ttl == from_python.ttl == 3600.0 and from_yaml.path == from_python.path
    assert from_yaml.timeout == pytest.approx(0.2) and from_python.timeout == 5.0
    again = DiskOptions.of(
        {f.name: getattr(from_yaml, f.name) for f in dataclasses.fields(from_yaml)}
    )
    assert again == from_yaml  # a value already read reads back unchanged


def test_a_subclass_keeps_its_parents_fields_first() -> None:
    names = list(fields_of(SegmentOptions))
    assert names[:6] == list(fields_of(TierOptions)) and names[-1] == "segment_size"
    assert SegmentOptions.of({"path": "/x", "segment_size": "1MiB"}).segment_size == 1 << 20


@pytest.mark.parametrize(
    ("mapping", "where", "message"),
    [
        ({}, "", "path: missing"),
        ({"path": "/x", "colour": 1}, "", r"colour: unknown option; expected one of capacity, "),
        ({"path": "/x", "segment_size": 1}, "t", r"t.segment_size: unknown option"),
        ({"path": ""}, "tiers[0]", r"tiers\[0\].path: expected a directory path, got ''"),
        ({"path": "/x", "codec": "brotli"}, "", "codec: expected one of raw, lz4, zstd"),
        ({"path": "/x", "concurrency": 0}, "", "concurrency: expected a positive integer, got 0"),
        ({"path": "/x", "concurrency": 10**6}, "", "concurrency: .* up to 4,096, got 1000000"),
        ({"path": "/x", "capacity": 0}, "", "capacity: must be positive, got 0"),
        ({"path": "/x", "capacity": "lots"}, "", "capacity: expected a size like '8GiB'"),
        ({"path": "/x", "min_free": -1}, "", "min_free: must be at least 0 bytes, got -1"),
        ({"path": "/x", "fsync": 1}, "", "fsync: expected true or false, got 1"),
        ({"path": "/x", "fsync": None}, "", "fsync: expected true or false, got null"),
        ({"path": "/x", "timeout": "soon"}, "", "timeout: expected a duration"),
        ({"path": "/x", "layout": "weird"}, "", "layout: expected one of files, segments"),
        ({"path": "/x", 5: 1}, "", "5: unknown option"),
    ],
)
def test_bad_values_name_the_field(mapping: dict[str, object], where: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DiskOptions.of(mapping, where)


def test_null_is_a_value_where_the_annotation_says_so() -> None:
    options = DiskOptions.of({"path": "/x", "ttl": None, "timeout": None, "capacity": None})
    assert (options.ttl, options.timeout, options.capacity) == (None, None, None)


def test_a_message_never_quotes_a_secret() -> None:
    @dataclass(frozen=True, kw_only=True, slots=True)
    class Keyed(TierOptions):
        password: str | None = option(None, help="The server's password.")

    with pytest.raises(ConfigError) as info:
        Keyed.of({"password": ["hunter2-secret"]})
    assert "hunter2-secret" not in str(info.value) and "***" in str(info.value)


def test_records_are_frozen_values() -> None:
    options = DiskOptions.of({"path": "/x"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.path = "/y"  # type: ignore[misc]
    assert not hasattr(options, "__dict__")


def test_fields_carry_what_the_schema_and_the_docs_need() -> None:
    fields = fields_of(DiskOptions)
    assert fields["path"] == Field("path", what="a directory path", help="Where blocks go.")
    assert fields["path"].required and fields["path"].default is REQUIRED
    assert fields["ttl"].optional and fields["ttl"].kind == "duration"
    assert fields["min_free"].default_text() == "`1GiB`"
    assert fields["timeout"].default_text() == "`5s`"
    assert fields["layout"].type_text() == "`files` \\| `segments`"
    assert fields["ttl"].schema()["anyOf"][1] == {"type": "null"}
    assert fields["concurrency"].schema() == {
        "description": fields["concurrency"].help,
        "type": "integer",
        "minimum": 1,
        "maximum": 4096,
    }


def test_an_annotation_that_says_nothing_needs_a_kind() -> None:
    @dataclass(frozen=True, kw_only=True, slots=True)
    class Vague(TierOptions):
        size: int | str = option(1, help="Either.")

    with pytest.raises(TypeError, match=r"Vague.size: give option\(kind=...\)"):
        fields_of(Vague)


def test_choices_may_name_a_tuple_imported_when_used() -> None:
    field = Field("choice", choices="tiering.tier.format:CODECS")
    assert field.names() == ("raw", "lz4", "zstd") and field.read("lz4", "x") == "lz4"


def test_a_mutable_default_is_refused() -> None:
    with pytest.raises(TypeError, match="mutable"):
        option([], help="No.")


def test_python_callers_may_pass_numpy_numbers() -> None:
    """A tier built from Python takes numpy's integers and floats as the numbers they are (the
    constructors took them before options were records); numpy's bool is still no size."""
    import numpy as np

    from tiers.memory import MemoryTier

    tier = MemoryTier(
        namespace=bytes(16),
        capacity=np.int64(1 << 30),
        concurrency=np.int32(4),
        timeout=np.float32(1.5),
    )
    assert tier.capacity == 1 << 30 and type(tier.capacity) is int
    assert tier.options.concurrency == 4 and type(tier.options.concurrency) is int
    assert tier.options.timeout == 1.5 and type(tier.options.timeout) is float
    with pytest.raises(ConfigError, match="capacity: expected a size"):
        MemoryTier(namespace=bytes(16), capacity=np.bool_(True))
