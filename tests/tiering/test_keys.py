"""Block keys and namespaces."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import pytest

from tiering.errors import ConfigError, KeyFormatError
from tiering.keys import (
    FORMAT_VERSION,
    Layout,
    key_from_hex,
    key_from_path,
    key_group,
    key_hash,
    key_hex,
    key_path,
    make_key,
)

HASH = bytes(range(32))


def layout(**changes: object) -> Layout:
    fields: dict[str, object] = dict(
        model="hf:meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
        model_dtype="bfloat16",
        model_options='{"hf_overrides":null,"quantization":null}',
        dtype="bfloat16",
        kv_layout="LBHNC",
        page_size_bytes=4 * 1024 * 1024,
        tokens_per_block=256,
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        tp_size=1,
        pp_size=1,
    )
    fields.update(changes)
    return Layout(**fields)  # type: ignore[arg-type]


class TestKeys:
    def test_matches_vllm_offload_key_layout(self) -> None:
        key = make_key(HASH, 3)
        assert key == HASH + b"\x00\x00\x00\x03"  # vLLM: hash + 4-byte big-endian group
        assert key_hash(key) == HASH and key_group(key) == 3

    def test_hex_round_trip(self) -> None:
        key = make_key(HASH, 70000)
        text = key_hex(key)
        assert text == HASH.hex() + "00011170" and key_from_hex(text) == key

    @pytest.mark.parametrize(
        ("text", "problem"),
        [
            ("ABCDEF0011223344", "not lowercase hex"),
            ("zz" * 10, "not lowercase hex"),
            ("../etc/passwd", "not lowercase hex"),
            ("abc", "odd number"),
            ("00000001", "is 4 bytes"),
            ("ab" * 69, "is 69 bytes"),
            ("", "is 0 bytes"),
        ],
    )
    def test_invalid_hex_is_rejected(self, text: str, problem: str) -> None:
        with pytest.raises(KeyFormatError, match=problem):
            key_from_hex(text)

    def test_non_string_is_rejected(self) -> None:
        with pytest.raises(KeyFormatError, match="hex string, got bytes"):
            key_from_hex(b"00" * 8)  # type: ignore[arg-type]

    def test_make_key_limits(self) -> None:
        with pytest.raises(KeyFormatError, match="empty"):
            make_key(b"")
        with pytest.raises(KeyFormatError, match="65 bytes"):
            make_key(bytes(65))
        with pytest.raises(KeyFormatError, match="does not fit"):
            make_key(HASH, 2**32)

    def test_path_fans_out_by_hash_prefix_and_round_trips(self) -> None:
        key = make_key(HASH, 1)
        path = key_path(key)
        assert path == f"00/01/{key.hex()}"
        assert key_from_path(path) == key and key_from_path("/root/" + path) == key
        assert key_path(key, levels=3).startswith("00/01/02/")

    def test_path_of_short_hash(self) -> None:
        with pytest.raises(KeyFormatError, match="too short"):
            key_path(make_key(b"\x01"), levels=2)


class TestNamespace:
    def test_golden_digest(self) -> None:
        # Stored objects carry this digest: if it changes, every persistent tier goes cold
        # (its blocks become foreign). It changes with the fields of `Layout` and with
        # FORMAT_VERSION, never by accident.
        assert FORMAT_VERSION == 1
        assert layout().namespace_hex() == GOLDEN
        expected = hashlib.sha256(b"kvtier-namespace\x00" + layout().canonical_json()).digest()
        assert layout().namespace() == expected[:16]
        assert layout().canonical_json().startswith(b'{"dtype":"bfloat16","format_version":1,')

    def test_every_field_changes_the_namespace(self) -> None:
        base = layout()
        seen = {base.namespace()}
        for f in dataclasses.fields(Layout):
            value = getattr(base, f.name)
            other = layout(**{f.name: value + 1 if isinstance(value, int) else value + "x"})
            seen.add(other.namespace())
        assert len(seen) == len(dataclasses.fields(Layout)) + 1

    def test_dtype_spelling_is_normalized(self) -> None:
        assert layout(dtype="torch.bfloat16") == layout()
        assert layout(dtype="torch.bfloat16").namespace() == layout().namespace()
        assert layout(model_dtype="torch.bfloat16").namespace() == layout().namespace()

    def test_same_digest_in_other_processes_and_hash_seeds(self) -> None:
        code = "from tests.tiering.test_keys import layout; print(layout().namespace_hex())"
        for seed in ("0", "12345", "random"):
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONHASHSEED": seed},
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            )
            assert out.stdout.strip() == GOLDEN

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"model": ""}, "layout.model: must not be empty"),
            ({"model_options": ""}, "layout.model_options: must not be empty"),
            ({"tp_size": 0}, "layout.tp_size: expected a positive integer, got 0"),
            ({"num_layers": True}, "layout.num_layers: expected a positive integer, got True"),
            ({"head_size": "128"}, "layout.head_size: expected a positive integer"),
            ({"dtype": 16}, "layout.dtype: expected a string, got int"),
        ],
    )
    def test_invalid_layout_names_the_field(self, changes: dict[str, object], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            layout(**changes)


GOLDEN = "ef651d5861a0ca2507db4af132eecf2b"
