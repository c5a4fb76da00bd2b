"""Drive a real vLLM 0.32 engine on the CPU, with or without kvtier, through a list of prompts.

Runs inside the vLLM virtual environment as a script, never imported by kvtier itself:
`python -m connectors.vllm.run SCENARIO.json RESULT.json` writes the result to RESULT.json.
`kvtier demo` and the end-to-end tests use it; `kvtier.scenario.run_scenario` is how they call
it (and documents the scenario's keys).

The model is tiny and written locally with realistic random weights (embeddings ~N(0,1),
projections ~N(0, 1/fan_in)), so outputs depend on the context and a wrong KV load changes
them: a 2-layer Llama, or the `Shape` the scenario's `model` key names (a GQA Qwen3, a Gemma3
mixing sliding-window and full attention). No tokenizer: prompts are token ids.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connectors import rendezvous
from tiering.manager import counters
from tiering.manager.counters import metric

if TYPE_CHECKING:
    import torch

ENGINE_BLOCK = 32
MODEL_SEED = 1234
ENGINE_SETTINGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "dtype": "float32",
    "seed": 0,
    "block_size": ENGINE_BLOCK,
    "max_num_seqs": 4,
}
"""vLLM engine arguments every scenario shares (and the interface harness's scheduler)."""
ATTENTION = {"sliding": "sliding_attention", "full": "full_attention"}
"""`Shape.layer_types` as Gemma3's config names them."""


@dataclass(frozen=True, slots=True)
class Shape:
    """The shape of the tiny model a scenario runs (its `model` key; the default is the
    2-layer Llama every other scenario runs).

    `kind`: `llama` (LlamaForCausalLM), `qwen3` (Qwen3ForCausalLM: per-head q_norm/k_norm),
    `gemma3` (Gemma3ForCausalLM, text-only: sliding-window and full-attention layers after
    `layer_types`, `sliding` for a sliding-window layer and `full` for a full one; vLLM puts
    each kind in its own KV-cache groups). CPU attention needs `head_dim` in {32, 64, 80, 96,
    112, 128, ...}.
    """

    kind: str = "llama"
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    layers: int = 2
    intermediate: int = 256
    vocab: int = 1000
    sliding_window: int = 64
    layer_types: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: dict[str, Any] | None) -> Shape:
        fields = dict(model or {})
        if "layer_types" in fields:
            fields["layer_types"] = tuple(fields["layer_types"])
        shape = cls(**fields)
        if shape.kind not in ("llama", "qwen3", "gemma3"):
            raise ValueError(f"model kind {shape.kind!r}: expected llama, qwen3 or gemma3")
        if shape.kind == "gemma3" and len(shape.layer_types) != shape.layers:
            raise ValueError(f"gemma3: {shape.layers} layers need as many layer_types")
        if shape.kind != "gemma3" and shape.layer_types:
            raise ValueError("layer_types: only a gemma3 model mixes attention kinds")
        if any(t not in ATTENTION for t in shape.layer_types):
            raise ValueError(f"layer_types {shape.layer_types}: each is sliding or full")
        return shape

    @property
    def cache_tensors(self) -> int:
        """KV-cache tensors vLLM allocates: one per layer, or, for a hybrid model, one per
        layer of a KV-cache group (vLLM's `_get_kv_cache_groups_uniform_page_size`: the
        groups have the size of the smallest layer kind, or of the largest when that is less
        than 1.5 times the smallest)."""
        counts = [self.layer_types.count(t) for t in ATTENTION if t in self.layer_types]
        if len(counts) < 2:
            return self.layers
        return max(counts) if max(counts) < 1.5 * min(counts) else min(counts)

    def kv_cache_bytes(self, blocks: int, tensor_parallel_size: int = 1) -> int:
        """What `kv_cache_memory_bytes` (per worker) must be for `blocks` engine blocks."""
        kv_heads = max(1, self.kv_heads // tensor_parallel_size)
        return blocks * ENGINE_BLOCK * self.cache_tensors * 2 * kv_heads * self.head_dim * 4


LLAMA = Shape()


def write_model(path: Path, seed: int = MODEL_SEED, shape: Shape = LLAMA) -> Path:
    """A model of `shape`, float32, its weights drawn from `seed` at a realistic scale. A folder
    holding the model of another seed or shape is written over (another seed of the same shape:
    same config, same safetensors header and sizes, other weight bytes)."""
    import torch
    from safetensors.torch import save_file

    marker = path / ".kvtier-seed"
    # The default model's marker is its seed alone, as before shapes existed.
    mark = str(seed) if shape == LLAMA else json.dumps({"seed": seed, **asdict(shape)})
    if (path / "model.safetensors").exists() and marker.exists() and marker.read_text() == mark:
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def normal(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std

    config, weights = _model(shape, normal)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    marker.write_text(mark)
    return path


def model_config(shape: Shape = LLAMA) -> dict[str, Any]:
    """The config.json of a model of `shape` (for the default Llama, that of the first version:
    model folders already written stay the same)."""
    gemma = shape.kind == "gemma3"
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[shape.kind]],
        "model_type": _MODEL_TYPES[shape.kind],
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "num_hidden_layers": shape.layers,
        "vocab_size": shape.vocab,
        "head_dim": shape.head_dim,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if shape.kind == "qwen3":
        config["attention_bias"] = False
    if gemma:
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": shape.head_dim,
            "sliding_window": shape.sliding_window,
            "layer_types": [ATTENTION[t] for t in shape.layer_types],
            "pad_token_id": 0,
        }
    return config


