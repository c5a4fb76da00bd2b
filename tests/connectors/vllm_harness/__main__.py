"""`python -m tests.connectors.vllm_harness WORKDIR RESULT.json NAME...`, with vLLM's python
and the repository root on PYTHONPATH: runs the named scenarios (`scenarios.SCENARIOS`) one
after another in this process, each in `WORKDIR/NAME`, and writes `{name: what it observed}`
to RESULT.json after each one; a scenario that raised reports `{"error": its traceback}`."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.connectors.vllm_harness.scenarios import SCENARIOS

    workdir, result_path, *names = argv
    results: dict[str, object] = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](Path(workdir) / name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
