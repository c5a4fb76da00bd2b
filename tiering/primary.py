"""Bookkeeping of the CPU primary tier: which block lives in which slot, and in what state.

The primary tier is a fixed array of slots in one shared-memory region (the bytes live in
`tiers/`; this module never touches them). Each resident key is in one of three states:

    absent --prepare_store--> WRITING --complete_store(ok)--> READY <--> READING
       ^                         |                              |    prepare_load /
       +---complete_store(failed)+                              |    complete_load
       +--------------------evicted by the policy---------------+    (ref count > 0)

- WRITING: a slot is allocated and a copy into it is in flight; `lookup` answers PENDING.
- READY: the bytes are in; `lookup` answers HIT; the key may be evicted.
- READING: READY and pinned by one or more loads or demotions; never evicted.

The engine's store and load use `prepare_store`/`complete_store` and `prepare_load`/
`complete_load`; the tiering manager moves blocks with verbs that carry its own direction, on
the same transitions: a promotion (secondary -> primary) `allocate_for_promotion`/
`complete_promotion`; a write-through demotion (primary -> secondary) `pin_for_demotion`/
`release_demotion`; a write-back demotion `reclaim`/`release` (the key leaves, its slot is held
while the tier reads it).

A slot that is being written or read is never evicted or reused. The eviction policy (LRU, ARC,
or a registered one) holds the resident keys with their slots and chooses victims; this class
owns the states, the ref counts, the free list and the events.

The store path (`prepare_store`, `complete_store`: every block the engine offers goes through
both) runs in C where it was built (`tiering/_pool.c`, on this class's own containers); the
Python methods `_prepare_store` and `_complete_store` are the same algorithm, the fallback.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import Any, NamedTuple

from tiering.compiled import load_extension
from tiering.errors import StateError
from tiering.keys import BlockKey
from tiering.policies import EvictionPolicy, create_policy

__all__ = ["KeyState", "LookupResult", "PrimaryEvent", "PrimaryPool", "StoreGrant"]


_WRITING = -1
_READY = 0


_CORE: Any = load_extension(
    "tiering._pool",
    "primary store path",
    "it runs in Python, at a higher scheduler cost per block",
)


class LookupResult(enum.Enum):
    """Any thread (a value): what the primary tier can say about a key right now."""

    HIT = "hit"
    """Ready: a load may be prepared now."""
    PENDING = "pending"
    """Being written: ask again next step."""
    MISS = "miss"
    """Not here."""
    RETRY = "retry"
    """Not known yet (a secondary tier is being asked): ask again next step. Never returned
    by the primary pool itself; the tiering manager uses it."""


# Enum members as plain globals: a global load is cheaper than `LookupResult.HIT` on the lookup
# path (BENCHMARKS.md, "Scheduler-side cost of the primary pool").
_HIT, _PENDING, _MISS = LookupResult.HIT, LookupResult.PENDING, LookupResult.MISS


class KeyState(enum.Enum):
    """Any thread (a value): the state of a resident key (see the module docstring)."""

    WRITING = "writing"
    READY = "ready"
    READING = "reading"


class StoreGrant(NamedTuple):
    """Any thread (a frozen value): the answer to a successful `prepare_store` (or
    `allocate_for_promotion`). A named tuple: one is made per store, and a frozen dataclass
    costs more to make (BENCHMARKS.md, "Measurements behind design choices").

    `keys` is the order-preserving subsequence of the requested keys that must be written (the
    others were present already); `slots[i]` is where `keys[i]` goes. `evicted` lists the keys
    that were evicted to make room, in eviction order.
    """

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[BlockKey, ...]
    evicted_slots: tuple[int, ...] = ()
    """Where the evicted keys were: now among `slots`, their bytes valid until overwritten."""


@dataclass(frozen=True, slots=True)
class PrimaryEvent:
    """Any thread (a frozen value): keys that became readable (`removed=False`) or stopped
    being resident (`removed=True`)."""

    keys: tuple[BlockKey, ...]
    removed: bool
    metadata_only: bool = False
    """A removal of keys never announced as stored: promotions that failed after a lookup
    answered PENDING for them, which vLLM 0.33 records as primary residency. It drops that
    record without announcing a public eviction."""


class PrimaryPool:
    """Slot bookkeeping of the CPU primary tier. Scheduler process, under the tiering
    manager's step lock (scheduler or runtime thread); not thread-safe itself.

    Every method is synchronous, does no I/O and costs O(keys given) amortized. A caller's
    misuse (completing a key that is not in flight, loading a key that is not ready) raises
    `StateError` before anything changes; a broken invariant of this class is an
    `AssertionError`.
    """

    def __init__(
        self,
        num_slots: int,
        policy: str | EvictionPolicy[BlockKey, int] = "lru",
        *,
        events: bool = False,
    ) -> None:
        """`policy` is a registered policy name or an instance sized for `num_slots` keys.

        With `events`, `take_events` reports stored and removed keys (for vLLM's KV events).
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        if isinstance(policy, str):
            policy = create_policy(policy, num_slots)  # type: ignore[assignment]
        assert isinstance(policy, EvictionPolicy)
        if len(policy):
            raise ValueError("the eviction policy must start empty")
        self._policy: EvictionPolicy[BlockKey, int] = policy
        # key -> _WRITING, _READY, or the number of readers (> 0). Every key here is resident
        # in the policy, whose value is the slot.
        self._ref: dict[BlockKey, int] = {}
        # Keys whose ref is not _READY, and the subset being written. Kept as sets so that bulk
        # transitions and the policy's "is this key protected" test run at C speed.
        self._busy: set[BlockKey] = set()
        self._writing: set[BlockKey] = set()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._held: set[int] = set()  # reclaimed, still being read by a demotion
        self._events: list[PrimaryEvent] | None = [] if events else None
        self._core = _CORE
        """The compiled store path, or None (the Python one): a test runs both."""

    # -- queries ------------------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy[BlockKey, int]:
        return self._policy

    @property
    def num_used(self) -> int:
        """Slots holding a key, in any state."""
        return len(self._ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    @property
    def num_reading(self) -> int:
        """Keys pinned by at least one reader."""
        return len(self._busy) - len(self._writing)

    def lookup(self, key: BlockKey) -> LookupResult:
        """HIT when ready (pinned or not), PENDING while being written, MISS otherwise.

        Has no effect on recency: a lookup is not a use (vLLM looks keys up again every step
        while a request waits).
        """
        ref = self._ref.get(key)
        if ref is None:
            return _MISS
        return _PENDING if ref == _WRITING else _HIT

    def state(self, key: BlockKey) -> KeyState | None:
        """The state of a key, or None when it is not resident."""
        ref = self._ref.get(key)
        if ref is None:
            return None
        if ref == _WRITING:
            return KeyState.WRITING
        return KeyState.READY if ref == _READY else KeyState.READING

    def ref_count(self, key: BlockKey) -> int:
        """Readers of a resident key (0 when ready or being written)."""
        return max(self._require(key, "ref_count"), 0)

    def slot(self, key: BlockKey) -> int:
        """The slot of a resident key."""
        self._require(key, "slot")
        slot = self._policy.get(key)
        assert slot is not None, f"resident key {key.hex()} has no slot in the policy"
        return slot

    def __len__(self) -> int:
        return len(self._ref)

    def __contains__(self, key: object) -> bool:
        return key in self._ref

    # -- store: engine -> primary ---------------------------------------------------------------

    def prepare_store(self, keys: Iterable[BlockKey]) -> StoreGrant | None:
        """Allocate slots for the keys that are not resident, evicting by policy if needed: the
        engine's store (GPU -> primary).

        Keys already resident (in any state) are skipped and are never evicted by this call;
        duplicates count once. Returns the keys to write with their slots, in the given order,
        and the evicted keys; or None, changing nothing, when there are not enough free or
        evictable (ready, unpinned) slots for all of them. New keys are WRITING until
        `complete_store`.
        """
        core = self._core
        if core is None:
            return self._prepare_store(keys)
        out = core.prepare_store(
            self._ref, self._busy, self._writing, self._free, self._policy, keys
        )
        if not out:
            return None if out is None else _EMPTY_GRANT
        grant = StoreGrant(*out)
        if grant.evicted and self._events is not None:
            self._events.append(PrimaryEvent(grant.evicted, removed=True))
        return grant

    def _prepare_store(self, keys: Iterable[BlockKey]) -> StoreGrant | None:
        """`prepare_store` in Python."""
        ref = self._ref
        wanted = dict.fromkeys(keys)
        new = list(filterfalse(ref.__contains__, wanted))
        if not new:
            return _EMPTY_GRANT
        free = self._free
        n = len(new)
        shortfall = n - len(free)
        evicted: tuple[BlockKey, ...] = ()
        evicted_slots: tuple[int, ...] = ()
        if shortfall > 0:
            busy = self._busy
            # Resident, ready keys of this call are protected too: lend them to the busy set
            # for the duration of the eviction.
            lent = []
            if n < len(wanted):
                lent = [key for key in wanted if ref.get(key) == _READY]
            # Count first, so that an infeasible request costs O(keys) instead of a policy scan.
            if shortfall > len(ref) - len(busy) - len(lent):
                return None
            busy.update(lent)
            try:
                victims = self._policy.evict(shortfall, busy)
            finally:
                busy.difference_update(lent)
            assert victims, f"policy refused to evict {shortfall} evictable keys"
            evicted, evicted_slots = zip(*victims, strict=True)
            deque(map(ref.__delitem__, evicted), maxlen=0)  # del each, in a C-level loop
            free += evicted_slots
            if self._events is not None:
                self._events.append(PrimaryEvent(evicted, removed=True))
        slots = free[: -n - 1 : -1]  # the free list is a stack: its end is the next slot out
        del free[-n:]
        ref.update(dict.fromkeys(new, _WRITING))
        self._busy.update(new)
        self._writing.update(new)
        self._policy.insert_many(new, slots)
        return StoreGrant(tuple(new), tuple(slots), evicted, evicted_slots)

    def allocate_for_promotion(self, keys: Iterable[BlockKey]) -> StoreGrant | None:
        """`prepare_store`'s allocation for a promotion (secondary -> primary): the new keys
        are WRITING until `complete_promotion`."""
        return self.prepare_store(keys)

    def complete_store(self, keys: Iterable[BlockKey], ok: bool = True) -> None:
        """Finish the engine's writes of these keys: READY on success; on failure, free their slots.

        Every key must be WRITING (`StateError` otherwise, and nothing changes).
        """
        core = self._core
        if core is None:
            return self._complete_store(keys, ok)
        finished = core.complete_store(self._ref, self._busy, self._writing, keys, ok)
        if type(finished) is list:
            (key,) = finished
            raise StateError(
                f"complete_store: key {key.hex()} is {self._describe(key)}, not being written"
            )
        if not ok:
            self._free.extend(map(self._policy.remove, finished))
        elif self._events is not None and finished:
            self._events.append(PrimaryEvent(finished, removed=False))

    def _complete_store(self, keys: Iterable[BlockKey], ok: bool) -> None:
        """`complete_store` in Python."""
        done = dict.fromkeys(keys, _READY)  # ordered, so that events list keys as given
        writing = self._writing
        if not done.keys() <= writing:
            key = next(key for key in done if key not in writing)
            raise StateError(
                f"complete_store: key {key.hex()} is {self._describe(key)}, not being written"
            )
        writing.difference_update(done)
        self._busy.difference_update(done)
        if ok:
            self._ref.update(done)
            if self._events is not None and done:
                self._events.append(PrimaryEvent(tuple(done), removed=False))
        else:
            ref, free, remove = self._ref, self._free, self._policy.remove
            for key in done:
                del ref[key]
                free.append(remove(key))

    def complete_promotion(self, keys: Iterable[BlockKey], ok: bool = True) -> None:
        """`complete_store` for keys allocated by `allocate_for_promotion`."""
        done = dict.fromkeys(keys)
        if not done.keys() <= self._writing:
            key = next(key for key in done if key not in self._writing)
            raise StateError(
                f"complete_promotion: key {key.hex()} is {self._describe(key)}, not being written"
            )
        self.complete_store(done, ok)

    # -- load: primary -> engine ----------------------------------------------------------------

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready keys for reading and return their slots in the given order.

        Each key must be ready (HIT) and appear once (`StateError` otherwise, and nothing
        changes). Counts as a use of each key, in order, for the eviction policy. A pinned key
        is never evicted until `complete_load` unpins it.
        """
        if len(set(keys)) != len(keys):
            raise StateError("prepare_load: the same key appears more than once")
        slots = self._pin(keys, "prepare_load")
        self._policy.touch(keys)
        return slots

    def complete_load(self, keys: Iterable[BlockKey]) -> None:
        """Unpin keys pinned by `prepare_load` (once per key per load)."""
        ref = self._ref
        done = dict.fromkeys(keys)
        for key in done:
            r = ref.get(key)
            if r is None or r <= _READY:
                raise StateError(
                    f"complete_load: key {key.hex()} is {self._describe(key)}, not being read"
                )
        busy_discard = self._busy.discard
        for key in done:
            r = ref[key] - 1
            ref[key] = r
            if r == _READY:
                busy_discard(key)

    # -- pins and reclaim, for demotions ---------------------------------------------------------

    def pin_for_demotion(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready keys like `prepare_load`, without counting a use: a demotion (primary ->
        secondary) reads them. Undo with `release_demotion`."""
        return self._pin(keys, "pin_for_demotion")

    def _pin(self, keys: Sequence[BlockKey], what: str) -> list[int]:
        ref = self._ref
        for key in keys:
            r = ref.get(key)
            if r is None or r == _WRITING:
                raise StateError(f"{what}: key {key.hex()} is {self._describe(key)}, not ready")
        busy_add = self._busy.add
        for key in keys:
            r = ref[key]
            if r == _READY:
                busy_add(key)
            ref[key] = r + 1
        return self._policy.get_many(keys)  # type: ignore[return-value]

    def release_demotion(self, keys: Iterable[BlockKey]) -> None:
        """Undo `pin_for_demotion` (once per key per demotion)."""
        done = dict.fromkeys(keys)
        for key in done:
            r = self._ref.get(key)
            if r is None or r <= _READY:
                raise StateError(
                    f"release_demotion: key {key.hex()} is {self._describe(key)}, not being read"
                )
        self.complete_load(done)

    def reclaim(self, n: int) -> list[tuple[BlockKey, int]]:
        """Evict up to `n` ready, unpinned keys by policy but keep their slots out of the free
        list until `release`: their bytes stay valid while a demotion copies them out.
        Reported as removed (the keys are gone from the primary)."""
        n = min(n, len(self._ref) - len(self._busy))
        if n <= 0:
            return []
        victims = self._policy.evict(n, self._busy)
        assert victims is not None, f"policy refused to evict {n} evictable keys"
        for key, _ in victims:
            del self._ref[key]
        self._held.update(slot for _, slot in victims)
        if self._events is not None:
            self._events.append(PrimaryEvent(tuple(key for key, _ in victims), removed=True))
        return victims

    def release(self, slots: Iterable[int]) -> None:
        """Return slots taken by `reclaim` to the free list."""
        slots = list(slots)
        held = self._held
        if not held.issuperset(slots) or len(set(slots)) != len(slots):
            slot = next(s for s in slots if s not in held or slots.count(s) > 1)
            raise StateError(f"release: slot {slot} was not reclaimed (or is given twice)")
        held.difference_update(slots)
        self._free.extend(slots)

    def ready_keys(self) -> list[BlockKey]:
        """Resident keys not being written (pinned or not), the most recently stored first."""
        return [key for key, r in reversed(self._ref.items()) if r != _WRITING]

    def hottest(self, n: int) -> list[BlockKey]:
        """Up to `n` ready keys in the policy's order of worth (a warm-start manifest's)."""
        ref = self._ref
        return [key for key in self._policy.hottest(n) if ref.get(key, _WRITING) != _WRITING]

    def slots_in_use(self) -> set[int]:
        """Slots being written, pinned or held: those a job may be using."""
        get = self._policy.get
        return {get(key) for key in self._busy} | self._held  # type: ignore[return-value]

    @property
    def num_held(self) -> int:
        """Slots reclaimed and not yet released."""
        return len(self._held)

    # -- the rest -------------------------------------------------------------------------------

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Record a use of each resident key, in order; other keys are ignored."""
        self._policy.touch(keys)

    def reset(self, keep: Iterable[int] = ()) -> None:
        """Forget every key and pin, free every slot and clear the policy (ghosts included).

        For vLLM's `reset_cache`: afterwards no completion of an earlier job arrives. Ready
        keys are reported as removed; keys still being written were never announced. Slots in
        `keep` stay out of the free list, held until `release` (a job that could not be
        stopped may still be using them).
        """
        if self._events is not None:
            ready = tuple(key for key, r in self._ref.items() if r != _WRITING)
            if ready:
                self._events.append(PrimaryEvent(ready, removed=True))
        self._ref.clear()
        self._policy.clear()
        self._busy.clear()
        self._writing.clear()
        self._held = set(keep)
        self._free = [slot for slot in range(self.num_slots - 1, -1, -1) if slot not in self._held]

    @property
    def events(self) -> bool:
        """Whether the pool was built with `events=True`."""
        return self._events is not None

    def take_events(self) -> list[PrimaryEvent]:
        """Events since the last call, oldest first (empty unless built with `events=True`)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def _require(self, key: BlockKey, what: str) -> int:
        try:
            return self._ref[key]
        except KeyError:
            raise StateError(f"{what}: key {key.hex()} is not resident") from None

    def _describe(self, key: BlockKey) -> str:
        state = self.state(key)
        return "not resident" if state is None else state.value


_EMPTY_GRANT = StoreGrant((), (), ())
