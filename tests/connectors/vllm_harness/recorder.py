"""Logs of the calls vLLM's connector makes on kvtier, in both roles, in one list.

`Recorder` stands between the worker-role connector and its `OffloadingWorker` (kvtier's, built
by the spec); `ManagerRecorder` between the scheduler-role connector and its `OffloadingManager`.
Both forward every call unchanged, keyword arguments included, so a worker that does not accept
what the connector passes (`submit_load(..., expedited=True)`, 0.34's `DevicePointers`) fails
exactly as it would in an engine. The engine blocks of a call are logged as block ids whatever
form the release passes them in (0.34's pointers resolved against the KV caches). The engine
notes its forwards and resets in the same log, so the order of lookups, loads, waits, forwards,
resets and `on_reset_flushed` is visible.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from connectors.vllm.pointers import blocks_from_pointers

__all__ = ["Event", "ManagerRecorder", "Recorder"]


@dataclass(frozen=True)
class Event:
    """One call: `load`, `store`, `wait`, `finished` (the job ids reported; `failed` after it:
    those reported failed), `lookup` (with
    its `result`), `prepare_store` (with the slots granted), `on_reset_flushed`; or the
    engine's `forward` and `reset`."""

    kind: str
    job_ids: tuple[int, ...] = ()
    engine_blocks: tuple[int, ...] = ()
    """A load's destination or a store's source blocks in the engine's KV cache."""
    slots: tuple[int, ...] = ()
    """A load's source or a store's destination in the offloaded medium (kvtier's slots)."""
    expedited: bool = False
    step: int = 0
    result: str = ""
    count: int = 1
    """Lookups: how many in a row answered `result` (an idle engine asks every step)."""

    def as_json(self) -> dict[str, object]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name == "kind" or getattr(self, f.name) != f.default
        }


class Recorder(OffloadingWorker):
    """Worker process (the harness's thread): forwards to `inner`, logging each call."""

    def __init__(self, inner: OffloadingWorker, events: list[Event]) -> None:
        self.inner = inner
        self.events = events

    def submit_store(self, job_id: int, src: Any, dst_spec: LoadStoreSpec) -> bool:
        self.events.append(Event("store", (job_id,), self._engine_ids(src), _ids(dst_spec)))
        return self.inner.submit_store(job_id, src, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst: Any, **kwargs: Any) -> bool:
        expedited = bool(kwargs.get("expedited", False))
        self.events.append(
            Event("load", (job_id,), self._engine_ids(dst), _ids(src_spec), expedited)
        )
        return self.inner.submit_load(job_id, src_spec, dst, **kwargs)

    def _engine_ids(self, spec: Any) -> tuple[int, ...]:
        if not hasattr(spec, "ptrs"):  # a GPULoadStoreSpec
            return _ids(spec)
        engine = self.inner.engine  # type: ignore[attr-defined]
        blocks, _ = blocks_from_pointers(spec, engine.tensors, engine.groups)
        return tuple(int(b) for b in blocks.block_ids)

    def wait(self, job_ids: set[int]) -> None:
        self.events.append(Event("wait", tuple(sorted(job_ids))))
        self.inner.wait(job_ids)

    def get_finished(self) -> list[TransferResult]:
        results = self.inner.get_finished()
        if results:
            self.events.append(Event("finished", tuple(r.job_id for r in results)))
        failed = tuple(r.job_id for r in results if not r.success)
        if failed:
            self.events.append(Event("failed", failed))
        return results

    def shutdown(self) -> None:
        self.inner.shutdown()


class ManagerRecorder:
    """Scheduler process, scheduler thread: forwards every attribute to the connector's
    `OffloadingManager`, logging lookups (with their results), the slots `prepare_store`
    grants, and `on_reset_flushed`.

    Not an `OffloadingManager` subclass on purpose: the base class's defaults (`lock`,
    `on_reset_flushed`, `config_info`, ...) would answer instead of kvtier's manager.
    """

    def __init__(self, inner: Any, events: list[Event]) -> None:
        self.inner = inner
        self.events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def lookup(self, key: Any, req_context: Any) -> Any:
        result = self.inner.lookup(key, req_context)
        last = self.events[-1] if self.events else None
        if last is not None and last.kind == "lookup" and last.result == result.name:
            self.events[-1] = replace(last, count=last.count + 1)
        else:
            self.events.append(Event("lookup", result=result.name))
        return result

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        output = self.inner.prepare_store(keys, req_context)
        slots = () if output is None else _ids(output.store_spec)
        result = "refused" if output is None else f"{len(output.keys_to_store)} of {len(keys)}"
        self.events.append(Event("prepare_store", slots=slots, result=result))
        return output

    def on_reset_flushed(self) -> None:
        self.events.append(Event("on_reset_flushed"))
        self.inner.on_reset_flushed()


def _ids(spec: Any) -> tuple[int, ...]:
    return tuple(int(b) for b in spec.block_ids)
