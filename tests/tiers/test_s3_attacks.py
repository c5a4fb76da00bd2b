"""The S3 tier's shared-bucket machinery under attack (real SeaweedFS): a crafted lease object,
a planted pack whose index lies, a pack removed between the index's load and a read, a bucket
flooded with planted packs while the index refreshes. Each is a miss or a bounded cost, never
an error, a hang or a wrong block."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest

from kvtier.servers import SeaweedS3
from tests.tiers.s3_tiers import s3_tier
from tiering.testing import NAMESPACE, key, payload
from tiers.s3.lease import LEASE_NAME
from tiers.s3.packformat import name_after

pytestmark = pytest.mark.s3


def _packs(prefix: str) -> str:
    return f"{prefix}{NAMESPACE.hex()}/packs/"


def _pack(index: dict[str, list[int]], body: bytes) -> bytes:
    head = json.dumps(index).encode()
    return len(head).to_bytes(4, "big") + head + body


def test_a_crafted_lease_object_delays_the_sweep_by_one_lease_at_most(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease object planted by a stranger (3 MiB of garbage, no JSON) is judged by its
    LastModified alone: the tier takes it over once it lapses (`LEASE_TTL`, 2 s here) and
    sweeps the prefix to its capacity; meanwhile every put succeeds, and the body is never
    read."""
    import tiers.s3.lease
    import tiers.s3.sweeper

    monkeypatch.setattr(tiers.s3.lease, "LEASE_TTL", 2.0)
    monkeypatch.setattr(tiers.s3.sweeper, "LEASE_TTL", 2.0)
    prefix = f"lease-{uuid.uuid4().hex[:8]}/"
    client: Any = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=prefix + LEASE_NAME, Body=b"\xff" * (3 << 20))
    planted = time.monotonic()

    async def body() -> None:
        async with s3_tier(s3_server, prefix, capacity=100_000, sweep_interval=0.2) as tier:
            for i in range(20):
                await tier.put(key(i), payload(20_000, i))
            assert (await tier.stat()).bytes_used > 100_000
            while not tier._sweeper or not tier._sweeper.lease.held:
                assert time.monotonic() < planted + 10, tier.counters
                await asyncio.sleep(0.1)
            taken = time.monotonic() - planted
            assert taken >= 2.0
            while (await tier.stat()).bytes_used > 100_000:
                assert time.monotonic() < planted + 15, tier.counters
                await asyncio.sleep(0.1)
            present = await tier.contains([key(i) for i in range(20)])
            assert present[-4:] == [True] * 4 and not present[0]  # the oldest went
            assert tier.counters["errors"] == 0 and tier.counters["swept"] >= 14
            lease = client.get_object(Bucket=s3_server.bucket, Key=prefix + LEASE_NAME)
            assert json.loads(lease["Body"].read())["holder"] == tier.writer.hex()
        # Released at close: the next engine need not wait for it to lapse.
        with pytest.raises(client.exceptions.NoSuchKey):
            client.get_object(Bucket=s3_server.bucket, Key=prefix + LEASE_NAME)

    asyncio.run(body())


def test_with_a_secret_a_lease_not_written_with_it_is_taken_over_at_once(
    s3_server: SeaweedS3,
) -> None:
    """With `auth.secret`, a lease object whose MAC does not verify is no holder's, however
    fresh: a genuine lease of this deployment copied from another prefix, or 3 MiB of garbage
    (never read past `LEASE_BYTES`). The tier takes each over at once, well within
    `LEASE_TTL`, counts it (`leases_forged`), and sweeps."""
    from tiering.testing import SECRET
    from tiers.s3.lease import LEASE_TTL

    client: Any = s3_server.client()
    options = {"capacity": 50_000, "sweep_interval": 0.2, "secret": SECRET}

    async def held(tier: Any) -> float:
        start = time.monotonic()
        while not tier._sweeper.lease.held:
            assert time.monotonic() < start + LEASE_TTL, tier.counters
            await asyncio.sleep(0.05)
        return time.monotonic() - start

    async def body() -> None:
        elsewhere = f"donor-{uuid.uuid4().hex[:8]}/"
        async with s3_tier(s3_server, elsewhere, **options) as donor:
            await donor.put(key(0), payload(1000, 0))
            await held(donor)
            name = donor._sweeper.lease.name
            genuine = client.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read()
        prefix = f"copied-{uuid.uuid4().hex[:8]}/"
        for planted in (genuine, b"\xff" * (3 << 20)):
            async with s3_tier(s3_server, prefix, **options) as tier:
                lease = tier._sweeper.lease.name
                assert lease == prefix + name[len(elsewhere) :]
                client.put_object(Bucket=s3_server.bucket, Key=lease, Body=planted)
                for i in range(6):
                    await tier.put(key(i), payload(20_000, i))
                assert await held(tier) < LEASE_TTL / 2
                assert tier.counters["leases_forged"] == 1
                swept = time.monotonic()
                while (await tier.stat()).bytes_used > 50_000:
                    assert time.monotonic() < swept + 5, tier.counters
                    await asyncio.sleep(0.1)
                assert tier.counters["errors"] == 0

    asyncio.run(body())


