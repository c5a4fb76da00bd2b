"""Run a scenario (prompts or chats, with or without kvtier) in a real vLLM engine, in vLLM's own
virtual environment (`kvtier.venv`), and return what it produced and measured.

The engine side is `connectors.vllm.run`, a script that only vLLM's environment can run; this
module is its caller, importable without vLLM (`kvtier demo` and the end-to-end tests use it).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_scenario", "run_scenarios"]


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
    end of the engine step that sampled its first token, vLLM's own request metrics), `at`
    (when it was sent, Unix seconds);
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
    `settle_timeout` seconds, default 120; in-process engines only), `settle_each` (default False:
    settle after every prompt of `prompts` too, as vLLM's own engine process steps between
    requests, so that a prompt's time holds none of the stores the one before it left),
    `kill_after` (a crash:
    after the prompts and the settling, the engine idles this many seconds, writes its result
    and is killed with SIGKILL, no shutdown run). `uniproc` (default True) keeps
    scheduler and worker in one process; False is vLLM's default deployment, scheduler and
    worker in separate processes. `tensor_parallel_size` (default 1): above 1, one worker
    process per rank (vLLM's multiprocess executor; on CPUs give each rank its cores with
    `VLLM_CPU_OMP_THREADS_BIND` in `env`, e.g. "0|1"), the scheduler where `uniproc` says.
    `fleet`: this engine is one of several run at once (`run_scenarios`) that share the
    `conversations` and serve the turns of them that `connectors.rendezvous.serve` describes
    (`dir`, `engine`, `engines`, `turns`, `think`, `timeout`), each stepping until its stores
    and demotions have ended before the next engine takes the conversation over (in-process
    engines only); its outputs carry their `conversation`, `turn` and `waited` (`kvtier.chat_fleet`
    builds such fleets).
    """
    tell = None if progress is None else functools.partial(_drop_index, progress)
    (result,) = run_scenarios(python, [scenario], workdir, timeout, tell)
    return result


def _drop_index(progress: Callable[[str], None], _: int, status: str) -> None:
    progress(status)


def run_scenarios(
    python: Path,
    scenarios: Sequence[dict[str, Any]],
    workdir: Path,
    timeout: float = 900,
    progress: Callable[[int, str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every scenario of `scenarios` at the same time, each in an engine process of its
    own (`run_scenario`'s, started one after another without waiting), and return their
    results in that order. `progress` is called with the index of the scenario and what its
    engine is doing. The first engine that fails, or the `timeout` (for all of them
    together), stops every other engine at once: a `RuntimeError` with the failed one's
    output, or `subprocess.TimeoutExpired`."""
    deadline = time.monotonic() + timeout
    engines: list[_Engine] = []
    try:
        for index, scenario in enumerate(scenarios):
            tell = None if progress is None else functools.partial(progress, index)
            engines.append(_Engine(python, scenario, workdir, tell))
        running = list(engines)
        while running:
            for engine in running:
                engine.poll()
            for engine in [e for e in running if e.returncode is not None]:
                running.remove(engine)
                if not engine.result_path.exists():  # a crash after its result is no failure
                    raise RuntimeError(engine.failure())
            if running and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(engine_command(python), timeout)
            time.sleep(0.05)
    finally:  # a failure, a timeout, an interrupt: the other engines go too
        for engine in engines:
            engine.stop()
    return [engine.result() for engine in engines]


def engine_command(python: Path) -> list[str]:
    return [str(python), "-m", "connectors.vllm.run"]


class _Engine:
    """The caller's thread: one engine process running a scenario (`connectors.vllm.run`), its
    output in files of `workdir` (pipes would have to be drained while other engines run)."""

    def __init__(
        self,
        python: Path,
        scenario: dict[str, Any],
        workdir: Path,
        progress: Callable[[str], None] | None,
    ) -> None:
        root = Path(__file__).resolve().parent.parent  # where kvtier's packages are
        name = f"scenario-{os.getpid()}-{time.monotonic_ns()}"
        path = workdir / f"{name}.json"
        self.result_path = workdir / f"{name}.result.json"
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
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
        self.follow = None
        if progress is not None:
            self.follow = _Follower(workdir / f"{name}.progress", progress)
            scenario = {**scenario, "progress": str(self.follow.path)}
        path.write_text(json.dumps(scenario))
        with self.stdout_path.open("wb") as stdout, self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [*engine_command(python), str(path), str(self.result_path)],
                stdout=stdout,
                stderr=stderr,
                env=env,
                cwd=root,
            )
        self.returncode: int | None = None

    def poll(self) -> None:
        self.returncode = self.proc.poll()
        if self.follow is not None:
            self.follow.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log(self) -> tuple[str, str]:
        read = {"encoding": "utf-8", "errors": "replace"}
        return self.stdout_path.read_text(**read), self.stderr_path.read_text(**read)

    def failure(self) -> str:
        stdout, stderr = self.log()
        tail = "\n".join((stderr or stdout).splitlines()[-40:])
        return f"vLLM run failed (exit {self.proc.returncode}):\n{tail}"

    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.result_path.read_text())
        stdout, stderr = self.log()
        return {**result, "log": stdout + stderr}


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
