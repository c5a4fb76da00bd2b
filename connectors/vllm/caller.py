"""`caller_local`: the one place kvtier reads vLLM's stack frames, for what vLLM does not pass.

Scheduler and worker processes, on the thread that calls into the spec or the manager.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["caller_local"]


def caller_local(
    name: str, accept: Callable[[Any], bool], *, above: int = 0, depth: int | None = None
) -> Any:
    """The local variable `name` of the nearest calling frame whose value `accept` takes, or
    None. The search starts `above` frames above the function that calls this one and looks
    at `depth` frames (None: up to the bottom of the stack).

    Every vLLM kvtier supports (`connectors.vllm.versions`) needs it, in two places:

    - the spec's constructor is given only an `OffloadingConfig`
      (`OffloadingSpecFactory.create_spec(config)`), which lacks what the namespace and the
      block-hash check need (model revision and settings, KV heads, head size, the block-hash
      algorithm). The `OffloadingConnector` that builds the spec holds the engine's
      `VllmConfig` (its `self`, in `__init__`), in both roles; no global holds it in the
      scheduler (`get_current_vllm_config_or_none()` is None there);
    - the manager's `on_schedule_end` is given a `ScheduleEndContext` (the new and preempted
      request ids) without the step's scheduled token count, which its caller
      `build_connector_meta(scheduler_output)` holds.

    A vLLM that passes these lets this function go.
    """
    frame: FrameType | None
    try:
        frame = sys._getframe(2 + above)  # this function, its caller, then `above` more
    except ValueError:  # the stack is not that deep
        return None
    try:
        looked = 0
        while frame is not None and (depth is None or looked < depth):
            value = frame.f_locals.get(name)
            if value is not None and accept(value):
                return value
            frame = frame.f_back
            looked += 1
    finally:
        del frame
    return None
