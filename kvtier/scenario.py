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
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_scenario"]


def run_scenario(
    python: Path,
    scenario: dict[str, Any],
    workdir: Path,
    timeout: float = 900,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `scenario` with the vLLM environment's `python` in a subprocess; its result, with
    the engine's output (vLLM's and kvtier's log lines) under `log`. `progress` is called on
    this thread with what the engine is doing, as it changes (`starting`, `warming up`,
    `request 5/16`, `done`).

    The result: `outputs`, one per request in the order run, each with `prompt_tokens`,
    `tokens` and `logprobs` (the completion), `cached_tokens` (prompt tokens not computed:
    from the engine's own prefix cache or from kvtier), `seconds` (the wall time of the
    request, every token of it) and `ttft` (its time to first token: from its arrival to the
    end of the engine step that sampled its first token, vLLM's own request metrics);
    `metrics`, the counters of `connectors.vllm.run._METRICS` over the requests; `seconds`,
    the wall time of all requests.

    Scenario keys besides the prompts: `model_dir` (written there unless it holds the model of
    `model_seed`, default `connectors.vllm.run.MODEL_SEED`, and of `model`), `model` (the
    fields of `connectors.vllm.run.Shape`, e.g. `{"kind": "qwen3", "heads": 8}`; default: the
    2-layer Llama), `engine_blocks` (the engine's KV cache, in blocks of 32 tokens, shared by
    a hybrid model's KV-cache groups), `max_model_len`, `max_tokens`, `extra`
    (`kv_connector_extra_config`; None: no offloading), `warmup` (a prompt run first and left out
    of the result: its output, time and counters; a fresh engine's first request pays one-time
    costs), `prefix_caching_hash_algo`, `env`
    (variables for the engine; a null value removes one), `settle` (default False: after the
    prompts, step the engine until its stores and kvtier's demotions have ended, at most
    `settle_timeout` seconds, default 120; in-process engines only). `uniproc` (default True) keeps
    scheduler and worker in one process; False is vLLM's default deployment, scheduler and
    worker in separate processes. `tensor_parallel_size` (default 1): above 1, one worker
    process per rank (vLLM's multiprocess executor; on CPUs give each rank its cores with
    `VLLM_CPU_OMP_THREADS_BIND` in `env`, e.g. "0|1"), the scheduler where `uniproc` says.
    """
    root = Path(__file__).resolve().parent.parent  # where kvtier's packages are
    name = f"scenario-{os.getpid()}-{time.monotonic_ns()}"
    path = workdir / f"{name}.json"
    result_path = workdir / f"{name}.result.json"
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
    follow = None
    if progress is not None:
        follow = _Follower(workdir / f"{name}.progress", progress)
        scenario = {**scenario, "progress": str(follow.path)}
    path.write_text(json.dumps(scenario))
    with subprocess.Popen(
        [str(python), "-m", "connectors.vllm.run", str(path), str(result_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    ) as proc:
        deadline = time.monotonic() + timeout
        try:
            while True:
                wait = max(0.0, min(0.25, deadline - time.monotonic()))
                try:
                    stdout, stderr = proc.communicate(timeout=wait)
                    break
                except subprocess.TimeoutExpired:  # communicate() again loses no output
                    if time.monotonic() >= deadline:
                        raise
                if follow is not None:
                    follow.poll()
        except BaseException:  # a timeout, an interrupt: the engine goes too
            proc.kill()
            raise
    if follow is not None:
        follow.poll()
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
        return {**result, "log": stdout + stderr}
    tail = "\n".join((stderr or stdout).splitlines()[-40:])
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")


class _Follower:
    """The `kvtier` process's main thread: passes each complete line that the engine appended
    to `path` (the scenario's `progress` file) to `progress`, once."""

    def __init__(self, path: Path, progress: Callable[[str], None]) -> None:
        self.path = path
        self.progress = progress
        self.seen = 0
        path.write_text("")

    def poll(self) -> None:
        *complete, _ = self.path.read_text().split("\n")  # a line being written waits
        for status in complete[self.seen :]:
            self.progress(status)
        self.seen = len(complete)
