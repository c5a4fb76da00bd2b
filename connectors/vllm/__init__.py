"""kvtier for vLLM (the releases of `connectors.vllm.versions`): load it by configuration alone.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
                                    "spec_module_path": "connectors.vllm",
                                    "config": "tiers.yaml"}}'

This package is the only place kvtier imports vLLM. `TieredOffloadingSpec` is imported when vLLM
asks for it (`getattr` on this package), so `connectors.vllm.versions` is importable where vLLM
is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connectors.vllm.spec import TieredOffloadingSpec

__all__ = ["TieredOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "TieredOffloadingSpec":
        from connectors.vllm.spec import TieredOffloadingSpec

        return TieredOffloadingSpec
    raise AttributeError(f"module 'connectors.vllm' has no attribute {name!r}")