def test_a_planted_pack_whose_index_lies_serves_no_wrong_block(s3_server: SeaweedS3) -> None:
    """A pack whose index gives key 50 the range of a valid object of key 51, key 52 a range
    of garbage, key 53 more bytes than its block: each is a refused miss; nobody gets key 51's
    bytes for key 50, and the tier's real blocks still load."""
    prefix = f"liar-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as tier:
            await tier.put_many([(key(i), payload(3000, i)) for i in range(4)])
            await tier.put(key(51), payload(3000, 51))
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as reader:
            await reader.contains([key(51)])
            pending, place = reader._packs.where(key(51))
            assert place is not None
            real = await reader._bucket.get_range(*place)
        assert real is not None
        body = real + b"\x00" * 3000
        index = {
            key(50).hex(): [0, len(real)],
            key(52).hex(): [len(real), 3000],
            key(53).hex(): [0, len(body)],
        }
        client: Any = s3_server.client()
        client.put_object(
            Bucket=s3_server.bucket,
            Key=_packs(prefix) + "t000000000000-liar",
            Body=_pack(index, body),
        )
        async with s3_tier(s3_server, prefix, blocks_per_object=2) as again:
            for k in (50, 52):
                assert await again.get_bytes(key(k), 3000) is None
            assert await again.get_bytes(key(53), 1000) is None
            assert again.counters["corrupt.key"] == 1
            assert sum(v for n, v in again.counters.items() if n.startswith("corrupt.")) == 3
            assert again.counters["errors"] == 0
            for i in (*range(4), 51):
                assert await again.get_bytes(key(i), 3000) == payload(3000, i)

    asyncio.run(body())


def test_a_planted_pack_refused_for_a_key_leaves_its_single_object(s3_server: SeaweedS3) -> None:
    """A key stored as a single object (an engine without packs, or before
    `blocks_per_object` was raised) and claimed by a planted pack's lying entry: the packed
    copy is read first and refused as damaged, and only it goes; the single object, which no
    read proved anything of, stays in the bucket."""
    prefix = f"twice-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix) as single:
            await single.put(key(7), payload(3000, 7))
            name = single._name(key(7))
        index = {key(7).hex(): [0, 3000]}
        client: Any = s3_server.client()
        client.put_object(
            Bucket=s3_server.bucket,
            Key=_packs(prefix) + "t000000000000-liar",
            Body=_pack(index, b"\x5a" * 3000),
        )
        async with s3_tier(s3_server, prefix, blocks_per_object=4) as packed:
            assert await packed.get_bytes(key(7), 3000) is None
            assert packed.counters["corrupt.magic"] == 1
            assert await packed.get_bytes(key(7), 3000) == payload(3000, 7)  # the single one
        head = client.head_object(Bucket=s3_server.bucket, Key=name)
        assert head["ContentLength"] > 3000  # the single object, untouched

    asyncio.run(body())


