"""`Registry`: pluggable classes by name (tier types, eviction policies, promotion gates,
admission policies), each a class or a lazy `"package.module:Class"` path.

A registry knows its built-in names, the names registered at run time (`register`), and those
third parties declare in its entry-point group (`mytier = "mypackage.tiers:MyTier"` under
`[project.entry-points."kvtier.tiers"]`). `importlib.metadata` is imported only when a name is
neither built in nor registered, or when every name is listed, so importing kvtier and
resolving a built-in name never scan the installed distributions. Errors say what to do:
`unknown tier type 'rediss' (did you mean 'redis'?); known: file, memory, redis, s3`,
`tier type 'redis' needs the redis package: pip install kvtier[redis]`.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

from tiering.errors import ConfigError, MissingDependencyError, UnknownNameError

__all__ = ["Registry"]

T = TypeVar("T")

_NAME = re.compile(r"[a-z][a-z0-9_-]*\Z")


class Registry(Generic[T]):
    """Names of subclasses of `base`. Any thread: built at import, changed by `register` at
    start-up, read when a manager, a tier or a command is built (never on the step path).

    Iterating a registry yields its names afresh each time, so it serves as the `choices` of a
    configuration option (`"tiering.placement.registry:GATE_NAMES"`) and a class registered
    before the YAML is read is accepted by name."""

    def __init__(
        self,
        what: str,
        base: type,
        group: str,
        builtin: Mapping[str, str | type[T]],
        *,
        extras: Mapping[str, str] | None = None,
        sort: bool = True,
        paths: bool = False,
    ) -> None:
        """`what`: the kind, as messages name it (`tier type`). `base`: what every class
        must subclass (`T`, given as a plain `type`: mypy takes no abstract class for a
        `type[T]` argument). `group`: the entry-point
        group. `builtin`: what kvtier brings, by name. `extras`: name -> the pip extra that
        brings a built-in's dependencies. `sort`: names listed sorted (otherwise built-in
        and registered in registration order, then the entry points' sorted). `paths`: a
        `"package.module:Class"` path is accepted wherever a name is, as vLLM's offloading
        factories accept a module path."""
        self.what = what
        self.base = base
        self.group = group
        self._builtin = tuple(builtin)
        self._table: dict[str, str | type[T]] = dict(builtin)
        self._extras = dict(extras or {})
        self._sort = sort
        self._paths = paths

    def register(self, name: str, target: str | type[T], *, replace: bool = False) -> None:
        """Register a class, or a lazy `"package.module:Class"` path, under `name`."""
        if not _NAME.match(name):
            raise ConfigError(
                f"{self.what} name {name!r} must be lowercase letters, digits, '-' or '_', "
                "starting with a letter"
            )
        if isinstance(target, str):
            if target.count(":") != 1:
                raise ConfigError(
                    f"{self.what} {name!r}: expected 'package.module:Class', got {target!r}"
                )
        elif not (isinstance(target, type) and issubclass(target, self.base)):
            raise ConfigError(f"{self.what} {name!r}: {self._not_base(target)}")
        if not replace and (name in self._table or name in self._entry_points()):
            raise ConfigError(f"{self.what} {name!r} is already registered (pass replace=True)")
        self._table[name] = target

    def names(self) -> list[str]:
        """Every known name: built in, registered and from entry points."""
        found = self._entry_points()
        if self._sort:
            return sorted({*self._table, *found})
        return [*self._table, *sorted(set(found) - set(self._table))]

    def builtin(self) -> list[str]:
        """The names kvtier itself brings (those the JSON Schema and the docs describe)."""
        return sorted(self._builtin) if self._sort else list(self._builtin)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> type[T]:
        """The class of `name`, imported on first use; errors say what is unknown (with the
        closest known name) or what to install."""
        target: str | type[T] | None = self._table.get(name)
        if target is None and self._paths and ":" in name:
            target = name
        if target is None:
            target = self._entry_points().get(name)
        if target is None:
            known = self.names()
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(f"unknown {self.what} {name!r}{hint}; known: {', '.join(known)}")
        if not isinstance(target, str):
            return target
        return self._import(name, target)  # each time: `sys.modules` is the cache

    def _import(self, name: str, target: str) -> type[T]:
        module_name, _, class_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            extra = self._extras.get(name)
            if extra is None:
                raise ConfigError(f"{self.what} {name!r}: cannot import {target!r}: {e}") from e
            package = (e.name or extra).split(".")[0]
            raise MissingDependencyError(
                f"{self.what} {name!r} needs the {package} package: pip install kvtier[{extra}]"
            ) from e
        try:
            found: Any = getattr(module, class_name)
        except AttributeError as e:
            raise ConfigError(f"{self.what} {name!r}: cannot import {target!r}: {e}") from e
        if not (isinstance(found, type) and issubclass(found, self.base)):
            raise ConfigError(f"{self.what} {name!r}: {self._not_base(target)}")
        return cast("type[T]", found)

    def _not_base(self, target: object) -> str:
        base = self.base.__name__
        article = "an" if base[0] in "AEIOU" else "a"
        return f"{target!r} is not {article} {base} subclass"

    def _entry_points(self) -> dict[str, str]:
        import importlib.metadata  # only here: scanning the distributions costs an import

        return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=self.group)}
