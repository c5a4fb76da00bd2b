"""YAML from a file a user wrote, read within bounds.

`yaml.safe_load` constructs no arbitrary objects, but it still lets a few hundred bytes cost
minutes and gigabytes: aliases share nodes, so nine levels of nine aliases (a "billion laughs")
are a small graph that every walk over the loaded data expands to 9**9 nodes; nesting is
composed recursively, so 20,000 levels end in `RecursionError`; an integer of 5,000 digits or a
date like `2024-13-45` raises a bare `ValueError` from the constructor. `load` refuses all of
these with a `yaml.YAMLError` that carries the line and column, before anything is built:

- the text is at most `MAX_BYTES` (the caller reads no more);
- nesting is at most `MAX_DEPTH` levels, counted through aliases;
- the document expands to at most `MAX_NODES` nodes, an alias counting as often as it is used
  (a recursive alias is refused);
- a scalar that its constructor cannot turn into a value is a marked error;
- a mapping names each key once (PyYAML keeps the last of two, so a second `tiers:` would
  drop the first without a word); a merge (`<<`) may still be overridden.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "load"]

MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NODES = 100_000
_MERGE = "tag:yaml.org,2002:merge"


class _BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with the bounds of the module docstring. One document, one thread."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(
                    None,
                    None,
                    f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            node = super().compose_node(parent, index)
            assert node is not None  # an event was there to peek at
            return node
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: Any) -> MappingNode:  # typeshed: a dict; a name
        node = super().compose_mapping_node(anchor)
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE:
                continue  # a config's keys are scalars (scalars are all hashable)
            key = self.construct_object(key_node)  # `a` and "a" are one key, as in the dict
            if key in first:
                raise ConstructorError(
                    None,
                    None,
                    f"duplicate key {_short(key)} (first at line {first[key]})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark.line + 1
        return node

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is not None:
            _measure(node, 1, {}, set())
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:  # int('9' * 5000), date(2024, 13, 45)
            raise ConstructorError(
                None, None, f"cannot read {_short(node.value)}: {e}", node.start_mark
            ) from None


def _measure(node: Node, depth: int, memo: dict[int, tuple[int, int]], open_: set[int]) -> int:
    """The height of `node` (memoized per node: aliases share them); raises past a bound.
    `memo[id]` is (expanded node count, height)."""
    if depth > MAX_DEPTH:
        raise ComposerError(
            None, None, f"nested deeper than {MAX_DEPTH} levels (through aliases)", node.start_mark
        )
    known = memo.get(id(node))
    if known is not None:
        if depth + known[1] - 1 > MAX_DEPTH:
            raise ComposerError(
                None,
                None,
                f"nested deeper than {MAX_DEPTH} levels (through aliases)",
                node.start_mark,
            )
        return known[1]
    if id(node) in open_:
        raise ComposerError(None, None, "a recursive alias (refers to itself)", node.start_mark)
    if isinstance(node, SequenceNode):
        children: list[Node] = list(node.value)
    elif isinstance(node, MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    open_.add(id(node))
    height = 1 + max((_measure(c, depth + 1, memo, open_) for c in children), default=0)
    open_.discard(id(node))
    count = 1 + sum(memo[id(c)][0] for c in children)
    if count > MAX_NODES:
        raise ComposerError(
            None,
            None,
            f"expands to more than {MAX_NODES:,} values (YAML aliases used too often)",
            node.start_mark,
        )
    memo[id(node)] = (count, height)
    return height


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load(text: str) -> Any:
    """The single YAML document in `text` (None when empty); `yaml.YAMLError` past a bound."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
