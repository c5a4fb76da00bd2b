"""Block keys and namespaces.

A **block key** is `bytes`: vLLM's chained block hash followed by the 4-byte big-endian index of
the KV-cache group, exactly vLLM 0.32's `OffloadKey` (`make_offload_key`), so keys cross the
connector without conversion. Its hex form is what tiers store and what operators type; the path
form fans files out under a directory by the leading bytes of the hash.

A **namespace** is a digest of everything that makes KV bytes interchangeable between two
engines (`Layout`). Stored objects carry it; a different namespace is a miss, never a load.

A **store namespace** is the namespace as it appears in a store's names and objects. Without a
deployment secret it is the layout's namespace; with one it is the layout's namespace under that
secret (`store_namespace`): its first `NAMESPACE_LABEL_BYTES` bytes, then a label keyed by the
secret over them. Deployments with different secrets (or none, or a secret before and after a
rotation) never share a name, so no writer without the secret can occupy a name its owner will
use; and a holder of the secret can tell a store namespace of its own from anyone else's
(`owns_namespace`) without knowing the layout, as an operator's command given a namespace must.

Everything here is deterministic across processes, machines and Python versions: digests come
from SHA-256 over a canonical JSON encoding, never from `hash()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import NewType

from tiering.errors import ConfigError, KeyFormatError

__all__ = [
    "FORMAT_VERSION",
    "GROUP_BYTES",
    "MAX_HASH_BYTES",
    "NAMESPACE_BYTES",
    "NAMESPACE_LABEL_BYTES",
    "BlockKey",
    "Layout",
    "key_from_hex",
    "key_from_path",
    "key_group",
    "key_hash",
    "key_hex",
    "key_path",
    "make_key",
    "owns_namespace",
    "store_namespace",
]

BlockKey = NewType("BlockKey", bytes)
"""vLLM's block hash bytes followed by the KV-group index as 4 big-endian bytes."""

GROUP_BYTES = 4
"""Width of the KV-group index at the end of a key (vLLM's `make_offload_key`)."""

MAX_HASH_BYTES = 64
"""Longest block hash accepted from outside (sha512); vLLM's default sha256 gives 32."""

NAMESPACE_BYTES = 16
"""Length of a namespace digest (a truncated SHA-256: 128 bits, collision-free in practice)."""

NAMESPACE_LABEL_BYTES = 8
"""Length of the label a secret keys a store namespace with (`store_namespace`): forging one
without the secret takes 2**64 tries; the namespace bytes it keeps (the other 8) tell layouts
apart within a deployment (a collision between two layouts of one store: ~n**2 / 2**65)."""

FORMAT_VERSION = 1
"""Version of kvtier's on-tier object format and KV byte layout. Part of every namespace, so a
format change makes old objects foreign (a miss) instead of misread."""

_HEX_DIGITS = frozenset("0123456789abcdef")
_NAMESPACE_DOMAIN = b"kvtier-namespace\x00"
_NAMES_DOMAIN = b"kvtier names under a secret v1\x00"


def make_key(block_hash: bytes, group: int = 0) -> BlockKey:
    """Build the key of a block from vLLM's block hash and the KV-cache group index."""
    if not block_hash:
        raise KeyFormatError("block hash is empty")
    if len(block_hash) > MAX_HASH_BYTES:
        raise KeyFormatError(
            f"block hash is {len(block_hash)} bytes; at most {MAX_HASH_BYTES} are accepted"
        )
    if not 0 <= group < 1 << (8 * GROUP_BYTES):
        raise KeyFormatError(f"KV group index {group} does not fit in {GROUP_BYTES} bytes")
    return BlockKey(bytes(block_hash) + group.to_bytes(GROUP_BYTES, "big"))


def key_hash(key: BlockKey) -> bytes:
    """The block-hash part of a key."""
    return key[:-GROUP_BYTES]


