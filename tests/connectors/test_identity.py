"""Model identity: the part of the namespace that names the model by its content."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

import connectors.identity as identity
from connectors.identity import content_digest, hub_snapshot, model_identity, sample_ranges
from tests.helpers.model_files import write_model
from tiering.errors import ConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_the_same_model_at_two_paths_is_one_identity(tmp_path: Path) -> None:
    first = write_model(tmp_path / "a")
    second = tmp_path / "elsewhere" / "b"
    shutil.copytree(first, second)  # new modification times too
    os.utime(second / "model.safetensors", (1, 1))
    assert model_identity(str(first)) == model_identity(str(second))
    assert model_identity(str(first)).startswith("sha256:")
    link = tmp_path / "link"
    link.symlink_to(first)
    assert model_identity(str(link)) == model_identity(str(first))


def test_other_weights_of_the_same_shape_are_another_identity(tmp_path: Path) -> None:
    """The case headers and sizes alone would miss: config, header and sizes are identical."""
    a, b = write_model(tmp_path / "a", seed=0), write_model(tmp_path / "b", seed=1)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    head = 8 + struct.unpack("<Q", (a / "model.safetensors").read_bytes()[:8])[0]
    assert (a / "model.safetensors").read_bytes()[:head] == (b / "model.safetensors").read_bytes()[
        :head
    ]
    assert model_identity(str(a)) != model_identity(str(b))


def test_new_weights_over_the_same_path_are_another_identity(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", seed=0)
    before = model_identity(str(path))
    write_model(path, seed=1)
    assert model_identity(str(path)) != before


def test_one_changed_tensor_is_seen(tmp_path: Path) -> None:
    """A fine-tune of one layer: its tensor's first and last pages are always sampled."""
    path = write_model(tmp_path / "m")
    before = model_identity(str(path))
    data = bytearray((path / "model.safetensors").read_bytes())
    head = 8 + struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:head])
    begin, end = header["layer.0.k"]["data_offsets"]
    data[head + end - 1] ^= 1  # the tensor's last byte
    (path / "model.safetensors").write_bytes(data)
    assert model_identity(str(path)) != before


@pytest.mark.parametrize(
    ("name", "counts"), [("config.json", True), ("modeling_x.py", True), ("tokenizer.json", False)]
)
def test_what_shapes_the_kv_counts_and_the_tokenizer_does_not(
    tmp_path: Path, name: str, counts: bool
) -> None:
    path = write_model(tmp_path / "m")
    before = model_identity(str(path))
    (path / name).write_text('{"changed": true}')
    assert (model_identity(str(path)) != before) is counts


def test_hidden_folders_and_other_files_are_not_the_model(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m")
    before = model_identity(str(path))
    (path / ".cache").mkdir()
    (path / ".cache" / "x.safetensors").write_bytes(b"junk")
    (path / "README.md").write_text("notes")
    assert model_identity(str(path)) == before


def test_a_link_back_up_the_tree_is_not_walked_again(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m")
    before = model_identity(str(path))
    (path / "sub").mkdir()
    (path / "sub" / "loop").symlink_to(path)
    assert model_identity(str(path)) == before


def test_a_single_file_model_is_identified_by_its_content(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(os.urandom(300_000))
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert model_identity(str(tmp_path / "a.gguf")) == model_identity(str(tmp_path / "b.gguf"))


def test_a_hub_snapshot_is_its_commit_without_reading_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = write_model(tmp_path / "hub" / "models--org--some-model" / "snapshots" / COMMIT)
    assert hub_snapshot(snapshot) == ("org/some-model", COMMIT)
    monkeypatch.setattr(identity, "content_digest", None)  # would raise if it were called
    assert model_identity(str(snapshot)) == f"hf:org/some-model@{COMMIT}"
    assert hub_snapshot(tmp_path / "hub" / "models--org--x" / "snapshots" / "main") is None
    assert hub_snapshot(tmp_path / "datasets--org--x" / "snapshots" / COMMIT) is None


def test_a_repository_id_with_nothing_local(caplog: pytest.LogCaptureFixture) -> None:
    assert model_identity("org/absent", COMMIT) == f"hf:org/absent@{COMMIT}"  # pinned: exact
    assert model_identity("org/absent", "main") == "name:org/absent@main"
    assert "has no local files" in caplog.text


def test_a_folder_without_weights_is_tied_to_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its weights are somewhere kvtier cannot see: its configuration alone would not tell two
    fine-tunes apart, so the folder's path is part of the identity, with a warning."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    a, b = model_identity(str(tmp_path / "a")), model_identity(str(tmp_path / "b"))
    assert a.startswith(f"path:{tmp_path / 'a'}@sha256:") and a != b
    assert "holds no weight file kvtier knows" in caplog.text


def test_an_empty_folder_cannot_be_identified(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no weight or configuration file"):
        content_digest(tmp_path)


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m")
    (path / "broken.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="cannot read it to identify the model"):
        model_identity(str(path))


def test_a_damaged_safetensors_header_is_sampled_like_any_file(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"x" * 1000)
    first = model_identity(str(path))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"y" * 1000)
    assert model_identity(str(path)) != first


def test_the_sample_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of 2 GiB files (sparse here) and 10,000 tensors: a few MiB are read."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text("{}")
    tensors, each = 10_000, 200 * 1024
    for shard in range(2):
        header = {
            f"t{shard}.{i}": {
                "dtype": "F32",
                "shape": [each // 4],
                "data_offsets": [i * each, (i + 1) * each],
            }
            for i in range(tensors // 2)
        }
        text = json.dumps(header).encode()
        with open(path / f"model-{shard}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(2 << 30)
    read = []
    real = os.pread
    monkeypatch.setattr(identity.os, "pread", lambda fd, n, off: read.append(n) or real(fd, n, off))
    model_identity(str(path))
    headers = 2 * (8 + len(text))
    samples = 2 * (2 * 64 + 16 * 4) * 1024 + identity.MAX_TENSOR_SAMPLES * 2 * 4096
    assert sum(read) <= headers + samples + 2  # + config.json
    assert sum(read) < 40 << 20


def test_sample_ranges_are_sorted_merged_and_inside_the_file() -> None:
    assert sample_ranges(1000) == [(0, 1000)]  # a small file is read whole
    size = 10 << 20
    ranges = sample_ranges(size, header_end=100_000, tensors=[(100_000, 200_000)])
    assert ranges[0] == (0, 100_000 + 4096)  # the header, and the first tensor's first page
    assert all(a + n < b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1] == (size - 64 * 1024, 64 * 1024)
    assert (200_000 - 4096, 4096) in ranges
