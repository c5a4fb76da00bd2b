"""vLLM's `OffloadingManager` contract, method by method, checked on kvtier's adapter.

`python -m tests.connectors.vllm_harness.contract RESULT.json`, with vLLM's python and the
repository root on PYTHONPATH (a release's tree ahead of it, as for the harness): runs every check
of `CHECKS` against a fresh `KvtierManager` over a primary of `SLOTS` slots and no tier, and
writes `{check: "ok" | the failure}` to RESULT.json. Each check is one sentence of the
interface's documentation (vLLM 0.34's `vllm/v1/kv_offload/base.py`; where 0.32 or 0.33 differ,
the check says so), called in the order vLLM's connector calls: a step's lookups, loads and
stores, then `on_schedule_end`; completions between steps.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.vllm.manager import KvtierManager
from connectors.vllm.versions import traits
from tiering.config import Config
from tiering.manager import TieringOffloadingManager
from tiering.primary import PrimaryPool
from tiering.runtime import Runtime

__all__ = ["CHECKS"]

SLOTS = 2
CTX = ReqContext(req_id="r")


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


@contextmanager
def adapter() -> Iterator[KvtierManager]:
    memory = np.zeros((SLOTS, 64), dtype=np.uint8)
    inner = TieringOffloadingManager(
        PrimaryPool(SLOTS, "lru", events=True),
        [],
        lambda slot: memoryview(memory[slot]),
        config=Config(),
        runtime=Runtime(),
        block_tokens=32,
    )
    manager = KvtierManager(inner)
    try:
        yield manager
    finally:
        manager.shutdown()
        inner.runtime.shutdown()  # (opened here: the manager does not close it)


def end_step(manager: KvtierManager) -> None:
    manager.on_schedule_end(ScheduleEndContext(*[() for _ in ScheduleEndContext._fields]))


def store(manager: KvtierManager, *ids: int, success: bool = True) -> PrepareStoreOutput | None:
    """One step that stores `ids`, then the worker's report."""
    output = manager.prepare_store([key(i) for i in ids], CTX)
    end_step(manager)
    if output is not None:
        manager.complete_store(output.keys_to_store, CTX, success=success)
    return output


def check_lookup_of_an_unknown_block_is_a_miss(m: KvtierManager) -> None:
    """lookup: "MISS if not found"."""
    assert m.lookup(key(1), CTX) is LookupResult.MISS


def check_lookup_of_a_block_being_stored_is_pending(m: KvtierManager) -> None:
    """lookup: "HIT_PENDING if found but not yet readable"."""
    assert m.prepare_store([key(1)], CTX) is not None
    assert m.lookup(key(1), CTX) is LookupResult.HIT_PENDING


def check_complete_store_makes_blocks_loadable(m: KvtierManager) -> None:
    """complete_store: "Following this call, the blocks become loadable"."""
    store(m, 1)
    assert m.lookup(key(1), CTX) is LookupResult.HIT


def check_a_failed_store_removes_its_blocks(m: KvtierManager) -> None:
    """complete_store: "If success is False, blocks that were not marked as stored will be
    removed" (0.34: a failed store job; 0.32 and 0.33 never pass False) — and their slots serve
    the next store."""
    store(m, 1, 2, success=False)
    assert m.lookup(key(1), CTX) is LookupResult.MISS
    end_step(m)
    output = store(m, 3, 4)
    assert output is not None and list(output.keys_to_store) == [key(3), key(4)]
    assert list(output.evicted_keys) == []


def check_complete_store_ignores_keys_not_being_stored(m: KvtierManager) -> None:
    """complete_store after `on_request_finished`, twice, or for keys never prepared: "blocks
    that were not marked as stored" are the manager's to ignore; the others complete."""
    output = m.prepare_store([key(1)], CTX)
    end_step(m)
    assert output is not None
    m.on_request_finished(CTX)  # "complete_store() ... may still arrive afterward"
    m.complete_store([key(9), key(1)], CTX)
    m.complete_store([key(1)], CTX)
    assert m.lookup(key(1), CTX) is LookupResult.HIT
    assert m.lookup(key(9), CTX) is LookupResult.MISS


def check_prepare_store_skips_blocks_already_stored(m: KvtierManager) -> None:
    """prepare_store: "which blocks need storing" — not those already offloaded."""
    store(m, 1)
    output = m.prepare_store([key(1), key(2)], CTX)
    assert output is not None and list(output.keys_to_store) == [key(2)]


def check_prepare_store_reports_what_it_evicted(m: KvtierManager) -> None:
    """prepare_store: "list of blocks that were evicted as a result" (least recently used)."""
    store(m, 1)
    store(m, 2)
    output = m.prepare_store([key(3)], CTX)
    assert output is not None
    assert list(output.keys_to_store) == [key(3)] and list(output.evicted_keys) == [key(1)]
    end_step(m)
    assert m.lookup(key(1), CTX) is LookupResult.MISS


def check_prepare_store_returns_none_when_nothing_can_be_stored(m: KvtierManager) -> None:
    """prepare_store: "None is returned if the blocks cannot be stored" (every slot held)."""
    assert m.prepare_store([key(1), key(2)], CTX) is not None
    assert m.prepare_store([key(3)], CTX) is None


