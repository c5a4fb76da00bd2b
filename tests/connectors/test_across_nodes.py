"""Secondary tiers on an engine whose workers span nodes are refused at start with one line, on
every release (vLLM 0.34 refuses its own, vllm-project/vllm#54415): kvtier's tiers run in the
scheduler over the primary in its node's shared memory, where a worker on another node never
wrote its shard. The probe runs `connectors.vllm.spec._refuse_workers_across_nodes` in vLLM's
environment with vLLM's process groups replaced by stand-ins that say where each rank lives
(the one part of vLLM a single machine cannot give)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from connectors.vllm.versions import SUPPORTED_VLLM
from kvtier.venv import VLLM_TREE_VERSIONS, ensure_vllm_tree
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.vllm]

TREES = {".".join(v.split(".")[:2]): v for v in VLLM_TREE_VERSIONS}
_PROBE = r"""
import json
from types import SimpleNamespace
from vllm.distributed import parallel_state
from connectors.vllm import spec

def groups(tp_nodes, pp_nodes):
    def group(nodes):
        return SimpleNamespace(world_size=len(nodes), cpu_group=nodes)
    parallel_state.get_tp_group = lambda: group(tp_nodes)
    parallel_state.get_pp_group = lambda: group(pp_nodes)
    if hasattr(parallel_state, "get_pcp_group"):
        parallel_state.get_pcp_group = lambda: group(["a"])
    parallel_state.in_the_same_node_as = lambda nodes, source_rank=0: [
        node == nodes[source_rank] for node in nodes
    ]

found = {}
for name, tp, pp in [
    ("one node", ["a", "a"], ["a", "a"]),
    ("tensor parallel across nodes", ["a", "b"], ["a"]),
    ("pipeline parallel across nodes", ["a"], ["a", "b"]),
]:
    groups(tp, pp)
    try:
        spec._refuse_workers_across_nodes(["nvme", "redis"])
        found[name] = None
    except Exception as e:
        found[name] = f"{type(e).__name__}: {e}"
print(json.dumps(found))
"""


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_tiers_on_workers_across_nodes_are_refused_with_one_line(
    vllm_python: Path, version: str
) -> None:
    path = [str(ROOT)]
    if version in TREES:
        path.insert(0, str(ensure_vllm_tree(vllm_python, version=TREES[version])))
    out = subprocess.run(
        [str(vllm_python), "-c", _PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "VLLM_TARGET_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found["one node"] is None
    for case in ("tensor parallel across nodes", "pipeline parallel across nodes"):
        refusal = found[case]
        assert refusal is not None and refusal.startswith("ConfigError: kvtier's secondary tiers")
        assert "(nvme, redis)" in refusal and "span several nodes" in refusal
        assert "\n" not in refusal
