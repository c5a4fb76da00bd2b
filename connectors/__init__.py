"""Engine glue: the adapters between inference engines and kvtier's manager and copy engines.

`connectors.vllm` (vLLM 0.32's and 0.33's OffloadingSpec) is the only place that imports vLLM;
`connectors.resources` owns what a role holds open; `roles` and `startup` check a role at its
start, `identity` names the model in the namespace, `rendezvous` hands a fleet's turns between
engines.
The separate virtual environment vLLM runs in on this project's machines is prepared by the
application package (`python -m kvtier.venv`).
"""
