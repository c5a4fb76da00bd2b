"""The conformance suite's sealed objects (pytest): with `auth.secret` every object is sealed
with AES-256-GCM (`tiering.tier.sealing`), and with `auth.encrypt` its payload is encrypted.

A stranger who can write the store can flip any bit of a sealed object and recompute both
checksums (anyone can), graft one object's header onto another's payload, cut its tag short:
each must be a counted miss, never a block served, through single and batched reads alike. An
encrypted object keeps none of its block in the clear, and a reader without the secret, or
with another one, cannot read it. `SealTests` is one of the sections of
`tiering.testing.tier.TierConformance`.
"""

from __future__ import annotations

import pytest
import xxhash

from tiering.keys import BlockKey
from tiering.testing.crafted import with_payload
from tiering.testing.data import OTHER_SECRET, SECRET, key, payload
from tiering.testing.hooks import MakeTier, TierHooks, asynctest
from tiering.tier import Tier
from tiering.tier.format import HEADER_MIN, SEAL_BYTES

__all__ = ["SealTests"]

BLOCK = 4096
"""Block size of these tests (many objects; what is checked does not depend on it)."""


def _parts(blob: bytes) -> tuple[int, int]:
    """(the end of a sealed object's seal, its payload offset)."""
    key_len = int.from_bytes(blob[12:14], "little")
    return HEADER_MIN + key_len + SEAL_BYTES, int.from_bytes(blob[14:18], "little")


def _rechecked_header(blob: bytearray) -> bytes:
    """`blob` with its header checksum recomputed over its (altered) fields and key."""
    key_len = int.from_bytes(blob[12:14], "little")
    key_bytes = bytes(blob[HEADER_MIN : HEADER_MIN + key_len])
    blob[58:66] = xxhash.xxh3_64_intdigest(bytes(blob[:58]) + key_bytes).to_bytes(8, "little")
    return bytes(blob)


