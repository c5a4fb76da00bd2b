"""The conformance suite every tier inherits (pytest), shipped for authors of backends.

    from tiering.testing import TierConformance

    class TestMyTier(TierConformance):
        @pytest.fixture
        def make_tier(self, tmp_path):
            def make(**options):           # a fresh tier object on the same storage each call
                return MyTier(namespace=NAMESPACE, root=tmp_path, **options)
            return make

        async def raw_put(self, tier, key, blob): ...   # store object bytes, bypassing `tier`
        async def raw_get(self, tier, key): ...         # stored object bytes or None, likewise
        # optional: raw_put_large(tier, key, head, size): an object of `size` bytes that
        # starts with `head`, as cheaply as the store allows (the file tier: a sparse file)

`make_tier` is called inside the test's event loop (tiers may bind to it); options it passes on
are `capacity`, `read_only`, `codec` and `secret`. Every test runs its body with `asyncio.run`.

The suite attacks the tier as a stranger with write access to its store would: objects whose
header is self-consistent but lies about the payload (`crafted_objects`: empty, short, long,
huge claimed lengths, offsets past the end, another block's key, compression bombs), objects
far larger than any block, and objects without a valid MAC. Each must be a counted miss,
deleted unless the tier is read-only, and must cost no more than a bounded amount of memory
(`PEAK_BYTES`, measured with tracemalloc) whatever it claims.
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
import xxhash

from tiering.errors import CorruptObject, KeyFormatError, StateError, TierFull
from tiering.format import CODECS, FIXED_FIELDS, MAGIC, MAX_BLOCK_BYTES, checksum, encode, mac_key
from tiering.keys import FORMAT_VERSION, BlockKey, make_key
from tiering.tier import Tier

__all__ = [
    "NAMESPACE",
    "OTHER_NAMESPACE",
    "PEAK_BYTES",
    "SECRET",
    "TierConformance",
    "craft",
    "key",
    "peak_memory",
]

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(1, 17))
SECRET = b"kvtier-conformance-secret"
OTHER_SECRET = b"someone-else's-secret-entirely"
MakeTier = Callable[..., Tier]
PEAK_BYTES = 8 << 20
"""The most memory (traced by tracemalloc) one refused read of a crafted object may take, whatever
it claims: a read allocates at most what a block of the caller's size allows."""
CRAFTED_BLOCK = 256 << 10
"""Block size of the crafted-object tests (a typical offload block)."""
LARGE_OBJECT = 32 << 20
"""Size of the oversized objects planted by the default `raw_put_large` (a stand-in for the
2 GiB sparse file a file tier's hook plants)."""
T = TypeVar("T")


def key(i: int, group: int = 0) -> BlockKey:
    return make_key(i.to_bytes(4, "big") + bytes(28), group)


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible bytes."""
    return random.Random(seed * 1_000_003 + size).randbytes(size)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def craft(
    k: BlockKey,
    payload: bytes,
    *,
    namespace: bytes = NAMESPACE,
    codec: str = "raw",
    stored: int | None = None,
    raw: int | None = None,
    offset: int | None = None,
    align: int = 1,
    checksum_of: bytes | None = None,
    mac_secret: bytes | None = None,
) -> bytes:
    """An object whose header says what the arguments say, with valid header and payload
    checksums (what anyone can compute): `stored`/`raw` lengths default to the payload's,
    `offset` to the aligned end of the header, the checksum to the payload's own. Written apart
    from `encode` on purpose: an attacker's object must not share the writer's bugs."""
    stored = len(payload) if stored is None else stored
    raw = stored if raw is None else raw
    kind = 0x80 if mac_secret is not None else 0
    header_end = 66 + len(k) + (32 if mac_secret is not None else 0)
    offset = -(-header_end // align) * align if offset is None else offset
    fields = FIXED_FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        CODECS.index(codec),
        kind,
        len(k),
        offset,
        namespace,
        stored,
        raw,
        checksum("xxh3", payload if checksum_of is None else checksum_of),
        0,
    )
    header = fields[:58] + xxhash.xxh3_64_intdigest(fields[:58] + k).to_bytes(8, "little") + k
    if mac_secret is not None:
        import hashlib
        import hmac

        header += hmac.new(mac_key(mac_secret), header + payload, hashlib.sha256).digest()
    header += bytes(max(0, min(offset, 1 << 16) - len(header)))
    return header + payload


async def peak_memory(call: Awaitable[T]) -> tuple[T, int]:
    """`call`'s result and the peak of memory traced while it ran (bytes above the start)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = await call
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()