def test_a_pack_removed_after_the_index_loaded_is_a_miss_and_forgotten(
    s3_server: SeaweedS3,
) -> None:
    """A pack deleted (swept by another engine) after this tier's index listed it: a get of
    its blocks is a plain miss (no error counted), and the index forgets the whole pack, so
    `contains` stops claiming its blocks."""
    prefix = f"gone-{uuid.uuid4().hex[:8]}/"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=4) as writer:
            await writer.put_many([(key(i), payload(2000, i)) for i in range(8)])
        async with s3_tier(s3_server, prefix, blocks_per_object=4) as reader:
            assert await reader.contains([key(i) for i in range(8)]) == [True] * 8
            pack = reader._packs.where(key(0))[1]
            assert pack is not None
            client: Any = s3_server.client()
            client.delete_object(Bucket=s3_server.bucket, Key=pack[0])
            assert await reader.get_bytes(key(0), 2000) is None
            gone = [i for i in range(8) if reader._packs.where(key(i))[1] is None]
            assert len(gone) == 4
            assert await reader.contains([key(i) for i in gone]) == [False] * 4
            assert reader.counters["errors"] == 0 and reader.counters["misses"] == 1
            others = [i for i in range(8) if i not in gone]
            for i in others:
                assert await reader.get_bytes(key(i), 2000) == payload(2000, i)

    asyncio.run(body())