def check_prepare_load_protects_blocks_until_complete_load(m: KvtierManager) -> None:
    """prepare_load: "The given blocks will be protected from eviction until complete_load is
    called"; prepare_load's spec names the slots the blocks were stored in."""
    first = store(m, 1)
    store(m, 2)
    assert m.lookup(key(1), CTX) is LookupResult.HIT
    spec = m.prepare_load([key(1)], CTX)
    assert first is not None
    assert list(spec.block_ids) == list(first.store_spec.block_ids)  # type: ignore[attr-defined]
    output = m.prepare_store([key(3), key(4)], CTX)
    assert output is None or key(1) not in list(output.evicted_keys)
    end_step(m)
    assert m.lookup(key(1), CTX) is LookupResult.HIT
    m.complete_load([key(1)], CTX)
    end_step(m)
    output = m.prepare_store([key(5), key(6)], CTX)
    assert output is not None and key(1) in list(output.evicted_keys)


def check_a_load_is_a_use(m: KvtierManager) -> None:
    """Recency (0.34 calls no `touch`; 0.32 and 0.33 never did): a block loaded is used, so
    the next eviction takes the other one."""
    store(m, 1)
    store(m, 2)
    m.lookup(key(1), CTX)
    m.prepare_load([key(1)], CTX)
    end_step(m)
    m.complete_load([key(1)], CTX)
    output = m.prepare_store([key(3)], CTX)
    assert output is not None and list(output.evicted_keys) == [key(2)]


def check_get_load_source_of_a_primary_hit_is_the_host(m: KvtierManager) -> None:
    """get_load_source: "the cache tier that supplied a successful lookup"."""
    store(m, 1)
    assert m.lookup(key(1), CTX) is LookupResult.HIT
    assert m.get_load_source(key(1), CTX) is CacheHitSource.HOST


def check_on_new_request_returns_a_request_context(m: KvtierManager) -> None:
    """on_new_request: "Returns a RequestOffloadingContext"."""
    assert isinstance(m.on_new_request(ReqContext(req_id="new")), RequestOffloadingContext)


def check_take_events_reports_stores_and_evictions(m: KvtierManager) -> None:
    """take_events: "New OffloadingEvents collected since the last call", for storage the
    manager owns: the stored blocks, then the evicted ones."""
    store(m, 1)
    store(m, 2)
    stored = list(m.take_events())
    assert [(list(e.keys), e.removed) for e in stored] == [([key(1)], False), ([key(2)], False)]
    assert list(m.take_events()) == []
    store(m, 3)
    events = [(list(e.keys), e.removed) for e in m.take_events()]
    assert ([key(1)], True) in events and ([key(3)], False) in events


def check_has_pending_work_is_false_when_idle(m: KvtierManager) -> None:
    """has_pending_work: "Whether this manager needs the engine to keep stepping"."""
    store(m, 1)
    assert m.has_pending_work() is False


def check_reset_cache_forgets_every_block(m: KvtierManager) -> None:
    """reset_cache: "Evict all tracked blocks and reset internal state"; on_reset_flushed
    (0.33+) once the copies in flight at the reset are reported."""
    store(m, 1)
    m.reset_cache()
    m.on_reset_flushed()
    assert m.lookup(key(1), CTX) is LookupResult.MISS
    end_step(m)
    assert store(m, 2, 3) is not None


def check_lock_is_a_context_manager_the_methods_never_enter(m: KvtierManager) -> None:
    """lock (0.33+): "Every caller ... must hold it. Manager methods never enter it
    themselves": a step's calls run inside it."""
    lock = m.lock
    assert isinstance(lock, AbstractContextManager)
    with lock:
        assert m.lookup(key(1), CTX) is LookupResult.MISS
        assert m.prepare_store([key(1)], CTX) is not None
        end_step(m)


def check_get_stats_and_config_info(m: KvtierManager) -> None:
    """get_stats: "collected metrics since last call"; config_info: "the info metric labels,
    one mapping for each series"."""
    store(m, 1)
    stats = m.get_stats()
    assert stats is not None and not stats.is_empty()
    series = m.config_info()
    assert series and all(isinstance(s, Mapping) for s in series)


def check_touch_is_not_part_of_kvtiers_adapter(m: KvtierManager) -> None:
    """touch: gone from 0.34's interface; kvtier defines none on any release (what a release
    without it would call is the base's, if any)."""
    assert "touch" not in vars(KvtierManager)
    assert hasattr(OffloadingManager, "touch") is traits().manager_touch


def check_shutdown_needs_no_lock(m: KvtierManager) -> None:
    """shutdown: "The one exception to the rule that callers hold lock"."""
    store(m, 1)
    m.shutdown()


CHECKS: dict[str, Callable[[KvtierManager], None]] = {
    name.removeprefix("check_"): function
    for name, function in sorted(globals().items())
    if name.startswith("check_") and callable(function)
}


def main(result: Path) -> None:
    found: dict[str, str] = {}
    for name, check in CHECKS.items():
        try:
            with adapter() as manager:
                check(manager)
            found[name] = "ok"
        except Exception:
            found[name] = traceback.format_exc()
    result.write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
