"""Model folders written by hand for the tests of model identity and of engine start (test
process): a config, a tokenizer and random weights in the safetensors format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

SHAPES = {"embed": (1000, 128), "layer.0.q": (128, 128), "layer.0.k": (64, 128), "norm": (128,)}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format by hand: an 8-byte length, a JSON header, the tensors' bytes."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_model(path: Path, seed: int = 0, shapes: dict[str, tuple[int, ...]] = SHAPES) -> Path:
    """A model folder: config, tokenizer, random weights of a fixed shape (so two seeds differ
    only in the weight bytes: same config, same header, same sizes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    (path / "tokenizer.json").write_text(json.dumps({"vocab": ["a", "b"]}))
    rng = np.random.default_rng(seed)
    write_safetensors(
        path / "model.safetensors", {k: rng.standard_normal(s) for k, s in shapes.items()}
    )
    return path
