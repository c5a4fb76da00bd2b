"""Engine glue: the adapters between inference engines and kvtier's manager and copy engines.

`connectors.vllm` (vLLM 0.32's OffloadingSpec) is the only place that imports vLLM.
`connectors.venv` prepares the separate virtual environment vLLM runs in on this project's
machines; it does not import vLLM.
"""
