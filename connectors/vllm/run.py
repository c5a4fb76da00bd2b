"""Drive a real vLLM 0.32 engine on the CPU, with or without kvtier, through a list of prompts.

Runs inside the vLLM virtual environment as a script, never imported by kvtier itself:
`python -m connectors.vllm.run SCENARIO.json RESULT.json` writes the result to RESULT.json.
`kvtier demo` and the end-to-end tests use it; `kvtier.scenario.run_scenario` is how they call
it (and documents the scenario's keys).

The model is a tiny Llama written locally with realistic random weights (embeddings ~N(0,1),
projections ~N(0, 1/fan_in)), so outputs depend on the context and a wrong KV load changes
them. No tokenizer: prompts are token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HIDDEN, HEADS, KV_HEADS, LAYERS, INTER, VOCAB = 128, 4, 2, 2, 256, 1000
HEAD_DIM = HIDDEN // HEADS
ENGINE_BLOCK = 32


MODEL_SEED = 1234


def write_model(path: Path, seed: int = MODEL_SEED) -> Path:
    """A Llama with 2 layers, head_dim 32 (CPU attention needs 32..512), float32, its weights
    drawn from `seed`. A folder holding the model of another seed is written over: same config,
    same safetensors header and sizes, other weight bytes."""
    import torch
    from safetensors.torch import save_file

    marker = path / ".kvtier-seed"
    if (
        (path / "model.safetensors").exists()
        and marker.exists()
        and marker.read_text() == str(seed)
    ):
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN, std=HIDDEN**-0.5),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=HIDDEN**-0.5),
            p + "mlp.gate_proj.weight": normal(INTER, HIDDEN, std=HIDDEN**-0.5),
            p + "mlp.up_proj.weight": normal(INTER, HIDDEN, std=HIDDEN**-0.5),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTER, std=INTER**-0.5),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    marker.write_text(str(seed))
    return path


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = write_model(Path(scenario["model_dir"]), scenario.get("model_seed", MODEL_SEED))
    transfer = None
    if scenario.get("extra") is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=scenario["extra"],
        )
    kwargs: dict[str, Any] = {}
    if scenario.get("uniproc", True):
        kwargs["distributed_executor_backend"] = "uni"
    if scenario.get("prefix_caching_hash_algo") is not None:
        kwargs["prefix_caching_hash_algo"] = scenario["prefix_caching_hash_algo"]
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        dtype="float32",
        seed=0,
        block_size=ENGINE_BLOCK,
        kv_cache_memory_bytes=scenario["engine_blocks"]
        * ENGINE_BLOCK
        * LAYERS
        * 2
        * KV_HEADS
        * HEAD_DIM
        * 4,
        max_model_len=scenario.get("max_model_len", 512),
        max_num_seqs=4,
        kv_transfer_config=transfer,
        disable_log_stats=False,
        **kwargs,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=scenario.get("max_tokens", 8),
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
    )
    outputs = []
    start = time.perf_counter()

    def generate(prompt: list[int], llm: Any = llm) -> list[int]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
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
            }
        )
        return list(completion.token_ids)

    for prompt in scenario.get("prompts", []):  # one at a time: each sees the earlier ones' KV
        generate(prompt)
    # Chats: turn t of every conversation, then turn t + 1; a turn's prompt is the whole
    # conversation so far (earlier prompts and answers) followed by the new user message.
    histories: list[list[int]] = [[] for _ in scenario.get("conversations", [])]
    for turn in range(max((len(c) for c in scenario.get("conversations", [])), default=0)):
        for history, messages in zip(histories, scenario["conversations"], strict=True):
            if turn < len(messages):
                history += messages[turn]
                history += generate(history)
    elapsed = time.perf_counter() - start
    # Straight from the Prometheus registry: LLM.get_metrics() rounds counters to integers,
    # which turns the copy-time counters (seconds) into zeros.
    from prometheus_client import REGISTRY

    totals = {key: 0.0 for keys in _METRICS.values() for key in keys}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                name = (sample.name[: -len("_total")], sample.labels.get("source"))
                for key in _METRICS.get(name, ()):
                    totals[key] += sample.value
    del llm
    return {"outputs": outputs, "metrics": totals, "seconds": elapsed}


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
    ("vllm:kvtier_tier_promotions", None): ("tier_promotions",),
    ("vllm:kvtier_tier_demotions", None): ("tier_demotions",),
}
"""vLLM metrics the scenario reports: (name, source label) -> the result keys it adds to.
`kvtier_cached_tokens` is every prompt token kvtier served, by any source: host (the CPU
primary), disk (promoted from a file tier), remote (from Redis or S3)."""


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
