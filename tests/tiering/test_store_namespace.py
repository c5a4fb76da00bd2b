"""Names under a secret (`tiering.keys.store_namespace`): deployments with different secrets,
or none, never share a store name, and an engine's tiers live in its secret's names."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tiering.config import parse_config
from tiering.keys import NAMESPACE_BYTES, owns_namespace, store_namespace
from tiering.manager import build_tiers
from tiering.testing import NAMESPACE, OTHER_NAMESPACE, OTHER_SECRET, SECRET

ENV = {"KVTIER_SECRET": SECRET.decode()}


def test_without_a_secret_the_names_are_the_layouts() -> None:
    assert store_namespace(NAMESPACE, None) == NAMESPACE
    assert not owns_namespace(NAMESPACE, None)


def test_each_secret_has_names_of_its_own() -> None:
    ours = store_namespace(NAMESPACE, SECRET)
    theirs = store_namespace(NAMESPACE, OTHER_SECRET)
    assert len(ours) == NAMESPACE_BYTES and len({ours, theirs, NAMESPACE}) == 3
    assert owns_namespace(ours, SECRET) and not owns_namespace(ours, OTHER_SECRET)
    assert owns_namespace(theirs, OTHER_SECRET) and not owns_namespace(theirs, SECRET)
    assert not owns_namespace(NAMESPACE, SECRET)
    assert store_namespace(OTHER_NAMESPACE, SECRET) != ours  # layouts stay apart


def test_a_store_namespace_is_its_own() -> None:
    """An operator's command given a store namespace (listed from the store) keeps it."""
    ours = store_namespace(NAMESPACE, SECRET)
    assert store_namespace(ours, SECRET) == ours


def test_a_forged_label_is_not_owned() -> None:
    """A name with the layout's kept bytes and any other label is not the secret's: a
    stranger cannot make names the owner's tiers would treat as their own."""
    ours = store_namespace(NAMESPACE, SECRET)
    for i in range(NAMESPACE_BYTES // 2, NAMESPACE_BYTES):
        forged = bytearray(ours)
        forged[i] ^= 1
        assert not owns_namespace(bytes(forged), SECRET)


def test_an_engines_tiers_live_in_its_secrets_names(tmp_path: Path) -> None:
    doc = {
        "tiers": [{"name": "nvme", "type": "file", "path": str(tmp_path), "min_free": 0}],
        "auth": {"secret": "${KVTIER_SECRET}"},
    }
    for config, expected in (
        (parse_config(doc, ENV), store_namespace(NAMESPACE, SECRET)),
        (parse_config({"tiers": doc["tiers"]}, ENV), NAMESPACE),
    ):
        ((_, tier),) = build_tiers(config, NAMESPACE)
        assert tier.namespace == expected
        assert tier.names_owned is (config.auth.secret is not None)
        asyncio.run(tier.close())