def test_a_bucket_flooded_with_planted_packs_while_refreshing_costs_each_one_read(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a reader's index refreshes every 0.2 s, 300 packs with unreadable indexes are
    planted under names of the current time and 100 under names of the far future (after
    every real pack, so in every refresh's listing). Each refresh lists at most 2 pages of 50
    here (`REFRESH_PAGES`, `PACK_PAGE`) and goes on where it stopped; each planted pack is
    read and refused once, never again; a pack a real engine writes meanwhile is found."""
    import tiers.s3.refresh

    monkeypatch.setattr(tiers.s3.refresh, "PACK_PAGE", 50)
    monkeypatch.setattr(tiers.s3.refresh, "REFRESH_PAGES", 2)
    prefix = f"flood-{uuid.uuid4().hex[:8]}/"
    client: Any = s3_server.client()
    bad = (10).to_bytes(4, "big") + b"not json!!"

    async def body() -> None:
        async with s3_tier(s3_server, prefix, blocks_per_object=2, pack_refresh=0.2) as reader:
            await reader.contains([key(0)])  # loaded: empty
            now = time.time()
            names = [f"{name_after(_packs(prefix), now)}-planted-{i:03d}" for i in range(300)]
            names += [f"{_packs(prefix)}tffffffffffff-future-{i:03d}" for i in range(100)]
            await asyncio.gather(
                *(
                    asyncio.to_thread(client.put_object, Bucket=s3_server.bucket, Key=n, Body=bad)
                    for n in names
                )
            )
            async with s3_tier(s3_server, prefix, blocks_per_object=2) as writer:
                await writer.put_many([(key(1), payload(1000, 1)), (key(2), payload(1000, 2))])
            start = time.monotonic()
            while not (await reader.contains([key(1)]))[0]:
                assert time.monotonic() < start + 20, reader.counters
                await asyncio.sleep(0.05)
            while reader.counters["packs_refused"] < 400:
                assert time.monotonic() < start + 30, reader.counters
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)  # several more refreshes list the future names again
            assert reader.counters["packs_refused"] == 400
            assert reader.counters["errors"] == 0
            assert await reader.get_bytes(key(2), 1000) == payload(1000, 2)

    asyncio.run(body())


def test_a_server_that_ignores_conditional_puts_gets_no_write_beyond_capacity(
    s3_server: SeaweedS3, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a client that drops `If-None-Match` and `If-Match` before signing (what a server
    that ignores them amounts to), no lease can elect one sweeper: the probe finds it out, the
    tier with `capacity` refuses every write from then on with one error naming what to do,
    as a full tier (`TierFull`: the manager's write breaker alone opens), and still serves
    reads."""
    from tiering.errors import TierFull

    prefix = f"nocond-{uuid.uuid4().hex[:8]}/"

    def unconditional(request: Any, **_: Any) -> None:
        for header in ("If-None-Match", "If-Match"):
            if header in request.headers:
                del request.headers[header]

    async def body() -> None:
        async with s3_tier(s3_server, prefix) as plain:
            await plain.put(key(1), payload(1000, 1))
        async with s3_tier(s3_server, prefix, capacity=1 << 20) as tier:
            tier._bucket._client.meta.events.register("before-sign.s3.*", unconditional)
            await tier.put(key(2), payload(1000, 2))  # starts the sweeper, which probes
            deadline = time.monotonic() + 10
            while tier._sweeper is not None and tier._sweeper.refusal is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            with pytest.raises(TierFull, match=r"capacity 1MiB cannot be enforced.*lifecycle"):
                await tier.put(key(3), payload(1000, 3))
            assert await tier.get_bytes(key(1), 1000) == payload(1000, 1)
            assert await tier.contains([key(3)]) == [False]

    with caplog.at_level("ERROR", logger="tiers.s3"):
        asyncio.run(body())
    refusals = [r for r in caplog.records if "cannot be enforced" in r.getMessage()]
    assert len(refusals) == 1 and "\n" not in refusals[0].getMessage()


@pytest.mark.parametrize("blocks_per_object", [1, 4])
def test_write_once_keeps_what_the_bucket_holds_and_replaces_only_proven_damage(
    s3_server: SeaweedS3, blocks_per_object: int
) -> None:
    """With `write_once` (the default), a second put of a block the bucket holds writes
    nothing and is counted a duplicate; a neighbour's object this tier cannot authenticate
    (another secret) is neither replaced nor removed; an object whose damage the reader proves
    (a bad checksum) is removed at the read, and the next put writes the block again."""
    from tiering.testing import SECRET

    prefix = f"once-{uuid.uuid4().hex[:8]}/"
    client: Any = s3_server.client()
    options = {"blocks_per_object": blocks_per_object}

    async def body() -> None:
        async with s3_tier(s3_server, prefix, **options) as tier:
            await tier.put(key(1), payload(5000, 1))
            await tier.put(key(1), payload(5000, 1))
            assert tier.counters["duplicates"] == 1 and tier.counters["duplicate_bytes"] == 5000
        async with s3_tier(s3_server, prefix, secret=SECRET, **options) as other:
            assert await other.get_bytes(key(1), 5000) is None  # corrupt.auth: left in place
            await other.put(key(1), payload(5000, 1))
            assert other.counters["duplicates"] == 1 and other.counters["corrupt.auth"] == 1
        async with s3_tier(s3_server, prefix, **options) as tier:
            assert await tier.get_bytes(key(1), 5000) == payload(5000, 1)
        # A damaged single object (a flipped payload byte under a valid header).
        name = f"{prefix}{NAMESPACE.hex()}/{key(2).hex()[:2]}/{key(2).hex()}"
        async with s3_tier(s3_server, prefix, write_once=False) as single:
            await single.put(key(2), payload(5000, 2))
        stored = bytearray(client.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read())
        stored[-1] ^= 0xFF
        client.put_object(Bucket=s3_server.bucket, Key=name, Body=bytes(stored))
        async with s3_tier(s3_server, prefix) as tier:
            assert await tier.get_bytes(key(2), 5000) is None
            assert tier.counters["corrupt.checksum"] == 1
            await tier.put(key(2), payload(5000, 2))
            assert tier.counters["duplicates"] == 0
            assert await tier.get_bytes(key(2), 5000) == payload(5000, 2)

    asyncio.run(body())


def test_a_server_whose_answers_carry_no_date_still_gets_its_packs(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packs are named by the server's clock, learned from its answers' `Date`; answers
    without one (a proxy that strips it) must not keep the pack writer asking for it: after a
    few tries packs are named by this host's clock, and a partial pack is still written within
    `pack_after`, with a bounded number of listings."""
    from tiers.s3.client import Bucket

    monkeypatch.setattr(Bucket, "_clock", lambda self, response: None)
    prefix = f"nodate-{uuid.uuid4().hex[:8]}/"
    listings = 0

    async def body() -> None:
        nonlocal listings
        async with s3_tier(s3_server, prefix, blocks_per_object=8, pack_after=0.2) as tier:
            real = tier._bucket.list_page

            async def counted(*args: Any, **kw: Any) -> Any:
                nonlocal listings
                listings += 1
                return await real(*args, **kw)

            tier._bucket.list_page = counted  # type: ignore[method-assign]
            await tier.put_many([(key(i), payload(3000, i)) for i in range(3)])
            deadline = time.monotonic() + 10
            client: Any = s3_server.client()
            while not client.list_objects_v2(Bucket=s3_server.bucket, Prefix=_packs(prefix)).get(
                "Contents"
            ):
                assert time.monotonic() < deadline, "no pack written"
                await asyncio.sleep(0.1)
        assert listings < 50, listings

    asyncio.run(body())
