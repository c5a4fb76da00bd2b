"""Run a scenario (prompts or chats, with or without kvtier) in a real vLLM engine, in vLLM's own
virtual environment (`kvtier.venv`), and return what it produced and measured.

The engine side is `connectors.vllm.run`, a script that only vLLM's environment can run; this
module is its caller, importable without vLLM (`kvtier demo` and the end-to-end tests use it).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["run_scenario"]


def run_scenario(
    python: Path, scenario: dict[str, Any], workdir: Path, timeout: float = 900
) -> dict[str, Any]:
    """Run `scenario` with the vLLM environment's `python` in a subprocess; its result, with
    the engine's output (vLLM's and kvtier's log lines) under `log`.

    Scenario keys besides the prompts: `model_dir` (written there unless it holds the model of
    `model_seed`, default `connectors.vllm.run.MODEL_SEED`, and of `model`), `model` (the
    fields of `connectors.vllm.run.Shape`, e.g. `{"kind": "qwen3", "heads": 8}`; default: the
    2-layer Llama), `engine_blocks` (the engine's KV cache, in blocks of 32 tokens, shared by
    a hybrid model's KV-cache groups), `max_model_len`, `max_tokens`, `extra`
    (`kv_connector_extra_config`; None: no offloading), `prefix_caching_hash_algo`, `env`
    (variables for the engine; a null value removes one). `uniproc` (default True) keeps
    scheduler and worker in one process; False is vLLM's default deployment, scheduler and
    worker in separate processes. `tensor_parallel_size` (default 1): above 1, one worker
    process per rank (vLLM's multiprocess executor; on CPUs give each rank its cores with
    `VLLM_CPU_OMP_THREADS_BIND` in `env`, e.g. "0|1"), the scheduler where `uniproc` says.
    """
    root = Path(__file__).resolve().parent.parent  # where kvtier's packages are
    name = f"scenario-{os.getpid()}-{time.monotonic_ns()}"
    path = workdir / f"{name}.json"
    result_path = workdir / f"{name}.result.json"
    path.write_text(json.dumps(scenario))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if scenario.get("uniproc", True) else "1",
    }
    for variable, value in scenario.get("env", {}).items():
        if value is None:
            env.pop(variable, None)
        else:
            env[variable] = str(value)
    proc = subprocess.run(
        [str(python), "-m", "connectors.vllm.run", str(path), str(result_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=timeout,
    )
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
        return {**result, "log": proc.stdout + proc.stderr}
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-40:])
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")
