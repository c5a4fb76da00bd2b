"""`tiering.plugins.Registry`, the one registry behind tier types, eviction policies, gates and
admission policies: entry points, lazy paths, errors, and no scan of the installed
distributions for a built-in name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tiering.errors import ConfigError, UnknownNameError
from tiering.plugins import Registry
from tiering.policies import LRUPolicy, get_policy_class, policy_names


def registry(**kw: bool) -> Registry[LRUPolicy]:
    return Registry("widget", LRUPolicy, "kvtier.test-widgets", {"plain": LRUPolicy}, **kw)


def entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str, line: str) -> None:
    """A distribution on sys.path declaring `line` in the entry-point group `group`."""
    info = tmp_path / "kvtier_plugin_test-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvtier-plugin-test\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(f"[{group}]\n{line}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_an_eviction_policy_declared_in_the_entry_point_group_is_known_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry_point(tmp_path, monkeypatch, "kvtier.policies", "lru3 = tiering.policies.lru:LRUPolicy")
    assert "lru3" in policy_names()
    assert get_policy_class("lru3") is LRUPolicy


def test_a_name_is_found_built_in_registered_or_by_path() -> None:
    widgets = registry(paths=True)
    widgets.register("lazy", "tiering.policies.lru:LRUPolicy")
    assert widgets.get("plain") is LRUPolicy and widgets.get("lazy") is LRUPolicy
    assert widgets.get("tiering.policies.lru:LRUPolicy") is LRUPolicy
    assert widgets.names() == ["lazy", "plain"] and list(widgets) == widgets.names()
    assert widgets.builtin() == ["plain"]
    with pytest.raises(UnknownNameError, match="unknown widget 'tiering.policies.lru:LRUPolicy'"):
        registry().get("tiering.policies.lru:LRUPolicy")  # without paths, a path is no name


def test_the_errors_say_what_is_wrong() -> None:
    widgets = registry()
    with pytest.raises(UnknownNameError, match=r"unknown widget 'plane' \(did you mean 'plain'"):
        widgets.get("plane")
    with pytest.raises(ConfigError, match="widget 'plain' is already registered"):
        widgets.register("plain", LRUPolicy)
    widgets.register("odd", "collections:OrderedDict")
    with pytest.raises(
        ConfigError, match="'collections:OrderedDict' is not an? LRUPolicy subclass"
    ):
        widgets.get("odd")


def test_a_path_to_a_class_its_module_lacks_says_so() -> None:
    """As the gates' and policies' registries said before they were one: the class is missing,
    not of the wrong kind."""
    widgets = registry(paths=True)
    with pytest.raises(
        ConfigError,
        match="widget 'collections:Nope': cannot import 'collections:Nope': "
        "module 'collections' has no attribute 'Nope'",
    ):
        widgets.get("collections:Nope")


def test_a_built_in_name_is_resolved_without_importlib_metadata() -> None:
    code = (
        "import sys\n"
        "from tiering.registry import get_tier_class\n"
        "from tiering.policies import get_policy_class\n"
        "from tiering.placement import gate_class\n"
        "get_tier_class('memory'); get_policy_class('arc'); gate_class('auto')\n"
        "print('importlib.metadata' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False"
