"""The segment layout's bookkeeping (`tiers.file.ledger`) alone: no disk, no loop, no threads.
What the tier's own tests check through files, checked here on the ledger's state."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.testing import key
from tiers.file.ledger import Place, Segment, SegmentLedger, record_size

SEGMENT = 64 << 10
ROOT = Path("/nowhere")


class Ledger(SegmentLedger):
    """A ledger that records the segments it hands over for removal."""

    def __init__(self, segment_size: int = SEGMENT, preallocating: bool = False) -> None:
        self.removed: list[Segment] = []
        super().__init__(ROOT, segment_size, self.removed.append)
        self.preallocating = preallocating


def put(ledger: SegmentLedger, i: int, length: int = 10_000) -> Place:
    """A put of key(i) that completes."""
    place = ledger.reserve(length)
    ledger.begin_put(key(i), place)
    assert ledger.land(key(i), place) is False
    return place


def test_records_take_whole_blocks() -> None:
    assert [record_size(n) for n in (0, 1, 4096, 4097, 8192)] == [4096, 4096, 4096, 8192, 8192]


def test_reserve_appends_to_the_active_segment_and_starts_a_new_one_when_full() -> None:
    ledger = Ledger()
    places = [ledger.reserve(10_000) for _ in range(6)]  # 12 KiB records: five per 64 KiB
    assert [p.offset for p in places] == [0, 12288, 24576, 36864, 49152, 0]
    assert places[4].segment is not places[5].segment and ledger.active is places[5].segment
    assert places[0].segment.path == ROOT / "00000000.kvs"
    assert places[5].segment.path == ROOT / "00000001.kvs"
    assert ledger.bytes == 6 * 12288  # not preallocated: what is reserved
    assert list(ledger.segments) == [0, 1]


def test_a_preallocated_segment_counts_all_of_its_size_from_the_start() -> None:
    ledger = Ledger(preallocating=True)
    ledger.reserve(10_000)
    assert ledger.bytes == SEGMENT
    assert ledger.growth(12288) == 0  # room left in the active segment: no growth
    assert ledger.growth(SEGMENT) == SEGMENT  # a new segment
    ledger.preallocating = False
    assert ledger.growth(SEGMENT) == SEGMENT and ledger.growth(100) == 0


def test_a_put_lands_as_the_keys_copy_and_a_later_put_wins() -> None:
    ledger = Ledger()
    first = ledger.reserve(10_000)
    ledger.begin_put(key(1), first)
    second = ledger.reserve(10_000)
    ledger.begin_put(key(1), second)  # put again while the first is on its way
    assert ledger.land(key(1), second) is False
    assert ledger.land(key(1), first) is False  # lands later: the later put still wins
    assert ledger.where[key(1)] is second
    assert first.segment.keys == {key(1)}


def test_a_failed_put_leaves_nothing() -> None:
    ledger = Ledger()
    place = ledger.reserve(10_000)
    ledger.begin_put(key(1), place)
    ledger.abandon_put(key(1), place)
    assert not ledger.landing and key(1) not in ledger.where


def test_a_block_deleted_while_in_flight_needs_a_tombstone_when_it_lands() -> None:
    ledger = Ledger()
    put(ledger, 0)  # keeps the segment alive
    place = ledger.reserve(10_000)
    ledger.begin_put(key(1), place)
    assert ledger.delete(key(1)) == (True, None)  # on its way: found, nothing on disk yet
    assert ledger.land(key(1), place) is True
    assert key(1) not in ledger.where and not ledger.deleted_in_flight


def test_delete_needs_a_tombstone_unless_the_segment_goes_whole() -> None:
    ledger = Ledger()
    a, b = put(ledger, 1), put(ledger, 2)
    assert ledger.delete(key(1)) == (True, a)  # its segment holds key(2) still
    assert ledger.delete(key(9)) == (False, None)
    for i in range(3, 7):  # fill the segment; the next put starts another
        put(ledger, i)
    assert ledger.active is not b.segment
    for i in range(2, 5):
        assert ledger.delete(key(i))[1] is not None
    assert ledger.delete(key(5)) == (True, None)  # the last of a full segment: it goes
    assert ledger.delete(key(6))[1] is not None  # the active segment stays, even empty
    assert b.segment.gone and ledger.removed == [b.segment]
    assert b.segment.seq not in ledger.segments


def test_a_segment_in_use_is_removed_once_its_last_user_is_done() -> None:
    ledger = Ledger()
    place = put(ledger, 1)
    for i in range(2, 7):
        put(ledger, i)  # the first segment is full, the active one another
    segment = place.segment
    with ledger.using(segment, segment):  # a batch may hold a segment twice
        with ledger.using(segment):
            assert ledger.drop(segment) == 5
            assert segment.gone and not ledger.removed
        assert not ledger.removed
    assert ledger.removed == [segment] and segment.users == 0


def test_a_use_that_fails_still_lets_go() -> None:
    ledger = Ledger()
    segment = put(ledger, 1).segment
    with pytest.raises(RuntimeError), ledger.using(segment):
        ledger.drop(segment)
        raise RuntimeError("the I/O failed")
    assert segment.users == 0 and ledger.removed == [segment]


def test_eviction_drops_the_least_recently_used_segments_whole() -> None:
    ledger = Ledger()
    for i in range(15):  # three full segments of five
        put(ledger, i)
    first = ledger.where[key(0)].segment
    ledger.touch(first)  # used: the second segment is now the oldest
    assert ledger.evict_for(12288, capacity=3 * 5 * 12288) == 5
    assert [k in ledger.where for k in (key(0), key(5), key(10))] == [True, False, True]
    assert ledger.bytes == 2 * 5 * 12288
    assert ledger.evict_for(0, capacity=1 << 30) == 0


def test_a_put_into_an_evicted_segment_does_not_land() -> None:
    ledger = Ledger()
    place = ledger.reserve(10_000)
    ledger.begin_put(key(1), place)
    ledger.drop(place.segment)
    assert ledger.land(key(1), place) is False and key(1) not in ledger.where


def test_an_overwrite_that_empties_an_old_segment_drops_it() -> None:
    ledger = Ledger()
    old = put(ledger, 1)
    for i in range(2, 6):
        put(ledger, i)
    for i in range(2, 6):
        ledger.delete(key(i))
    put(ledger, 1)  # key(1)'s new copy is in the next segment: the old one holds nothing
    assert old.segment.gone and ledger.removed == [old.segment]


def test_segments_found_at_start_count_their_size_and_continue_the_sequence() -> None:
    ledger = Ledger()
    segment = ledger.add_found(7, ROOT / "00000007.kvs")
    ledger.count_found(segment, 10_000)
    ledger.place(key(1), Place(segment, 0, 10_000))
    assert ledger.bytes == 12288 and ledger.next_seq == 8
    assert ledger.reserve(100).segment.seq == 8  # a found segment is never appended to
    ledger.place(key(1), Place(segment, 12288, 100))  # a later copy in the same file
    assert ledger.where[key(1)].offset == 12288 and segment.keys == {key(1)}