def _model(
    shape: Shape, normal: Callable[..., torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config.json and weights of `shape`: embeddings ~N(0, 1) (Gemma3 scales its
    embeddings by sqrt(hidden), so ~N(0, 1/hidden) there), projections ~N(0, 1/fan_in), norms
    neutral (Gemma's norms multiply by 1 + weight). For the default Llama the config and the
    order of the draws are those of the first version, so model folders already written and
    the outputs tests compare stay the same."""
    import torch

    h, q, kv, inter, vocab = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.intermediate,
        shape.vocab,
    )
    gemma = shape.kind == "gemma3"
    norm = torch.zeros if gemma else torch.ones
    config = model_config(shape)
    weights = {
        "model.embed_tokens.weight": normal(vocab, h, std=h**-0.5 if gemma else 1.0),
        "model.norm.weight": norm(h),
        "lm_head.weight": normal(vocab, h, std=h**-0.5),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, q, std=h**-0.5),
            p + "mlp.gate_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(inter, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, inter, std=inter**-0.5),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
        if shape.kind != "llama":
            weights |= {
                p + "self_attn.q_norm.weight": norm(shape.head_dim),
                p + "self_attn.k_norm.weight": norm(shape.head_dim),
            }
        if gemma:
            weights |= {
                p + "pre_feedforward_layernorm.weight": norm(h),
                p + "post_feedforward_layernorm.weight": norm(h),
            }
    return config, weights


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    progress = _Progress(scenario.get("progress"))
    progress("starting")
    shape = Shape.of(scenario.get("model"))
    model = write_model(Path(scenario["model_dir"]), scenario.get("model_seed", MODEL_SEED), shape)
    transfer = None
    if scenario.get("extra") is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=scenario["extra"],
        )
    tensor_parallel = scenario.get("tensor_parallel_size", 1)
    kwargs: dict[str, Any] = {}
    if tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = "mp"  # one worker process per rank
    elif scenario.get("uniproc", True):
        kwargs["distributed_executor_backend"] = "uni"
    if scenario.get("prefix_caching_hash_algo") is not None:
        kwargs["prefix_caching_hash_algo"] = scenario["prefix_caching_hash_algo"]
    llm = LLM(
        model=str(model),
        **ENGINE_SETTINGS,
        kv_cache_memory_bytes=shape.kv_cache_bytes(scenario["engine_blocks"], tensor_parallel),
        max_model_len=scenario.get("max_model_len", 512),
        kv_transfer_config=transfer,
        disable_log_stats=False,
        tensor_parallel_size=tensor_parallel,
        **kwargs,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=scenario.get("max_tokens", 8),
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
    )
    if scenario.get("warmup"):
        # A fresh engine's first request pays one-time costs (kernel selection, allocations):
        # the warm-up takes them, and neither its output nor its counters are reported.
        progress("warming up")
        llm.generate([TokensPrompt(prompt_token_ids=scenario["warmup"])], params, use_tqdm=False)
    before = _totals()
    conversations = scenario.get("conversations", [])
    fleet = scenario.get("fleet")
    total = len(scenario.get("prompts", []))
    total += len(fleet["turns"]) if fleet else sum(len(c) for c in conversations)
    outputs = []
    start = time.perf_counter()

    def generate(
        prompt: list[int], labels: dict[str, Any] | None = None, llm: Any = llm
    ) -> list[int]:
        progress(f"request {len(outputs) + 1}/{total}")
        began, at = time.perf_counter(), time.time()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        seconds = time.perf_counter() - began
        completion = out.outputs[0]
        logprobs = completion.logprobs or []
        outputs.append(
            {
                "prompt_tokens": len(prompt),
                "tokens": list(completion.token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(logprobs, completion.token_ids, strict=True)
                ],
                "cached_tokens": out.num_cached_tokens,
                "seconds": seconds,
                "ttft": out.metrics.first_token_latency,
                "at": at,
                **(labels or {}),
            }
        )
        return list(completion.token_ids)

    for prompt in scenario.get("prompts", []):  # one at a time: each sees the earlier ones' KV
        generate(prompt)
        if scenario.get("settle_each"):  # as vLLM's engine process steps between requests
            settle(llm, float(scenario.get("settle_timeout", 120)))
    # Chats: turn t of every conversation, then turn t + 1; a turn's prompt is the whole
    # conversation so far (earlier prompts and answers) followed by the new user message. In a
    # fleet, this engine's turns alone, the others' handed over by the engines serving them.
    if fleet:
        timeout = float(scenario.get("settle_timeout", 120))
        rendezvous.serve(fleet, conversations, generate, functools.partial(settle, llm, timeout))
    else:
        histories: list[list[int]] = [[] for _ in conversations]
        for turn in range(max((len(c) for c in conversations), default=0)):
            for history, messages in zip(histories, conversations, strict=True):
                if turn < len(messages):
                    history += messages[turn]
                    history += generate(history)
    elapsed = time.perf_counter() - start
    if scenario.get("settle"):
        settle(llm, float(scenario.get("settle_timeout", 120)))
    totals = {key: value - before[key] for key, value in _totals().items()}
    result = {"outputs": outputs, "metrics": totals, "seconds": elapsed}
    if scenario.get("kill_after") is not None:
        # A crash: the engine idles `kill_after` seconds (kvtier's periodic work goes on), then
        # its process is killed with SIGKILL, no shutdown run: its result is written first.
        time.sleep(float(scenario["kill_after"]))
        Path(scenario["result"]).write_text(json.dumps(result))
        progress("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    progress("done")
    del llm
    return result


def _totals() -> dict[str, float]:
    """The counters of `_METRICS` so far, by result key. Straight from the Prometheus registry:
    LLM.get_metrics() rounds counters to integers, which turns the copy-time counters (seconds)
    into zeros."""
    from prometheus_client import REGISTRY

    totals = {key: 0.0 for keys in _METRICS.values() for key in keys}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                name = (sample.name[: -len("_total")], sample.labels.get("source"))
                for key in _METRICS.get(name, ()):
                    totals[key] += sample.value
    return totals


class _Progress:
    """The engine process's main thread: appends what the run is doing, one line at a time, to
    the scenario's `progress` file, which the caller (`kvtier.scenario`) follows; without one,
    nothing."""

    def __init__(self, path: str | None) -> None:
        self.path = None if path is None else Path(path)

    def __call__(self, status: str) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(status + "\n")


def settle(llm: Any, timeout: float) -> None:
    """Step the in-process engine until its scheduler has nothing left (`has_requests`, which
    counts the connector's pending work), at most `timeout` seconds. vLLM makes the store jobs
    of a finished request's last blocks on the next step, and kvtier demotes stored blocks to
    write-through tiers between steps; vLLM's own engine process keeps stepping while there is
    such work, but an in-process engine steps only while `generate` runs: without this, the
    last prompt's blocks never reach the primary, nor a write-through tier."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("settle: only an in-process engine (uniproc) can be stepped here")
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"settle: the engine still had work after {timeout:g} s")
        llm.llm_engine.step()
        time.sleep(0.001)  # the runtime's thread needs the GIL to end its jobs


_CACHED = "vllm:prompt_tokens_cached_by_source"
_METRICS = {
    (_CACHED, "device"): ("engine_cached_tokens",),
    (_CACHED, "host"): ("kvtier_cached_tokens", "host_cached_tokens"),
    (_CACHED, "disk"): ("kvtier_cached_tokens", "disk_cached_tokens"),
    (_CACHED, "external_unspecified"): ("kvtier_cached_tokens", "remote_cached_tokens"),
    ("vllm:kv_offload_load_bytes", None): ("load_bytes",),
    ("vllm:kv_offload_store_bytes", None): ("store_bytes",),
    ("vllm:kv_offload_load_time", None): ("load_seconds",),
    ("vllm:kv_offload_store_time", None): ("store_seconds",),
    (metric(counters.PROMOTIONS), None): ("tier_promotions",),
    (metric(counters.DEMOTIONS), None): ("tier_demotions",),
    (metric(counters.DEMOTIONS_DROPPED), None): ("demotions_dropped",),
    (metric(counters.DEMOTION_FAILURES), None): ("demotion_failures",),
    (metric(counters.BYTES_PROMOTED), None): ("bytes_promoted",),
    (metric(counters.PROMOTION_SECONDS), None): ("promotion_seconds",),
    (metric(counters.BLOCKS_WARMED), None): ("blocks_warmed",),
    (metric(counters.HITS_OTHER_WRITER), None): ("hits_other_writer",),
    (metric(counters.ERRORS), None): ("tier_errors",),
    (metric(counters.PROMOTION_FAILURES), None): ("promotion_failures",),
    (metric(counters.PROMOTIONS_LATE), None): ("promotions_late",),
}
"""vLLM metrics the scenario reports: (name, source label) -> the result keys it adds to.
`kvtier_cached_tokens` is every prompt token kvtier served, by any source: host (the CPU
primary), disk (promoted from a file tier), remote (from Redis or S3)."""


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    result = run({**json.loads(Path(sys.argv[1]).read_text()), "result": sys.argv[2]})
    Path(sys.argv[2]).write_text(json.dumps(result))
