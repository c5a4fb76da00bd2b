"""An engine with vLLM's own scheduler and both roles of its `OffloadingConnector`, and no model.

`Engine` builds what vLLM's engine core and its CPU worker build, from vLLM's own functions, in
the order they call them: the `VllmConfig` from `EngineArgs` (a model folder holding only a
`config.json`), the KV cache specs of the model's attention layers, the KV cache layout and
`KVCacheConfig`, the worker's distributed state (one rank, gloo), the worker-role connector
(`ensure_kv_transfer_initialized`), the engine's KV cache tensors (`allocate_kv_cache`) registered
with it, then the `Scheduler` with its scheduler-role connector. Everything runs in this
process, on this thread, on the CPU.

Each `step` is one engine step: `Scheduler.schedule()`, then what the model runner does with the
connector (`handle_preemptions`, then vLLM's own `KVConnectorModelRunnerMixin` context: bind the
metadata, start loads, the "forward", `wait_for_save`, finished transfers, worker metadata; from
vLLM 0.34 the CPU model runner's `ActiveKVConnector`, which starts a step's expedited loads before
the forward and the others after it), then `Scheduler.update_from_output`. The forward is
`runner.ModelRunner`'s: it checks, block by block, the bytes of every token the scheduler counts
as computed, writes those of this step's tokens and samples one token per request whose prompt is
complete.

Runs in vLLM's environment only (it imports vLLM); the repository root must be on `sys.path`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.kv_offload.base import OffloadingWorker
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.utils import allocate_kv_cache

from connectors.vllm.run import ENGINE_BLOCK, ENGINE_SETTINGS, LLAMA, model_config
from tests.connectors.vllm_harness.recorder import Event, ManagerRecorder, Recorder
from tests.connectors.vllm_harness.runner import LAYER_NAMES, ModelRunner

__all__ = ["Engine", "MODEL_CONFIG"]

HEAD_DIM, KV_HEADS, LAYERS = LLAMA.head_dim, LLAMA.kv_heads, LLAMA.layers
MODEL_CONFIG = model_config(LLAMA)
"""The tiny Llama of `connectors.vllm.run`: only its shape matters here (no weights)."""


class Engine:
    """vLLM's scheduler and connector roles over CPU KV cache tensors. Harness thread."""

    def __init__(
        self,
        workdir: Path,
        extra: dict[str, Any],
        *,
        engine_blocks: int = 18,
        between_roles: Callable[[], None] | None = None,
        load_failure_policy: str | None = None,
    ) -> None:
        """`between_roles`: called once the worker role is built and before the scheduler
        is (what can happen between two processes' starts: a config file edited). A
        scheduler that cannot be built shuts the worker role down before the error goes on.
        `load_failure_policy`: vLLM's `kv_load_failure_policy` (None: vLLM's default)."""
        model = workdir / "model"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
        args = EngineArgs(
            model=str(model),
            **ENGINE_SETTINGS,
            max_model_len=512,
            kv_transfer_config={
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
            | (
                {}
                if load_failure_policy is None
                else {"kv_load_failure_policy": load_failure_policy}
            ),
        )
        with _no_triton_check():
            self.config: VllmConfig = args.create_engine_config()
        self.workdir = workdir
        self.steps = 0
        self.events: list[Event] = []
        self.errored: set[str] = set()
        """Requests vLLM ended with an error (`FinishReason.ERROR`: a failed load, 0.34+)."""
        with set_current_vllm_config(self.config):
            kv_cache_config, scheduler_kv_cache_config = self._plan(engine_blocks)
            self._start_worker(kv_cache_config)
        if between_roles is not None:
            between_roles()
        block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, self.config
        )
        try:
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=scheduler_kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size,
                hash_block_size=hash_block_size,
                log_stats=True,
            )
        except BaseException:
            ensure_kv_transfer_shutdown()
            raise
        scheduler_role = self.scheduler.connector.connector_scheduler
        scheduler_role.manager = ManagerRecorder(scheduler_role.manager, self.events)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn)

    # -- what the engine core and the worker do at start-up -------------------------------

    def _plan(self, engine_blocks: int) -> tuple[KVCacheConfig, KVCacheConfig]:
        """The engine core's `_initialize_kv_caches`, with this model's attention layers as
        the worker's KV cache specs and exactly `engine_blocks` blocks of memory."""
        register_all_kvcache_specs(self.config)
        spec = FullAttentionSpec(
            block_size=ENGINE_BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
        specs: dict[str, KVCacheSpec] = dict.fromkeys(LAYER_NAMES, spec)
        layouts = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
        self.layout = resolve_kv_cache_layout(self.config, [layouts], list(specs.values()))
        (kv_cache_config,) = _kv_cache_configs(
            self.config, specs, engine_blocks * spec.page_size_bytes * LAYERS
        )
        kv_cache_config.kv_cache_layout = self.config.cache_config.kv_cache_layout
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config([kv_cache_config])
        self.config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, self.config
        )
        alignment = resolve_cache_hit_alignment_tokens(
            scheduler_kv_cache_config, self.config, block_size, hash_block_size
        )
        for config in (kv_cache_config, scheduler_kv_cache_config):
            config.hash_block_size = hash_block_size
            config.cache_hit_alignment_tokens = alignment
        return kv_cache_config, scheduler_kv_cache_config

    def _start_worker(self, kv_cache_config: KVCacheConfig) -> None:
        """The CPU worker's `init_device` and `initialize_from_config`: distributed state, the
        worker-role connector, the KV cache tensors registered with it (the model runner's
        `initialize_kv_cache`)."""
        if not model_parallel_is_initialized():  # once per process, as in a worker
            init_worker_distributed_environment(
                self.config, 0, f"file://{self.workdir / 'distributed-init'}", 0, "gloo"
            )
        cache = self.config.cache_config
        cache.num_gpu_blocks = kv_cache_config.num_blocks
        cache.hash_block_size = kv_cache_config.hash_block_size
        cache.cache_hit_alignment_tokens = kv_cache_config.cache_hit_alignment_tokens
        ensure_kv_transfer_initialized(self.config, kv_cache_config)
        self.kv_caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), self.layout, [ENGINE_BLOCK]
        )
        for name in LAYER_NAMES:  # the shape `write`/`check` index: (block, head, token, K|V)
            shape = tuple(self.kv_caches[name].shape)
            assert shape == (kv_cache_config.num_blocks, KV_HEADS, ENGINE_BLOCK, 2 * HEAD_DIM), (
                name,
                shape,
            )
        self.connector = get_kv_transfer_group()
        self.runner_connector = _runner_connector(self.config, self.connector, self.kv_caches)
        worker = self.connector.connector_worker
        assert isinstance(worker.worker, OffloadingWorker)
        worker.worker = Recorder(worker.worker, self.events)
        self.runner = ModelRunner(self.kv_caches)

    # -- requests and steps ----------------------------------------------------------------

    def add_request(self, name: str, prompt: list[int], max_tokens: int = 8) -> None:
        self.runner.add(name, prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add_request(
            Request(
                request_id=name,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.block_hasher,
            )
        )

    def run(self, timeout: float = 120.0) -> None:
        """Step while the scheduler has work, as the engine core's busy loop does: until the
        requests have finished and the connector has nothing in flight."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the engine did not finish in {timeout} s ({self.steps} steps)"
                )
            self.step()

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.steps += 1
        if self.runner_connector is not None:
            output = self._step_034(out)
        else:
            output = self._step_032(out)
        for outputs in self.scheduler.update_from_output(out, output).values():
            for finished in outputs.outputs:
                reason = finished.finish_reason
                if reason is not None and reason.name == "ERROR":
                    self.errored.add(finished.request_id)

    def _step_032(self, out: Any) -> ModelRunnerOutput:
        """A step as vLLM 0.32 and 0.33's model runner takes it (`KVConnectorModelRunnerMixin`)."""
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        self.connector.handle_preemptions(out.kv_connector_metadata)
        if out.total_num_scheduled_tokens == 0:
            output: ModelRunnerOutput = KVConnectorModelRunnerMixin.kv_connector_no_forward(
                out, self.config
            )
            time.sleep(0.001)  # an idle step: the connector's background work goes on
            return output
        with (
            set_forward_context(None, self.config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output,
        ):
            self.note("forward")
            req_ids, sampled = self.runner.forward(out, self.steps)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    def _step_034(self, out: Any) -> ModelRunnerOutput:
        """A step as vLLM 0.34's CPU model runner takes it (`ActiveKVConnector`: preemptions
        and the step's expedited loads before the forward, the other loads after it)."""
        connector = self.runner_connector
        if out.total_num_scheduled_tokens == 0:
            output: ModelRunnerOutput = connector.no_forward(out)
            time.sleep(0.001)  # an idle step: the connector's background work goes on
            return output
        with set_forward_context(None, self.config):
            connector.pre_forward(out)
            self.note("forward")
            req_ids, sampled = self.runner.forward(out, self.steps)
            connector.finish_forward()
            kv_output = connector.post_forward(out.finished_req_ids)
        return ModelRunnerOutput(  # (0.34 derives the request index from `req_ids`)
            req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output
        )

    def note(self, kind: str) -> None:
        self.events.append(Event(kind, step=self.steps))

    def reset_cache(self, reset_running_requests: bool = False) -> bool:
        """What `LLM.reset_prefix_cache(reset_running_requests, reset_connector=True)` reaches,
        between steps: the engine's prefix cache and the connector's `reset_cache`."""
        self.note("reset")
        return self.scheduler.reset_prefix_cache(
            reset_running_requests=reset_running_requests, reset_connector=True
        )

    def close(self) -> None:
        ensure_kv_transfer_shutdown()
        self.scheduler.shutdown()


def _kv_cache_configs(
    config: VllmConfig, specs: dict[str, KVCacheSpec], available: int
) -> list[KVCacheConfig]:
    """The engine core's KV cache planning for one worker. vLLM 0.33 moved it to
    `kv_cache_planning`, with the model's KV cache groups computed first (and the DCP
    interleave adjusted from them, which 0.32 does in `ensure_kv_transfer_initialized`)."""
    try:
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(config, [specs], [available])
    groups = get_global_kv_cache_groups(config, [specs])
    config.adjust_dcp_kv_cache_interleave_size(groups)
    return get_kv_cache_configs(config, [specs], [available], groups)


@contextmanager
def _no_triton_check() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses an x86 CPU without Triton when it checks the config,
    for its model runner's kernels; the harness runs no kernel (its forward is
    `runner.ModelRunner`'s), so the check is told Triton is there while the config is built,
    and only then."""
    try:
        import vllm.triton_utils as triton_utils
    except ImportError:
        yield
        return
    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had


def _runner_connector(config: VllmConfig, connector: Any, kv_caches: dict[str, Any]) -> Any:
    """What registers the KV caches with the worker-role connector: vLLM 0.34's CPU model runner
    builds an `ActiveKVConnector` (which registers them) and drives the connector through it,
    returned; before 0.34 the model runner registers them itself (None returned)."""
    try:
        from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector
    except ImportError:  # vLLM 0.32 and 0.33
        connector.register_kv_caches(kv_caches)
        return None
    return ActiveKVConnector(config, kv_caches)


@contextmanager
def engine(workdir: Path, extra: dict[str, Any], **kw: Any) -> Iterator[Engine]:
    built = Engine(workdir, extra, **kw)
    try:
        yield built
    finally:
        built.close()
