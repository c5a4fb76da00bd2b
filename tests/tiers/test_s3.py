"""The S3 tier against a real SeaweedFS server (`weed mini`, S3 gateway with signature auth):
the conformance suite with single objects and with packs of 4 blocks, multipart uploads,
ranged reads of packs, restarts, and a server that stops in the middle of a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.servers import SeaweedS3
from tests.tiers.s3_tiers import s3_tier
from tiering.errors import TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, key, payload
from tiering.testing.tier import MakeTier, StoreDown, TierConformance
from tiering.tier import Tier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.s3


def name(prefix: str, k: BlockKey, namespace: bytes = NAMESPACE) -> str:
    """The object name of block `k` stored alone (the naming of `tiers.s3`)."""
    text = k.hex()
    return f"{prefix}{namespace.hex()}/{text[:2]}/{text}"


@contextlib.contextmanager
def stopped(server: SeaweedS3) -> Iterator[None]:
    """The server stopped, then started again on the same ports and directory."""
    server.stop()
    try:
        yield
    finally:
        server.start()


class S3Hooks(TierConformance):
    """The white-box hooks: a raw boto3 client on the tier's bucket, and the tier's blocks
    in packs (pending in memory, or at a byte range of a pack object)."""

    raw: Any
    server: SeaweedS3
    bucket: str
    prefix: str

    def hooked(self, server: SeaweedS3, prefix: str) -> MakeTier:
        self.raw, self.bucket, self.prefix = server.client(), server.bucket, prefix
        self.server = server
        return lambda **options: s3_tier(server, prefix, **options)

    @pytest.fixture
    def store_down(self) -> StoreDown:
        return lambda tier: stopped(self.server)

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        """Store object bytes as they are, as a single object."""
        await asyncio.to_thread(
            self.raw.put_object,
            Bucket=self.bucket,
            Key=name(self.prefix, key, tier.namespace),
            Body=blob,
        )

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The stored object of `key`: pending bytes, its byte range in a pack, or the single
        object."""
        assert isinstance(tier, S3Tier)
        pending, packed = tier._packs.where(key)
        if pending is not None:
            return pending
        if packed is not None:
            pack, offset, length = packed
            return await asyncio.to_thread(self.read, pack, f"bytes={offset}-{offset + length - 1}")
        return await asyncio.to_thread(self.read, name(self.prefix, key, tier.namespace))

    def read(self, name: str, range: str | None = None) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            extra = {"Range": range} if range else {}
            response = self.raw.get_object(Bucket=self.bucket, Key=name, **extra)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "InvalidRange"):
                return None
            raise
        data: bytes = response["Body"].read()
        return data


class TestS3Tier(S3Hooks):
    @pytest.fixture
    def make_tier(self, s3_server: SeaweedS3) -> MakeTier:
        make = self.hooked(s3_server, f"t-{uuid.uuid4().hex[:8]}/")
        return make


class TestS3TierThatReplaces(S3Hooks):
    """Single objects without `write_once`: a put replaces."""

    @pytest.fixture
    def make_tier(self, s3_server: SeaweedS3) -> MakeTier:
        make = self.hooked(s3_server, f"r-{uuid.uuid4().hex[:8]}/")
        return lambda **options: make(write_once=False, **options)


class TestPackedS3Tier(S3Hooks):
    writes_behind = True

    @pytest.fixture
    def make_tier(self, s3_server: SeaweedS3) -> MakeTier:
        make = self.hooked(s3_server, f"p-{uuid.uuid4().hex[:8]}/")
        return lambda **options: make(blocks_per_object=4, **options)


def test_multipart_upload_of_a_large_block(s3_server: SeaweedS3) -> None:
    async def body() -> None:
        async with s3_tier(s3_server, "mp/", multipart_threshold="6MiB", part_size="5MiB") as tier:
            data = payload(13 << 20, 1)
            await tier.put(key(1), data)
            assert await tier.get_bytes(key(1), len(data)) == data

    asyncio.run(body())


def test_packs_hold_several_blocks_and_reads_take_their_range(s3_server: SeaweedS3) -> None:
    prefix = f"packs-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=4) as tier:
            for i in range(10):
                await tier.put(key(i), payload(30_000, i))
        client = s3_server.client()
        names = [
            o["Key"]
            for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]
        ]  # type: ignore[attr-defined]
        assert len(names) == 3 and all("/packs/" in n for n in names)  # 4 + 4 + 2 at close
        async with s3_tier(s3_server, prefix, blocks_per_object=4) as again:  # a restart
            for i in range(10):
                assert await again.get_bytes(key(i), 30_000) == payload(30_000, i)
            assert {k async for k in again.keys()} == {key(i) for i in range(10)}

    asyncio.run(body())


