"""kvtier's control plane: keys and namespaces, eviction policies, the primary tier's
bookkeeping, configuration and the command line. Pure Python; never imports vLLM or a backend
module at import time."""

__version__ = "0.1.0"
