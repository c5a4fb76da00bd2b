"""Model identity: what a model is, never where it lies. Part of every namespace (`Layout.model`).

Two engines share KV only when they run the same weights under the same configuration, so the
identity must follow the content: the same model served from two paths is one identity, and new
weights written over an old path are another. Reading every weight byte would cost minutes on a
large model at each engine start, so the identity is cheap, in this order:

1. `hf:<repo>@<commit>` for a Hugging Face hub snapshot: a model directory inside a hub cache
   (`.../models--org--name/snapshots/<commit>/`), or a repository id whose snapshot for the
   requested revision (a commit, a branch or a tag, resolved through the cache's refs) is in the
   cache. A hub commit names every file's bytes exactly, and nothing has to be read.
2. `sha256:<digest>` for any other local directory or single-file model, over a bounded sample
   of its content (`content_digest`): every file that shapes the KV (weights; the JSON
   configuration files whole, except the tokenizer's and the generation config, which do not
   change the KV of given token ids; Python files of remote code whole), each with its relative
   path and size; for every weight file its first and last 64 KiB and 16 pages spread over it;
   for safetensors files also the whole JSON header (tensor names, dtypes, shapes, offsets) and
   the first and last 4 KiB of each tensor (of up to 4,096 tensors in all, spread over the
   model). Never the modification time: a copy keeps its identity.
3. `name:<model>@<revision>` when there is nothing local to read (a remote model the hub cache
   does not hold, weights streamed from object storage): the name as given, with a warning,
   since new weights under the same name would then share stale KV. A local folder without any
   weight file kvtier recognizes is `path:<folder>@sha256:<digest>`, its configuration's digest
   tied to its path, with the same warning.

Why sampled bytes and not just headers and sizes: two models of one architecture and shape, such
as two fine-tunes of one base or two random initializations, have byte-identical configs,
safetensors headers and sizes; only the weight bytes tell them apart. Any training run changes
nearly every weight, so pages at the start and end of every tensor and across every file catch
it. What the sample cannot see is an edit confined to bytes no sampled page covers (a few rows
in the middle of one tensor); after such surgery on a model in place, change its directory or
purge its namespace (`kvtier purge --namespace`).

Runs in the scheduler and in every worker process at engine start; pure stdlib (the hub cache is
resolved with `huggingface_hub` when it is installed, as it is wherever vLLM is).

    python -m connectors.identity MODEL    # print a model's identity and what it cost
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiering.errors import ConfigError

__all__ = ["content_digest", "hub_snapshot", "model_identity", "sample_ranges"]

log = logging.getLogger(__name__)

EDGE_BYTES = 64 * 1024
"""Bytes sampled at the start and at the end of every weight file."""
PAGE_BYTES = 4096
"""Bytes of each other sample: a strided page, a tensor's first or last page."""
STRIDED_PAGES = 16
"""Pages sampled at even intervals across every weight file."""
MAX_TENSOR_SAMPLES = 4096
"""Tensors (over all safetensors files of a model) whose first and last pages are sampled."""
WHOLE_LIMIT = 1 << 20
"""Configuration and code files up to this size are hashed whole; larger ones are sampled."""
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
"""The safetensors format's own bound on its JSON header."""

WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
WHOLE_SUFFIXES = frozenset({".json", ".py"})
NOT_KV_FILES = frozenset(
    {
        "added_tokens.json",
        "chat_template.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    }
)
"""Files that change how text becomes token ids or how tokens are sampled, never the KV of
given token ids (vLLM keys blocks by token ids)."""

_COMMIT = re.compile(r"[0-9a-f]{40}")
_DOMAIN = b"kvtier-model-content\x00"


def model_identity(
    model: str, revision: str | None = None, *, download_dir: str | None = None
) -> str:
    """The path-free identity of `model` (a local path or a hub repository id); see the module
    docstring for the three forms and what each reads."""
    path = Path(model).expanduser()
    if path.exists():
        real = path.resolve()
        hub = hub_snapshot(real if real.is_dir() else real.parent)
        if hub is not None:
            return f"hf:{hub[0]}@{hub[1]}"
        if real.is_dir() and not any(_is_weights(f) for f, _ in _model_files(real)):
            log.warning(
                "kvtier: model folder %s holds no weight file kvtier knows (%s); it is "
                "identified by its configuration and its path: if its weights change, purge "
                "its namespace",
                real,
                ", ".join(sorted(WEIGHT_SUFFIXES)),
            )
            return f"path:{real}@sha256:{content_digest(real)}"
        return "sha256:" + content_digest(real)
    snapshot = _cached_snapshot(model, revision, download_dir)
    if snapshot is not None:
        hub = hub_snapshot(snapshot)
        if hub is not None:
            return f"hf:{hub[0]}@{hub[1]}"
    if revision is not None and _COMMIT.fullmatch(revision):
        return f"hf:{model}@{revision}"
    log.warning(
        "kvtier: model %r has no local files to identify it by; blocks are shared by its name "
        "and revision %r: if its weights change, purge its namespace",
        model,
        revision,
    )
    return f"name:{model}@{revision or ''}"


def hub_snapshot(directory: Path) -> tuple[str, str] | None:
    """`(repo, commit)` when `directory` is a snapshot of a Hugging Face hub cache
    (`.../models--org--name/snapshots/<commit>`), else None."""
    parts = directory.parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not _COMMIT.fullmatch(parts[-1]):
        return None
    kind, _, repo = parts[-3].partition("--")
    if kind != "models" or not repo:
        return None
    return repo.replace("--", "/"), parts[-1]


def _cached_snapshot(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The hub cache's snapshot directory of `model` at `revision` (default: main)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(
            model, "config.json", cache_dir=download_dir, revision=revision
        )
    except ValueError:  # not a repository id
        return None
    return Path(found).parent if isinstance(found, str) else None


def content_digest(root: Path) -> str:
    """SHA-256 (hex) over the sampled content of a model directory or single-file model."""
    try:
        return _content_digest(root)
    except OSError as e:
        raise ConfigError(f"model {root}: cannot read it to identify the model: {e}") from e


def _content_digest(root: Path) -> str:
    files = [(root, "")] if root.is_file() else list(_model_files(root))
    if not files:
        raise ConfigError(f"model {root}: no weight or configuration file to identify it by")
    headers = {path: _safetensors_header(path) for path, _ in files}
    tensors = sorted(
        (str(path), span)
        for path, header in headers.items()
        if header is not None
        for span in header[1]
    )
    step = max(1, -(-len(tensors) // MAX_TENSOR_SAMPLES))
    sampled: dict[str, list[tuple[int, int]]] = {}
    for name, span in tensors[::step]:
        sampled.setdefault(name, []).append(span)
    digest = hashlib.sha256(_DOMAIN)
    for path, name in files:
        header = headers[path]
        header_end = 0 if header is None else header[0]
        _update_file(digest, path, name, header_end, sampled.get(str(path), []))
    return digest.hexdigest()


def _is_weights(path: Path) -> bool:
    return path.suffix in WEIGHT_SUFFIXES


def _model_files(root: Path) -> Iterator[tuple[Path, str]]:
    """The files that shape the KV, sorted by relative path; hidden files and folders (`.git`,
    a local download's `.cache`) are not part of the model."""
    found, seen = [], set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        info = os.stat(folder)
        if (info.st_dev, info.st_ino) in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            suffix = os.path.splitext(name)[1]
            if name.startswith(".") or name in NOT_KV_FILES:
                continue
            if suffix in WEIGHT_SUFFIXES or suffix in WHOLE_SUFFIXES:
                path = Path(folder, name)
                found.append((path.relative_to(root).as_posix(), path))
    for rel, path in sorted(found):
        yield path, rel


def _safetensors_header(path: Path) -> tuple[int, list[tuple[int, int]]] | None:
    """Where a safetensors file's header ends and its tensors' absolute byte ranges; None if
    the file is not one."""
    if path.suffix != ".safetensors":
        return None
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            return None
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            return None
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return None
    if not isinstance(header, dict):
        return None
    end = 8 + length
    spans = []
    for key, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if key == "__metadata__" or not isinstance(offsets, list) or len(offsets) != 2:
            continue
        if not all(isinstance(o, int) for o in offsets):
            continue
        begin, stop = end + offsets[0], end + offsets[1]
        if end <= begin < stop <= size:
            spans.append((begin, stop))
    return end, spans


def _update_file(
    digest: Any, path: Path, name: str, header_end: int, tensors: list[tuple[int, int]]
) -> None:
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        _record(digest, b"file", name.encode(), str(size).encode())
        if path.suffix in WHOLE_SUFFIXES and size <= WHOLE_LIMIT:
            _record(digest, b"whole", _pread(fd, size, 0))
            return
        for offset, length in sample_ranges(size, header_end, tensors):
            _record(digest, str(offset).encode(), _pread(fd, length, offset))


def sample_ranges(
    size: int, header_end: int = 0, tensors: list[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """The sorted, merged `(offset, length)` ranges read from a weight file of `size` bytes:
    its edges, its strided pages, its safetensors header (which ends at `header_end`; 0: none)
    and the first and last page of each of the sampled `tensors` (absolute byte ranges)."""
    ranges = [(0, max(EDGE_BYTES, header_end)), (size - EDGE_BYTES, size)]
    ranges += [
        (size * i // (STRIDED_PAGES + 1), size * i // (STRIDED_PAGES + 1) + PAGE_BYTES)
        for i in range(1, STRIDED_PAGES + 1)
    ]
    for begin, end in tensors or []:
        ranges += [(begin, begin + PAGE_BYTES), (end - PAGE_BYTES, end)]
    merged: list[list[int]] = []
    for begin, end in sorted((max(0, b), min(size, e)) for b, e in ranges):
        if begin >= end:
            continue
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(begin, end - begin) for begin, end in merged]


def _record(digest: Any, *fields: bytes) -> None:
    for field in fields:
        digest.update(struct.pack("<Q", len(field)))
        digest.update(field)


def _pread(fd: int, length: int, offset: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 24), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    import sys
    import time

    start = time.perf_counter()
    identity = model_identity(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    print(identity, f"({time.perf_counter() - start:.3f} s)")
