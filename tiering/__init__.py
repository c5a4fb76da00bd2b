"""kvtier's control plane: keys and namespaces, the object format and the tier contract, the
registries of pluggable names (tier types, eviction policies, placement policies), the CPU
primary pool's bookkeeping, the tiering manager, the configuration schema, the background I/O
runtime with its breakers, metrics and the shipped test suites. Pure Python beside two optional
compiled cores; never imports vLLM or a backend module at import time (the command line is
`kvtier/`)."""

__version__ = "0.1.0"