def test_server_stopped_mid_run_then_back(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed-dies"))
    server.start()

    async def body() -> None:
        tier = s3_tier(server, "faults/", retries=1, connect_timeout=0.5, read_timeout=2, timeout=5)
        async with tier:
            await tier.put(key(1), payload(100_000, 1))
            server.stop()
            for call in (
                tier.get(key(1), bytearray(100_000)),
                tier.put(key(2), b"x"),
                tier.contains([key(1)]),
            ):
                start = time.monotonic()
                with pytest.raises((TierUnavailable, TierTimeout)):
                    await call
                assert time.monotonic() - start < 5.5
            server.start()  # same ports, same data directory
            # Acknowledged before the stop, so still there.
            assert await tier.get_bytes(key(1), 100_000) == payload(100_000, 1)
            await tier.put(key(3), b"after")
            assert await tier.get_bytes(key(3), 5) == b"after"

    try:
        asyncio.run(body())
    finally:
        server.stop()


def test_crafted_packs_are_ignored_and_counted(s3_server: SeaweedS3) -> None:
    """Anyone who can write to the bucket can plant a pack: an index claiming 4 GiB, one that
    is not JSON, one naming a key that is not hex, one whose ranges run past the pack. Each is
    ignored and counted when the tier reads the packs at start, costing no memory to speak of,
    and the real packs still serve their blocks."""
    from tiering.testing import PEAK_BYTES, peak_memory

    prefix = f"evil-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.put_many([(key(i), payload(5000, i)) for i in range(4)])
        client: Any = s3_server.client()
        base = f"{prefix}{NAMESPACE.hex()}/packs/"

        def pack(index: bytes, body: bytes = b"x" * 100, length: int | None = None) -> bytes:
            return (len(index) if length is None else length).to_bytes(4, "big") + index + body

        planted = {
            "huge-index": pack(b"{}", length=0xFFFFFFFF),
            "not-json": pack(b"{not json"),
            "bad-key": pack(b'{"zz":[0,10]}'),
            "past-the-end": pack(json.dumps({key(9).hex(): [0, 1_000_000]}).encode()),
            "not-a-list": pack(json.dumps({key(9).hex(): "0-10"}).encode()),
        }
        for name, blob in planted.items():
            client.put_object(Bucket=s3_server.bucket, Key=base + name, Body=blob)
        again = s3_tier(s3_server, prefix, blocks_per_object=2)
        async with again:
            found, peak = await peak_memory(again.get_bytes(key(1), 5000))
            assert found == payload(5000, 1)
            assert again.counters["packs_refused"] == len(planted)
            assert peak < PEAK_BYTES, peak
            assert await again.get_bytes(key(9), 5000) is None
            assert {k async for k in again.keys()} == {key(i) for i in range(4)}

    asyncio.run(body())


def _plant(server: SeaweedS3, prefix: str, packs: dict[str, bytes]) -> None:
    client: Any = server.client()
    base = f"{prefix}{NAMESPACE.hex()}/packs/"
    for name, blob in packs.items():
        client.put_object(Bucket=server.bucket, Key=base + name, Body=blob)


def _pack(index: bytes, body: bytes = b"") -> bytes:
    return len(index).to_bytes(4, "big") + index + body


def test_a_deeply_nested_pack_index_is_refused_and_the_other_packs_still_load(
    s3_server: SeaweedS3,
) -> None:
    """An index of 100,000 nested `[` (and one that passes for an object but nests 3,000
    lists deep) would make the JSON parser recurse: both are refused and counted, nothing
    escapes `get`, and the real packs listed after them still serve their blocks."""
    prefix = f"nest-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.put_many([(key(i), payload(3000, i)) for i in range(6)])
        _plant(  # "0-" sorts before every pack name kvtier writes (hex)
            s3_server,
            prefix,
            {
                "0-brackets": _pack(b"[" * 100_000),
                "0-deep": _pack(b'{"' + key(9).hex().encode() + b'":' + b"[" * 3000),
            },
        )
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as again:
            for i in range(6):
                assert await again.get_bytes(key(i), 3000) == payload(3000, i)
            assert again.counters["packs_refused"] == 2
            assert {k async for k in again.keys()} == {key(i) for i in range(6)}

    asyncio.run(body())


def test_pack_indexes_with_too_many_entries_are_refused_in_bounded_memory(
    s3_server: SeaweedS3,
) -> None:
    """A 14.5 MiB index of 800,000 `[0,0]` entries is refused from its length alone, and one
    small enough but with more entries than a pack holds (blocks_per_object is at most 4096)
    is refused before it is parsed: the first get's traced memory stays small."""
    from tiering.testing import PEAK_BYTES, peak_memory

    prefix = f"wide-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.put_many([(key(i), payload(3000, i)) for i in range(4)])
        huge = "{" + ",".join(f'"{i:010x}":[0,0]' for i in range(800_000)) + "}"
        wide = {key(1000 + i).hex(): [0, 0] for i in range(5000)}
        _plant(
            s3_server,
            prefix,
            {"0-huge": _pack(huge.encode()), "0-wide": _pack(json.dumps(wide).encode())},
        )
        del huge
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as again:
            found, peak = await peak_memory(again.get_bytes(key(1), 3000))
            assert found == payload(3000, 1)
            assert peak < PEAK_BYTES, peak
            assert again.counters["packs_refused"] == 2
            assert await again.get_bytes(key(1000), 3000) is None
            assert {k async for k in again.keys()} == {key(i) for i in range(4)}

    asyncio.run(body())


def test_the_blocks_loaded_from_packs_are_bounded_in_all(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """However many valid-looking packs are planted, the tier loads at most `MAX_PACKED`
    blocks and packs from the bucket; the packs beyond are refused, counted, and logged once."""
    import tiers.s3.packs

    prefix = f"many-{uuid.uuid4().hex[:8]}/"
    monkeypatch.setattr(tiers.s3.packs, "MAX_PACKED", 100)

    async def body() -> None:
        _plant(
            s3_server,
            prefix,
            {
                f"0-{p:02d}": _pack(
                    json.dumps({key(100 * p + i).hex(): [0, 0] for i in range(9)}).encode()
                )
                for p in range(20)  # 10 entries each (9 blocks and the pack): 200 in all
            },
        )
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.refresh_packs()
            held = {k async for k in tier.keys()}
            assert 0 < len(held) <= 90 and len(held) % 9 == 0
            assert tier.counters["packs_refused"] == 20 - len(held) // 9
            await tier.refresh_packs()  # a reload reads only packs it does not hold yet
            assert {k async for k in tier.keys()} == held

    with caplog.at_level("WARNING", logger="tiers.s3"):
        asyncio.run(body())
    assert sum("MAX_PACKED" in r.getMessage() for r in caplog.records) == 1


def test_packs_load_outside_the_callers_deadline(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many packs and a short deadline the first gets after a restart may time out
    while the pack indexes load, but the load goes on in the background and, once it has
    completed, every packed block is found (the packs listed over several pages)."""
    import tiers.s3.refresh

    monkeypatch.setattr(tiers.s3.refresh, "PACK_PAGE", 25)
    prefix = f"slow-{uuid.uuid4().hex[:8]}/"
    count = 240  # 120 packs of 2

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.put_many([(key(i), payload(1000, i)) for i in range(count)])
        async with s3_tier(s3_server, prefix, blocks_per_object=2, timeout=0.2) as again:
            timeouts = 0
            deadline = time.monotonic() + 15
            for i in range(count):
                while True:
                    try:
                        got = await again.get_bytes(key(i), 1000)
                        break
                    except TierTimeout:
                        timeouts += 1
                        assert time.monotonic() < deadline, "the packs never loaded"
                        await asyncio.sleep(0.05)
                assert got == payload(1000, i), i
            assert again.counters["packs_refused"] == 0
        # Closed while the load runs: the close stops it, and a get waiting for it learns
        # that the tier is unavailable (it was not cancelled itself).
        closing = s3_tier(s3_server, prefix, blocks_per_object=2, timeout=None)
        waiting = asyncio.ensure_future(closing.get_bytes(key(count - 1), 1000))
        await asyncio.sleep(0)
        loading = closing._refresher.loading
        assert loading is not None and not loading.done()
        await closing.close()
        assert closing._refresher.loading is None
        with pytest.raises(TierUnavailable, match="closed while loading packs"):
            await waiting

    asyncio.run(body())