def key_group(key: BlockKey) -> int:
    """The KV-cache group index of a key."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def key_hex(key: BlockKey) -> str:
    """Lowercase hex of the whole key: the canonical text form stored by tiers."""
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    """Parse the canonical hex form of a key; anything else raises `KeyFormatError`.

    Only lowercase hex is canonical: accepting other spellings would give one block two names
    (two files, two Redis keys).
    """
    if not isinstance(text, str):
        raise KeyFormatError(f"key must be a hex string, got {type(text).__name__}")
    bad = set(text) - _HEX_DIGITS
    if bad:
        shown = "".join(sorted(bad))[:8]
        raise KeyFormatError(f"key {text[:80]!r} is not lowercase hex (bad characters {shown!r})")
    if len(text) % 2:
        raise KeyFormatError(f"key {text[:80]!r} has an odd number of hex digits")
    n = len(text) // 2
    if not GROUP_BYTES < n <= GROUP_BYTES + MAX_HASH_BYTES:
        raise KeyFormatError(
            f"key {text[:80]!r} is {n} bytes; a key is a 1-{MAX_HASH_BYTES} byte hash "
            f"plus a {GROUP_BYTES}-byte group index"
        )
    return BlockKey(bytes.fromhex(text))


def key_path(key: BlockKey, levels: int = 2) -> str:
    """A relative, path-safe file name for a key, fanned out by its leading hash bytes.

    `levels` directories of one byte each (256 entries per level) keep directories small:
    `ab/cd/abcd…0000.kv`-style names without the extension, e.g. `ab/cd/abcd…00000000`.
    """
    text = key.hex()
    if len(key) - GROUP_BYTES < levels:
        raise KeyFormatError(f"key {text!r} is too short for {levels} fan-out levels")
    parts = [text[2 * i : 2 * i + 2] for i in range(levels)]
    return "/".join([*parts, text])


def key_from_path(path: str) -> BlockKey:
    """Inverse of `key_path`: the key named by the last component of a relative path."""
    return key_from_hex(path.rsplit("/", 1)[-1])


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The layout facts that make KV bytes interchangeable, their digest the namespace (any
    process, any thread: a value).

    Two engines may share a block only when every field is equal. The model is named by what it
    is, never by where it lies (`connectors.identity.model_identity`): the same weights served
    from two paths share their blocks, and new weights written over a path share none of the old
    ones. The digest covers the field names, so adding, removing or renaming a field changes every
    namespace by itself: blocks stored under the old definition become foreign (a miss, never a
    misread). `FORMAT_VERSION` changes with the object format and the KV byte layout.
    """

    model: str
    """Model identity, independent of its path: `hf:<repo>@<commit>` for a Hugging Face hub
    snapshot, `sha256:<hex>` over a sample of a local model's files (configuration, safetensors
    headers, sizes and weight bytes), or `name:<model>@<revision>` when nothing is local."""
    model_dtype: str
    """The dtype the model computes in (`float32`, `bfloat16`); with a quantized KV cache, KV
    from a model computing in another dtype differs. A `torch.` prefix is dropped."""
    model_options: str
    """Engine settings that change the model's KV for given weights, as canonical JSON
    (quantization method, `hf_overrides`, a speculative decoder's draft model identity)."""
    dtype: str
    """KV-cache dtype as vLLM names it (`bfloat16`, `fp8_e4m3`); a `torch.` prefix is dropped."""
    kv_layout: str
    """The engine's KV-cache memory layout (vLLM 0.32: `LBHNC`), which fixes the byte order."""
    page_size_bytes: int
    """Bytes of one engine block on one worker, all layers, padding included."""
    tokens_per_block: int
    """Tokens in one kvtier block (one vLLM offload chunk: engine block size x blocks per chunk)."""
    num_layers: int
    """Attention layers whose KV the block holds."""
    num_kv_heads: int
    """KV heads of the whole model, before tensor-parallel sharding."""
    head_size: int
    """Elements per head."""
    tp_size: int
    """Tensor-parallel size: how the heads are split across workers' shards."""
    pp_size: int
    """Pipeline-parallel size: how the layers are split across workers' shards."""
    format_version: int = FORMAT_VERSION
    """kvtier's object format and byte-layout version (`FORMAT_VERSION`)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "str":
                if not isinstance(value, str):
                    raise ConfigError(
                        f"layout.{field.name}: expected a string, got {type(value).__name__}"
                    )
                if not value:
                    raise ConfigError(f"layout.{field.name}: must not be empty")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"layout.{field.name}: expected a positive integer, got {value!r}"
                )
        object.__setattr__(self, "dtype", self.dtype.removeprefix("torch."))
        object.__setattr__(self, "model_dtype", self.model_dtype.removeprefix("torch."))

    def canonical_json(self) -> bytes:
        """The canonical encoding the digest is computed from (sorted keys, no spaces, ASCII)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    def namespace(self) -> bytes:
        """The namespace digest: the first `NAMESPACE_BYTES` of SHA-256 over the canonical JSON."""
        return hashlib.sha256(_NAMESPACE_DOMAIN + self.canonical_json()).digest()[:NAMESPACE_BYTES]

    def namespace_hex(self) -> str:
        """The namespace digest in hex, as shown by the CLI and used in tier key prefixes."""
        return self.namespace().hex()


def store_namespace(namespace: bytes, secret: bytes | None) -> bytes:
    """The namespace the blocks of `namespace` (a layout's) are stored under with `secret`:
    `namespace` itself without one, else its first bytes followed by their label keyed by the
    secret. Idempotent: a store namespace of `secret` is its own."""
    if secret is None or owns_namespace(namespace, secret):
        return namespace
    kept = namespace[: NAMESPACE_BYTES - NAMESPACE_LABEL_BYTES]
    return kept + _label(kept, secret)


def owns_namespace(namespace: bytes, secret: bytes | None) -> bool:
    """Whether `namespace` is a store namespace of `secret` (`store_namespace`): its label is
    the secret's over its first bytes. Nothing is owned without a secret."""
    if secret is None or len(namespace) != NAMESPACE_BYTES:
        return False
    kept = namespace[: NAMESPACE_BYTES - NAMESPACE_LABEL_BYTES]
    return hmac.compare_digest(namespace[len(kept) :], _label(kept, secret))


def _label(kept: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, _NAMES_DOMAIN + kept, hashlib.sha256).digest()[:NAMESPACE_LABEL_BYTES]