class TierConformance:
    """The behaviour every tier must show. Subclasses provide `make_tier`, `raw_put` and
    `raw_get`; tests of capabilities a tier does not declare are skipped for it."""

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        raise NotImplementedError("a TierConformance subclass provides the make_tier fixture")

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        raise NotImplementedError("a TierConformance subclass provides raw_put")

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        raise NotImplementedError("a TierConformance subclass provides raw_get")

    async def raw_put_large(self, tier: Tier, key: BlockKey, head: bytes, size: int) -> None:
        """Store an object of `size` bytes that starts with `head` (zeros after it), bypassing
        `tier`. Override where the store can make one cheaply (a sparse file)."""
        await self.raw_put(tier, key, head + bytes(size - len(head)))

    large_object_bytes = LARGE_OBJECT
    """The size `raw_put_large` is asked for (a subclass with sparse files asks for more)."""

    def object(self, tier: Tier, k: BlockKey, data: bytes, namespace: bytes | None = None) -> bytes:
        header, body = encode(k, namespace or tier.namespace, data, align=tier.align)
        return header + bytes(body)

    # -- round trips ----------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65539, 2 << 20, 8 << 20])
    def test_round_trip(self, make_tier: MakeTier, size: int) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                data = payload(size, seed=size)
                await tier.put(key(size), data)
                into = bytearray(size)
                assert await tier.get(key(size), into) is True
                assert into == data
                assert tier.counters["hits"] == 1

        run(body())

    def test_round_trip_into_a_memoryview_slice(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                data = payload(8192, seed=3)
                await tier.put(key(1), memoryview(data))
                region = bytearray(3 * 8192)
                assert await tier.get(key(1), memoryview(region)[8192:16384])
                assert region[8192:16384] == data and not any(region[:8192])

        run(body())

    def test_compressed_codecs(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            for codec in ("lz4", "zstd"):
                async with make_tier(codec=codec) as tier:
                    data = bytes(100_000)  # compresses well
                    await tier.put(key(7), data)
                    assert await tier.get_bytes(key(7), len(data)) == data
                    stored = await self.raw_get(tier, key(7))
                    assert stored is not None and len(stored) < 10_000

        run(body())

    def test_miss_is_a_miss(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                into = bytearray(b"untouched")
                assert await tier.get(key(404), into) is False
                assert into == b"untouched"
                assert tier.counters["misses"] == 1 and not any(
                    k.startswith("corrupt") for k in tier.counters
                )

        run(body())

    def test_overwrite(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(5000, 1))
                await tier.put(key(1), payload(5000, 2))
                assert await tier.get_bytes(key(1), 5000) == payload(5000, 2)
                assert (await tier.stat()).objects == 1

        run(body())

    def test_delete(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), b"x" * 100)
                assert await tier.delete(key(1)) is True
                assert await tier.delete(key(1)) is False
                assert await tier.get_bytes(key(1), 100) is None
                assert await self.raw_get(tier, key(1)) is None

        run(body())

    def test_contains_is_batched(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put_many([(key(i), b"v" * 10) for i in range(0, 20, 2)])
                assert await tier.contains([key(i) for i in range(20)]) == [
                    i % 2 == 0 for i in range(20)
                ]
                assert await tier.contains([]) == []

        run(body())

    def test_batches(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                results = await tier.put_many([(key(i), payload(3000, i)) for i in range(40)])
                assert results == [None] * 40
                buffers = [bytearray(3000) for _ in range(41)]
                found = await tier.get_many([(key(i), buffers[i]) for i in range(41)])
                assert found == [True] * 40 + [False]
                assert all(buffers[i] == payload(3000, i) for i in range(40))
                assert await tier.delete_many([key(0), key(999)]) == [True, False]

        run(body())

    def test_invalid_keys_are_rejected(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                for bad in ("not-hex", "ABCDEF0123456789AB", "../../etc/passwd", "0" * 7):
                    with pytest.raises(KeyFormatError):
                        await tier.put(bad, b"x")
                    with pytest.raises(KeyFormatError):
                        await tier.get(bad, bytearray(1))
                await tier.put(key(5).hex(), b"by hex")
                assert await tier.get_bytes(key(5), 6) == b"by hex"

        run(body())

    # -- verification -----------------------------------------------------------------------------

    def corrupt_variants(self, tier: Tier, k: BlockKey, data: bytes) -> dict[str, bytes]:
        good = self.object(tier, k, data)
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        old_version = bytearray(good)
        old_version[8:10] = (99).to_bytes(2, "little")
        return {
            "checksum": bytes(flipped),
            "truncated": good[:-7],
            "namespace": self.object(tier, k, data, namespace=OTHER_NAMESPACE),
            "version": bytes(old_version),
            "magic": b"garbage" * 20,
            "key": self.object(tier, key(12345), data),
        }

    def test_corrupt_and_foreign_objects_are_misses_and_deleted(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                data = payload(4096, 9)
                for i, reason in enumerate(self.corrupt_variants(tier, key(1), data)):
                    k = key(100 + i)
                    await self.raw_put(tier, k, self.corrupt_variants(tier, k, data)[reason])
                    assert await tier.get(k, bytearray(4096)) is False, reason
                    assert tier.counters[f"corrupt.{reason}"] == 1, reason
                    assert await self.raw_get(tier, k) is None, f"{reason}: not deleted"
                assert tier.counters["hits"] == 0

        run(body())

    def test_batches_verify_like_single_calls(self, make_tier: MakeTier) -> None:
        """Backends that batch their own way (pipelines, grouped I/O) refuse, count and delete
        corrupt objects item by item, like `get`; the good ones around them still arrive."""

        async def body() -> None:
            async with make_tier() as tier:
                data = [payload(4096, i) for i in range(5)]
                good = [(key(i), data[i]) for i in (0, 2, 4)]
                assert await tier.put_many(good) == [None] * 3
                bad = self.corrupt_variants(tier, key(1), data[1])["checksum"]
                await self.raw_put(tier, key(1), bad)
                short = self.corrupt_variants(tier, key(3), data[3])["truncated"]
                await self.raw_put(tier, key(3), short)
                buffers = [bytearray(4096) for _ in range(6)]
                found = await tier.get_many([(key(i), buffers[i]) for i in range(6)])
                assert found == [True, False, True, False, True, False], found
                assert all(buffers[i] == data[i] for i in (0, 2, 4))
                assert tier.counters["corrupt.checksum"] == 1
                assert tier.counters["corrupt.truncated"] == 1
                assert await self.raw_get(tier, key(1)) is None
                assert await self.raw_get(tier, key(3)) is None

        run(body())

    def test_capacity_holds_for_batches(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(capacity=1 << 20) as tier:
                if not tier.evicts:
                    return
                blocks = [(key(i), payload(200_000, i)) for i in range(8)]
                assert await tier.put_many(blocks[:4]) == [None] * 4
                assert await tier.put_many(blocks[4:]) == [None] * 4
                stat = await tier.stat()
                assert stat.bytes_used <= 1 << 20
                assert (await tier.contains([key(i) for i in range(8)]))[4:] == [True] * 4
                too_big = await tier.put_many([(key(20), payload(2 << 20)), blocks[0]])
                assert isinstance(too_big[0], TierFull) and too_big[1] is None

        run(body())

    def test_a_block_of_another_size_is_refused(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(4096))
                assert await tier.get(key(1), bytearray(8192)) is False
                assert tier.counters["corrupt.length"] == 1

        run(body())

    # -- crafted objects: what a stranger with write access to the store can plant ---------------

    def crafted_objects(self, tier: Tier, k: BlockKey, size: int) -> dict[str, tuple[str, bytes]]:
        """Objects for a block of `size` at `k` that must each be refused: name -> (reason,
        object bytes). Each header is self-consistent (valid checksums) and lies."""
        import lz4.frame
        import zstandard

        data = payload(size, 11)
        align = tier.align
        good = self.object(tier, k, data)
        lz4_bomb = lz4.frame.compress(bytes(128 * size), store_size=False)
        zstd_bomb = zstandard.ZstdCompressor().compress(bytes(256 * size))
        zstd_unsized = zstandard.ZstdCompressor(write_content_size=False).compress(
            bytes(256 * size)
        )
        return {
            # the hole that served stale slot bytes as a hit: raw, stored 0, raw = block size
            "empty": ("length", craft(k, b"", raw=size, align=align)),
            "short": ("truncated", craft(k, data[: size // 2], stored=size, align=align)),
            # cut at its payload offset, with the checksum of the caller's (zeroed) buffer:
            # once taken for "header read, payload placed", the untouched buffer served
            "header only": (
                "truncated",
                craft(k, b"", stored=size, raw=size, checksum_of=bytes(size), align=align),
            ),
            "long": ("length", good + b"\0" * 4096),
            "huge claimed length": (
                "length",
                craft(k, data, stored=1 << 40, raw=1 << 40, checksum_of=data, align=align),
            ),
            "claimed block larger than any": (
                "length",
                craft(k, data, raw=MAX_BLOCK_BYTES + 1, align=align, stored=size),
            ),
            "stored longer than raw": (
                "length",
                craft(k, data + b"xx", codec="lz4", raw=size, align=align),
            ),
            "offset past the end": ("length", craft(k, data, offset=1 << 30, align=align)),
            "offset inside the payload": (
                "truncated",
                craft(k, data, offset=60_000)[: 66 + len(k)] + data,
            ),
            "key of another block": ("key", self.object(tier, key(424242), data)),
            "lz4 bomb": ("length", craft(k, lz4_bomb, codec="lz4", raw=size, align=align)),
            "zstd bomb": ("length", craft(k, zstd_bomb, codec="zstd", raw=size, align=align)),
            "zstd bomb without size": (
                "length",
                craft(k, zstd_unsized, codec="zstd", raw=size, align=align),
            ),
        }

    @pytest.mark.parametrize(
        "case",
        [
            "empty",
            "short",
            "header only",
            "long",
            "huge claimed length",
            "claimed block larger than any",
            "stored longer than raw",
            "offset past the end",
            "offset inside the payload",
            "key of another block",
            "lz4 bomb",
            "zstd bomb",
            "zstd bomb without size",
        ],
    )
    @pytest.mark.parametrize("codec", ["raw", "lz4"])
    def test_crafted_objects_are_refused(self, make_tier: MakeTier, case: str, codec: str) -> None:
        """Through the fast path (a raw tier reading into the caller's buffer) and the
        decoding one (an lz4 tier): a counted miss, deleted, memory bounded, the block unused."""

        async def body() -> None:
            async with make_tier(codec=codec) as tier:
                k = key(7)
                reason, blob = self.crafted_objects(tier, k, CRAFTED_BLOCK)[case]
                await self.raw_put(tier, k, blob)
                into = bytearray(CRAFTED_BLOCK)
                found, peak = await peak_memory(tier.get(k, into))
                assert found is False, case
                assert tier.counters[f"corrupt.{reason}"] == 1, (case, dict(tier.counters))
                assert tier.counters["hits"] == 0
                assert peak < PEAK_BYTES + CRAFTED_BLOCK, (case, peak)
                assert await self.raw_get(tier, k) is None, f"{case}: not deleted"

        run(body())

    def test_crafted_objects_in_batches(self, make_tier: MakeTier) -> None:
        """Batched reads (each backend's own pipelines, groups and runs) refuse every crafted
        object item by item; the good blocks among them still arrive."""

        async def body() -> None:
            async with make_tier() as tier:
                size = CRAFTED_BLOCK
                cases = list(self.crafted_objects(tier, key(0), size))
                good = [(key(1000 + i), payload(size, i)) for i in range(3)]
                assert await tier.put_many(good) == [None] * 3
                for i, case in enumerate(cases):
                    k = key(i)
                    await self.raw_put(tier, k, self.crafted_objects(tier, k, size)[case][1])
                keys = [key(i) for i in range(len(cases))] + [k for k, _ in good]
                buffers = [bytearray(size) for _ in keys]
                found, peak = await peak_memory(
                    tier.get_many(list(zip(keys, buffers, strict=True)))
                )
                assert found == [False] * len(cases) + [True] * 3, found
                assert all(bytes(buffers[-3 + i]) == good[i][1] for i in range(3))
                refused = sum(v for n, v in tier.counters.items() if n.startswith("corrupt."))
                assert refused == len(cases), dict(tier.counters)
                assert peak < PEAK_BYTES + (len(keys) + 1) * size, peak

        run(body())

    def test_an_object_far_larger_than_its_block_is_not_read(self, make_tier: MakeTier) -> None:
        """An object whose header claims a small block but which is huge (a sparse file of
        gigabytes, a 32 MiB value): refused from its size, without reading or allocating it,
        by single and batched reads; an operator's `read_head` reads only its head, and
        `read_object` refuses one larger than any block may be."""

        async def body() -> None:
            async with make_tier() as tier:
                size = 32 << 10
                k, good = key(3), key(4)
                head = self.object(tier, k, payload(size, 3))[:4096]
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                found, peak = await peak_memory(tier.get(k, bytearray(size)))
                assert found is False and tier.counters["corrupt.length"] == 1, tier.counters
                assert peak < PEAK_BYTES, peak
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                await tier.put(good, payload(size, 4))
                buffers = [bytearray(size), bytearray(size)]
                batch, peak = await peak_memory(
                    tier.get_many([(k, buffers[0]), (good, buffers[1])])
                )
                assert batch == [False, True] and buffers[1] == payload(size, 4)
                assert tier.counters["corrupt.length"] == 2 and peak < PEAK_BYTES, peak
                await self.raw_put_large(tier, k, head, self.large_object_bytes)
                got, peak = await peak_memory(tier.read_head(k))
                assert got is not None and got[0][:100] == head[:100]
                assert got[1] == self.large_object_bytes and peak < PEAK_BYTES, peak
                if self.large_object_bytes > tier.object_limit(MAX_BLOCK_BYTES):
                    with pytest.raises(CorruptObject, match="length"):
                        await tier.read_object(k)

        run(body())

    # -- authenticated objects -------------------------------------------------------------------

    def test_authenticated_round_trip(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(secret=SECRET) as tier:
                assert tier.authenticated
                data = payload(CRAFTED_BLOCK, 5)
                await tier.put(key(1), data)
                await tier.put_many([(key(2), data), (key(3), data)])
                into = bytearray(CRAFTED_BLOCK)
                assert await tier.get(key(1), into) and into == data
                buffers = [bytearray(CRAFTED_BLOCK) for _ in range(2)]
                found = await tier.get_many([(key(2), buffers[0]), (key(3), buffers[1])])
                assert found == [True, True] and buffers == [data, data]
                stored = await self.raw_get(tier, key(1))
                assert stored is not None and stored[11] & 0x80  # the MAC flag
                lasting = tier.persistent or tier.shared
            if lasting:
                async with make_tier() as plain:  # a reader without the secret ignores the MAC
                    assert await plain.get_bytes(key(1), CRAFTED_BLOCK) == data

        run(body())

    def test_objects_without_a_valid_mac_are_refused(self, make_tier: MakeTier) -> None:
        """With a secret, what a stranger can plant with valid checksums is a counted miss:
        an object with no MAC, one under another secret, and one whose payload was altered
        with its checksums recomputed; through `get` and `get_many` alike."""

        async def body() -> None:
            async with make_tier(secret=SECRET) as tier:
                size = CRAFTED_BLOCK
                data = payload(size, 6)
                altered = bytearray(data)
                altered[100] ^= 1
                ours = craft(key(9), data, align=tier.align, mac_secret=SECRET)
                planted = {
                    key(1): self.object(tier, key(1), data),
                    key(2): craft(key(2), data, align=tier.align, mac_secret=OTHER_SECRET),
                    key(3): _with_payload(
                        craft(key(3), data, align=tier.align, mac_secret=SECRET), bytes(altered)
                    ),
                }
                for k, blob in planted.items():
                    await self.raw_put(tier, k, blob)
                await self.raw_put(tier, key(9), ours)
                assert await tier.get(key(1), bytearray(size)) is False
                found = await tier.get_many([(key(i), bytearray(size)) for i in (2, 3, 9)])
                assert found == [False, False, True], found
                assert tier.counters["corrupt.auth"] == 3, dict(tier.counters)
                for k in planted:
                    assert await self.raw_get(tier, k) is None

        run(body())

    def test_read_only(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as writer:
                await writer.put(key(1), b"kept")
            async with make_tier(read_only=True) as tier:
                with pytest.raises(StateError, match="read-only"):
                    await tier.put(key(2), b"x")
                with pytest.raises(StateError, match="read-only"):
                    await tier.delete(key(1))
                await self.raw_put(tier, key(3), b"garbage" * 10)
                assert await tier.get(key(3), bytearray(4)) is False
                assert await self.raw_get(tier, key(3)) is not None  # refused, but not deleted
                if tier.persistent or tier.shared:
                    assert await tier.get_bytes(key(1), 4) == b"kept"

        run(body())

    # -- concurrency ------------------------------------------------------------------------------

    def test_concurrent_puts_and_gets_never_tear(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                size = 256 << 10
                versions = [payload(size, seed) for seed in range(4)]
                await tier.put(key(1), versions[0])

                async def reader() -> None:
                    for _ in range(12):
                        got = await tier.get_bytes(key(1), size)
                        assert got in versions

                async def writer(i: int) -> None:
                    for _ in range(6):
                        await tier.put(key(1), versions[i])

                await asyncio.gather(*(reader() for _ in range(3)), *(writer(i) for i in range(4)))
                assert not any(k.startswith("corrupt") for k in tier.counters), tier.counters

        run(body())

    # -- capabilities ---------------------------------------------------------------------------

    def test_capacity_evicts_least_recently_used(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier(capacity=1 << 20) as tier:
                if not tier.evicts:  # the server or service enforces its own limits
                    assert (await tier.stat()).capacity == 1 << 20
                    return
                for i in range(6):
                    await tier.put(key(i), payload(200_000, i))
                    if i == 3:
                        assert await tier.get_bytes(key(0), 200_000) is not None  # a use
                stat = await tier.stat()
                assert stat.bytes_used <= 1 << 20 and stat.capacity == 1 << 20
                present = await tier.contains([key(i) for i in range(6)])
                assert present[0] and present[4] and present[5]  # used, and newest
                assert not present[1]  # least recently used
                assert tier.counters["evictions"] >= 1

        run(body())

    def test_listing(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                if not tier.supports_listing:
                    with pytest.raises(StateError):
                        [k async for k in tier.keys()]
                    return
                wanted = {key(i, group=i % 2) for i in range(25)}
                for k in wanted:
                    await tier.put(k, b"v")
                assert {k async for k in tier.keys()} == wanted
                assert (await tier.stat()).objects == 25

        run(body())

    def test_close_and_reopen(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                await tier.put(key(1), payload(10_000, 1))
                persistent = tier.persistent
            async with make_tier() as again:
                found = await again.get_bytes(key(1), 10_000)
                if persistent:
                    assert found == payload(10_000, 1)

        run(body())

    def test_stat_counts_objects_and_bytes(self, make_tier: MakeTier) -> None:
        async def body() -> None:
            async with make_tier() as tier:
                for i in range(3):
                    await tier.put(key(i), payload(1000 * (i + 1), i))
                stat = await tier.stat()
                assert stat.objects == 3
                assert stat.bytes_used >= 6000

        run(body())


def _with_payload(blob: bytes, payload: bytes) -> bytes:
    """`blob` (a crafted object) with its payload replaced and both checksums recomputed, its
    MAC left as it was: what an attacker who cannot compute MACs can do."""
    offset = int.from_bytes(blob[14:18], "little")
    key_len = int.from_bytes(blob[12:14], "little")
    header = bytearray(blob[:offset])
    header[50:58] = checksum("xxh3", payload).to_bytes(8, "little")
    key_bytes = bytes(header[66 : 66 + key_len])
    header[58:66] = xxhash.xxh3_64_intdigest(bytes(header[:58]) + key_bytes).to_bytes(8, "little")
    return bytes(header) + payload
