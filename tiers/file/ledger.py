"""The segment layout's bookkeeping, with no I/O: which segment holds which block, where in it,
how many bytes the segments count against the capacity, and which segment goes next.

- A put reserves room at the end of the active segment (`reserve`), is in flight (`landing`)
  until its write completes, and then lands (`land`): the block becomes its key's copy unless
  the key was deleted or put again meanwhile (the later put wins, as a restart's scan decides).
- A delete (`delete`) forgets the key; its object needs a tombstone on disk, unless its segment
  holds nothing else and goes whole.
- Segments are used least recently first-out (`touch`); `evict_for` drops whole segments.
- A segment's file stays while a call uses it (`using`, a context manager, counts the users);
  once a dropped segment has no user left the ledger hands it to `on_unused`, which closes and
  removes its file (I/O is the tier's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiering.keys import BlockKey
from tiers.file.direct import BLOCK, round_up

__all__ = ["SUFFIX", "Place", "Segment", "SegmentLedger", "record_size"]

SUFFIX = ".kvs"


def record_size(length: int) -> int:
    """Bytes a stored object of `length` takes in a segment (whole 4 KiB blocks)."""
    return max(round_up(length), BLOCK)


@dataclass(eq=False, slots=True)
class Segment:
    """Runtime thread: one segment file's bookkeeping (the file itself is the tier's)."""

    seq: int
    path: Path
    size: int = 0
    """Bytes reserved in the file: objects, dead objects, holes."""
    keys: set[BlockKey] = field(default_factory=set)
    """Keys whose current copy lives here."""
    users: int = 0
    """Calls in flight on the file; it is closed when it is gone and this is 0."""
    gone: bool = False
    counted: int = 0
    """Bytes it adds to the ledger's `bytes`: `size`, or `segment_size` from its creation when
    its file is preallocated (what it takes on disk)."""
    preallocated: bool = False
    """Its file was given `segment_size` bytes when created (trimmed to `size` on close)."""


@dataclass(frozen=True, slots=True)
class Place:
    """Any thread (immutable): where a stored object lies."""

    segment: Segment
    offset: int
    length: int  # of the stored object


class SegmentLedger:
    """Runtime thread (the event loop) only: the segments, the blocks in them and the bytes
    they count. `preallocating` is the exception: a pool thread clears it, once, when the file
    system turns out unable to preallocate (a stale read costs one segment's accounting)."""

    def __init__(self, root: Path, segment_size: int, on_unused: Callable[[Segment], None]) -> None:
        self.root = root
        self.segment_size = segment_size
        self.segments: OrderedDict[int, Segment] = OrderedDict()  # least recently used first
        self.where: dict[BlockKey, Place] = {}  # the current copy of each key
        self.landing: dict[BlockKey, Place] = {}  # the latest put of a key, in flight
        self.deleted_in_flight: set[Place] = set()  # puts whose key was deleted meanwhile
        self.active: Segment | None = None
        self.next_seq = 0
        self.bytes = 0
        """Bytes the segments count against the capacity (dead objects and holes too)."""
        self.preallocating = True
        self._on_unused = on_unused

    # -- segments -------------------------------------------------------------------------------

    def add_found(self, seq: int, path: Path) -> Segment:
        """A segment file found at start (`count_found` says its size, once read)."""
        segment = Segment(seq, path)
        self.segments[seq] = segment
        self.next_seq = seq + 1
        return segment

    def count_found(self, segment: Segment, end: int) -> None:
        """A segment found at start is `end` bytes long: all of it counts (its objects are
        `place`d as the scan finds them)."""
        segment.size = segment.counted = round_up(end)
        self.bytes += segment.size

    def reserve(self, length: int) -> Place:
        """Room for an object of `length` at the end of the active segment (a new one when it
        is full); the segment becomes the most recently used."""
        segment = self.active
        if segment is None or (segment.size and segment.size + length > self.segment_size):
            segment = Segment(self.next_seq, self.root / f"{self.next_seq:08d}{SUFFIX}")
            self.next_seq += 1
            self.segments[segment.seq] = segment
            self.active = segment
            if self.preallocating:  # its file takes segment_size on disk from the start
                segment.counted = self.segment_size
                self.bytes += self.segment_size
        place = Place(segment, segment.size, length)
        segment.size += record_size(length)
        if segment.size > segment.counted:
            self.bytes += segment.size - segment.counted
            segment.counted = segment.size
        self.segments.move_to_end(segment.seq)
        return place

    def growth(self, size: int) -> int:
        """How much reserving `size` bytes of records grows `bytes`: what the active segment
        has not counted yet, or a new segment (all of `segment_size` when preallocated)."""
        active = self.active
        if active is not None and active.size + size <= self.segment_size:
            return max(0, active.size + size - active.counted)
        return max(size, self.segment_size) if self.preallocating else size

    def touch(self, segment: Segment) -> None:
        if not segment.gone:
            self.segments.move_to_end(segment.seq)

    def using(self, *segments: Segment) -> _Using:
        """A context manager that keeps the files of `segments` while its block runs (a
        segment may come twice)."""
        return _Using(self, segments)

    def _let_go(self, segments: tuple[Segment, ...]) -> None:
        for segment in segments:
            segment.users -= 1
            if segment.gone and segment.users == 0:
                # removed once nobody uses it: a pool thread opening it later would create it
                self._on_unused(segment)

    def drop(self, segment: Segment) -> int:
        """Forget `segment` and its objects (how many); its file goes once no call uses it."""
        with self.using(segment):
            self.segments.pop(segment.seq, None)
            segment.gone = True
            self.bytes -= segment.counted
            dropped = len(segment.keys)
            for key in segment.keys:
                del self.where[key]
            segment.keys.clear()
            if self.active is segment:
                self.active = None
        return dropped

    def evict_for(self, size: int, capacity: int) -> int:
        """Drop least recently used segments until reserving `size` bytes keeps `bytes` within
        `capacity`; the blocks evicted."""
        evicted = 0
        while self.segments and self.bytes + self.growth(size) > capacity:
            evicted += self.drop(next(iter(self.segments.values())))
        return evicted

    # -- blocks ---------------------------------------------------------------------------------

    def place(self, key: BlockKey, place: Place) -> None:
        """`place` holds the current copy of `key` (the most recently placed key)."""
        old = self.where.pop(key, None)
        if old is not None:
            old.segment.keys.discard(key)
        self.where[key] = place
        place.segment.keys.add(key)

    def begin_put(self, key: BlockKey, place: Place) -> None:
        """A put of `key` to `place` is on its way."""
        self.landing[key] = place

    def abandon_put(self, key: BlockKey, place: Place) -> None:
        """The put of `key` to `place` failed: nothing of it counts."""
        if self.landing.get(key) is place:
            del self.landing[key]
        self.deleted_in_flight.discard(place)

    def land(self, key: BlockKey, place: Place) -> bool:
        """The put of `key` to `place` is on disk: it becomes the key's copy, unless the key
        was deleted or put again since. True when its object needs a tombstone (deleted while
        in flight, and its segment is still there: a restart must not find it)."""
        if place in self.deleted_in_flight:
            self.deleted_in_flight.discard(place)
            return not place.segment.gone
        if self.landing.get(key) is not place:
            return False
        del self.landing[key]
        if place.segment.gone:  # evicted while being written
            return False
        old = self.where.get(key)
        self.place(key, place)
        if old is not None and not old.segment.keys and old.segment is not self.active:
            self.drop(old.segment)
        return False

    def delete(self, key: BlockKey) -> tuple[bool, Place | None]:
        """Forget `key`: whether it was there (or on its way), and the place of an object that
        needs a tombstone (None when there is none, or its segment went whole)."""
        landing = self.landing.pop(key, None)
        if landing is not None:
            self.deleted_in_flight.add(landing)
        place = self.where.pop(key, None)
        if place is None:
            return landing is not None, None
        segment = place.segment
        segment.keys.discard(key)
        if not segment.keys and segment is not self.active:
            self.drop(segment)
            return True, None
        return True, place


class _Using:
    """Runtime thread: `SegmentLedger.using`'s context manager (a class: it is on every read's
    path, and cheaper than a generator's)."""

    __slots__ = ("_ledger", "_segments")

    def __init__(self, ledger: SegmentLedger, segments: tuple[Segment, ...]) -> None:
        self._ledger = ledger
        self._segments = segments

    def __enter__(self) -> None:
        for segment in self._segments:
            segment.users += 1

    def __exit__(self, *exc: object) -> None:
        self._ledger._let_go(self._segments)
