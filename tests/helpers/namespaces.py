"""Python run in a pid namespace of its own, as a process in another container sharing /dev/shm
is (`unshare --pid --fork --mount-proc --kill-child`: its own /proc, as a container has, and the
namespace ends with unshare; test process: the child is pid 1 there and sees none of ours)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

__all__ = ["in_another_pid_namespace", "unshare_pid"]


def unshare_pid() -> list[str]:
    """The command prefix that runs a command in a new pid namespace; the test is skipped
    where namespaces cannot be made (no `unshare`, or not allowed: it takes root or user
    namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()}")
    return [unshare, "--pid", "--fork", "--mount-proc", "--kill-child"]


def in_another_pid_namespace(code: str, *args: str, timeout: float = 60) -> str:
    """The standard output of `python -c code args...` run in a new pid namespace, which it
    checks it is in (`unshare_pid`)."""
    prefix = unshare_pid()
    ours = os.readlink("/proc/self/ns/pid")
    check = f"import os, sys; assert os.readlink('/proc/self/ns/pid') != {ours!r}\n"
    done = subprocess.run(
        [*prefix, sys.executable, "-c", check + code, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
