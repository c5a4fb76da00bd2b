"""What the harness's "forward" writes into the engine's KV cache, and the check of it.

A real model's KV for a token depends on every token up to it. The harness keeps that property
with no model: the bytes of token `p` of a request, in every layer, are a function of a rolling
hash of the request's tokens `0..p`. Two requests that share a prefix therefore write identical
bytes for it (what makes a prefix cache hit, and a load, meaningful), a token after a divergence
writes other bytes, and the harness can say what every engine block should hold at any time.

Values are 24-bit integers stored as float32 (exact), so a comparison is bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["TokenContent", "token_values"]

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED = np.uint64(17)
"""Every request starts from the same hash: equal prefixes, equal bytes."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def token_values(hashes: np.ndarray, layers: int, width: int) -> np.ndarray:
    """float32 `(len(hashes), layers, width)`: the KV of tokens whose prefix hashes are given."""
    with np.errstate(over="ignore"):
        lanes = np.arange(layers * width, dtype=np.uint64).reshape(layers, width)
        x = _mix(hashes[:, None, None] + (lanes + np.uint64(1)) * _GOLDEN)
    return (x >> np.uint64(40)).astype(np.float32)


class TokenContent:
    """The KV bytes of one request's tokens, as far as its tokens are known. Harness thread."""

    def __init__(self, layers: int, width: int) -> None:
        self.layers = layers
        self.width = width
        self.tokens: list[int] = []
        self._hashes = np.zeros(0, dtype=np.uint64)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens
        previous = self._hashes[-1] if len(self._hashes) else _SEED
        new = np.empty(len(tokens), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i, token in enumerate(tokens):
                previous = _mix(np.array([previous ^ (np.uint64(token) * _GOLDEN)]))[0]
                new[i] = previous
        self._hashes = np.concatenate([self._hashes, new])

    def values(self, start: int, end: int) -> torch.Tensor:
        """float32 `(end - start, layers, width)` for token positions `start..end`."""
        assert end <= len(self._hashes), (end, len(self._hashes))
        return torch.from_numpy(token_values(self._hashes[start:end], self.layers, self.width))

    def prefix_hash(self, position: int) -> int:
        """The rolling hash of tokens `0..position`: what the next sampled token is made from."""
        return int(self._hashes[position])
