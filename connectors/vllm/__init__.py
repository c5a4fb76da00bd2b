"""kvtier for vLLM 0.32 and 0.33: load it by configuration alone.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieredOffloadingSpec",
                                    "spec_module_path": "connectors.vllm",
                                    "config": "tiers.yaml"}}'

This package is the only place kvtier imports vLLM.
"""

from connectors.vllm.spec import TieredOffloadingSpec

__all__ = ["TieredOffloadingSpec"]