def _flips(blob: bytes) -> list[tuple[str, bytes]]:
    """(where, object) for one bit flipped in each byte of a sealed object's header up to the
    end of its seal and in its payload, with both checksums recomputed wherever a flip did
    not touch them, so that the seal alone has to catch it."""
    seal_end, offset = _parts(blob)
    out = []
    for at in range(seal_end):
        flipped = bytearray(blob)
        flipped[at] ^= 1 << (at % 8)
        if 50 <= at < 66:  # a checksum itself: as flipped
            out.append((f"checksum byte {at}", bytes(flipped)))
        else:
            out.append((f"header byte {at}", _rechecked_header(flipped)))
    for at in (offset, offset + 1, (offset + len(blob)) // 2, len(blob) - 1):
        altered = bytearray(blob[offset:])
        altered[at - offset] ^= 0x10
        out.append((f"payload byte {at}", with_payload(blob, bytes(altered))))
    return out


def _refused(tier: Tier) -> int:
    return sum(v for name, v in tier.counters.items() if name.startswith("corrupt."))


class SealTests(TierHooks):
    """What every tier does with sealed and encrypted objects (test process, each test on its
    own `asyncio.run` loop)."""

    @staticmethod
    def _sealed(tier: Tier, k: BlockKey, data: bytes) -> bytes:
        """The object `tier` would store for `data` at `k` (sealed by its own envelope; not
        stored, so a tier that packs its own objects reads the planted one)."""
        header, body = tier.envelope.seal(k, data)
        return bytes(header) + bytes(body)

    @asynctest
    async def test_an_encrypted_object_keeps_no_block_in_the_clear(
        self, make_tier: MakeTier
    ) -> None:
        """With `encrypt`, the stored object holds none of its block's bytes; the writer reads
        it back through `get` and `get_many`; a reader without the secret or with another one
        cannot (a counted miss, the object left in place), one with the secret that does not
        encrypt itself can."""
        data = payload(BLOCK * 4, 31)
        async with make_tier(secret=SECRET, encrypt=True) as tier:
            await tier.put(key(1), data)
            await tier.put_many([(key(2), data)])
            blob = bytes(await self.raw_get(tier, key(1)) or b"")
            assert blob[11] & 0xE0 == 0xC0, "the header says: sealed and encrypted"
            for at in range(0, len(data), 1024):
                assert data[at : at + 32] not in blob, f"block bytes {at}.. stored in the clear"
            into = bytearray(len(data))
            assert await tier.get(key(1), into) and into == data
            buffers = [bytearray(len(data)), bytearray(len(data))]
            assert await tier.get_many([(key(1), buffers[0]), (key(2), buffers[1])]) == [True] * 2
            assert buffers == [data, data]
            lasting = tier.persistent or tier.shared
        if not lasting:
            return
        for secret in (None, OTHER_SECRET):
            async with make_tier(secret=secret, read_only=self.one_writer) as reader:
                assert await reader.get(key(1), bytearray(len(data))) is False
                found = await reader.get_many([(key(2), bytearray(len(data)))])
                assert found == [False]
                assert reader.counters["corrupt.auth"] == 2, (secret, dict(reader.counters))
            assert bytes(await self.raw_get(tier, key(1)) or b"") == blob, "left in place"
        async with make_tier(secret=SECRET, read_only=self.one_writer) as plain:
            assert await plain.get_bytes(key(1), len(data)) == data

    @asynctest
    async def test_a_bit_flipped_anywhere_in_a_sealed_object_is_a_miss(
        self, make_tier: MakeTier
    ) -> None:
        """One bit flipped in any byte of the header (fields, key, salt, nonce, tag) or of the
        payload, checksums recomputed: a counted miss through `get` and `get_many`, authenticated
        and encrypted alike; the untouched object still reads."""
        data = payload(BLOCK, 32)
        async with make_tier(secret=SECRET, encrypt=False) as tier:
            good = self._sealed(tier, key(1), data)
            flips = _flips(good)
        n = 0
        for encrypt in (False, True):
            async with make_tier(secret=SECRET, encrypt=encrypt) as tier:
                planted: list[tuple[str, BlockKey]] = []
                before = _refused(tier)  # (a start-up scan counts what it found)
                for where, _ in flips:
                    n += 1
                    k = key(1000 + n)
                    blob = self._sealed(tier, k, data)
                    altered = dict(_flips(blob))[where]
                    await self.raw_put(tier, k, altered)
                    planted.append((where, k))
                for i, (where, k) in enumerate(planted):
                    if i % 2:
                        assert await tier.get(k, bytearray(BLOCK)) is False, (encrypt, where)
                half = [(where, k) for i, (where, k) in enumerate(planted) if not i % 2]
                found = await tier.get_many([(k, bytearray(BLOCK)) for _, k in half])
                served = [where for (where, _), hit in zip(half, found, strict=True) if hit]
                assert not served, (encrypt, served)
                assert tier.counters["hits"] == 0, (encrypt, dict(tier.counters))
                assert _refused(tier) - before == len(planted), (encrypt, dict(tier.counters))
                await tier.put(key(1), data)
                assert await tier.get_bytes(key(1), BLOCK) == data

    @asynctest
    async def test_a_header_grafted_onto_another_payload_is_a_miss(
        self, make_tier: MakeTier
    ) -> None:
        """The header (with its seal) of one object of a key on the payload of another of the
        same key and size, checksums recomputed: a miss, both ways, authenticated and encrypted
        alike."""
        first, second = payload(BLOCK, 33), payload(BLOCK, 34)
        for encrypt in (False, True):
            async with make_tier(secret=SECRET, encrypt=encrypt) as tier:
                for i, (header_of, payload_of) in enumerate(((first, second), (second, first))):
                    k = key(10 + i + 2 * encrypt)
                    donor = self._sealed(tier, k, header_of)
                    other = self._sealed(tier, k, payload_of)
                    _, offset = _parts(donor)
                    await self.raw_put(tier, k, with_payload(donor, other[offset:]))
                    assert await tier.get(k, bytearray(BLOCK)) is False, (encrypt, i)
                assert tier.counters["corrupt.auth"] == 2, (encrypt, dict(tier.counters))
                assert tier.counters["hits"] == 0

    @asynctest
    async def test_a_cut_or_zeroed_tag_is_a_miss(self, make_tier: MakeTier) -> None:
        """An object cut inside its tag, and one whose tag's last half is zeroed (a GCM tag
        truncated to 8 bytes), checksums recomputed: misses, never a block."""
        data = payload(BLOCK, 35)
        for encrypt in (False, True):
            async with make_tier(secret=SECRET, encrypt=encrypt) as tier:
                cut = self._sealed(tier, key(20 + encrypt), data)
                seal_end, _ = _parts(cut)
                await self.raw_put(tier, key(20 + encrypt), cut[: seal_end - 8])
                zeroed = bytearray(self._sealed(tier, key(22 + encrypt), data))
                zeroed[seal_end - 8 : seal_end] = bytes(8)
                await self.raw_put(tier, key(22 + encrypt), bytes(zeroed))
                for k in (key(20 + encrypt), key(22 + encrypt)):
                    assert await tier.get(k, bytearray(BLOCK)) is False, (encrypt, k.hex())
                assert tier.counters["hits"] == 0

    @asynctest
    async def test_encryption_needs_a_secret(self, make_tier: MakeTier) -> None:
        from tiering.errors import ConfigError

        with pytest.raises(ConfigError, match="encrypt"):
            make_tier(encrypt=True)
