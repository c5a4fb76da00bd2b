"""The roles of one engine prove, at start, that they map the same primary region and read the
same kvtier config.

vLLM builds kvtier's spec in the scheduler and in every worker, each from its own reading of the
config. When that reading differs (the YAML file edited between the two starts, a
`primary.directory` that differs), each role would map a primary region of its own without a word:
the scheduler would then demote slots nobody wrote (zeros with valid checksums) to the tiers, and
later engines would load them. So each role, once it has mapped its region and before anything
reaches a tier, joins the engine's **roster**: a small file named after vLLM's engine id in a
place that no kvtier setting moves (`/dev/shm`, else the system's temporary directory). Each
entry names a role, its process (pid and start time, so a reused pid is not taken for it), the
region it maps with the region's random token (`tiers.region.PrimaryRegion.token`), and a digest
of each config value. A role that finds a live entry of another region, or of another config,
refuses to start with one line naming both; nothing has been built past the region.

Runs on the thread that builds the spec (vLLM's, in each process), once per role; the roster is
read and rewritten under an `flock`, within bounds (an entry of a dead process is dropped, an
unreadable line ignored, at most `MAX_ROSTER_BYTES` read), and each role leaves it at `leave`.

A role is judged dead by its pid only from its own pid namespace (the entry records it): a pid
names nothing in another (a container sharing /dev/shm). From another, or for an entry that does
not say, it is alive while its region is held (`tiers.region.file.held`: every process mapping
it holds a lock, which the kernel reports across namespaces) with the token it recorded. A roster
whose roles are all dead (an engine killed with -9: its engine id never comes back) is removed by
the next role to join any roster of the directory (`_sweep`, at most `SWEEP_FILES`, none younger
than `SWEEP_AGE`: a roster being created holds no entry yet).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiering.config import Config
from tiering.errors import RegionError
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion
from tiers.region.file import held, read_header

__all__ = ["MAX_ROSTER_BYTES", "Roster", "config_digests", "roster_directory"]

log = logging.getLogger(__name__)

MAX_ROSTER_BYTES = 1 << 20
"""The most of a roster read: an engine's roles are a few lines each."""
_DIGEST_DOMAIN = b"kvtier config value\x00"
SWEEP_FILES = 256
"""The most other rosters one join looks at."""
SWEEP_AGE = 10.0
"""Seconds a roster is left alone after its last change, whatever its entries say."""
_PATTERN = "kvtier-*.roles"


def roster_directory() -> Path:
    """Where rosters live: /dev/shm, which every process of one host (and container) shares,
    else the system's temporary directory; never a path from the config."""
    if DEFAULT_DIRECTORY.is_dir() and os.access(DEFAULT_DIRECTORY, os.W_OK | os.X_OK):
        return DEFAULT_DIRECTORY
    return Path(tempfile.gettempdir())


def config_digests(config: Config) -> dict[str, str]:
    """Each value of `config` by its dotted path (`primary.directory`, `tiers[0].options.path`),
    as a short digest: what roles compare, without writing a password or secret anywhere."""
    return {
        path: hashlib.sha256(_DIGEST_DOMAIN + repr(value).encode()).hexdigest()[:16]
        for path, value in _flatten(config, "")
    }


def _flatten(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _flatten(getattr(value, field.name), _join(path, field.name))
    elif isinstance(value, tuple | list):
        yield f"{path}.count", len(value)
        for i, item in enumerate(value):
            yield from _flatten(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for name in sorted(value, key=str):
            yield from _flatten(value[name], _join(path, str(name)))
    else:
        yield path, value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class Roster:
    """One engine's roster (a file named after its engine id): `join` adds this role, after
    checking every live role already there against it; `leave` takes it out. Any thread of
    the role's process (the spec's builder)."""

    def __init__(self, engine_id: str, directory: Path | None = None) -> None:
        safe = engine_id if _plain(engine_id) else hashlib.sha256(engine_id.encode()).hexdigest()
        self.path = (directory or roster_directory()) / f"kvtier-{safe}.roles"
        self.engine_id = engine_id
        self._entry: dict[str, Any] | None = None

    def join(self, role: str, region: PrimaryRegion, config: Config) -> None:
        """Enter `role`, mapping `region` under `config`. Raises `RegionError`, one line
        naming both roles and what differs, when a live role of this engine maps another
        region or was started with another config."""
        entry = {
            "role": role,
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "pidns": _pid_namespace(),
            "region": str(region.path),
            "token": region.token.hex(),
            "config": config_digests(config),
        }
        with self._locked() as fd:
            me = (role, entry["pid"])
            live = [e for e in _read(fd, self.path) if _alive(e) and (e["role"], e["pid"]) != me]
            for other in live:
                problem = _difference(other, entry)
                if problem is not None:
                    raise RegionError(
                        f"kvtier: engine {self.engine_id}: {other['role']} and {role} {problem}; "
                        "start every process of the engine with the same kvtier config"
                    )
            _write(fd, [*live, entry])
        self._entry = entry
        log.debug("kvtier: %s joined the roster %s", role, self.path)
        _sweep(self.path)

    def leave(self) -> None:
        """Take this role out (at its close); the roster goes with its last role."""
        if self._entry is None:
            return
        entry, self._entry = self._entry, None
        try:
            with self._locked() as fd:
                rest = [
                    e
                    for e in _read(fd, self.path)
                    if _alive(e) and (e["role"], e["pid"]) != (entry["role"], entry["pid"])
                ]
                _write(fd, rest)
                if not rest:
                    self.path.unlink(missing_ok=True)
        except (OSError, RegionError) as e:  # a roster left behind is dropped by the next join
            log.debug("kvtier: cannot leave the roster %s: %s", self.path, e)

    def _locked(self) -> _Lock:
        return _Lock(self.path)


class _Lock:
    """The roster file, opened without following a link, checked to be a regular file of this
    user, and locked (`flock`) for the duration of a `with`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        try:
            fd = os.open(
                self.path,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o600,
            )
        except OSError as e:
            why = "a link" if e.errno == errno.ELOOP else e.strerror
            raise RegionError(f"kvtier: engine roster {self.path}: cannot open ({why})") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise RegionError(
                f"kvtier: engine roster {self.path} is not a regular file of this user; remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        return fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # (releases the lock)
        self.fd = -1


def _read(fd: int, path: Path) -> list[dict[str, Any]]:
    data = os.pread(fd, MAX_ROSTER_BYTES, 0)
    entries = []
    for line in data.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if _well_formed(entry):
            entries.append(entry)
        else:
            log.debug("kvtier: engine roster %s: an entry of another shape ignored", path)
    return entries


def _well_formed(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("role"), str)
        and isinstance(entry.get("pid"), int)
        and isinstance(entry.get("started"), str | None)
        and isinstance(entry.get("pidns"), str | None)
        and isinstance(entry.get("region"), str)
        and isinstance(entry.get("token"), str)
        and isinstance(entry.get("config"), dict)
    )


def _write(fd: int, entries: list[dict[str, Any]]) -> None:
    data = b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in entries)
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _difference(other: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """How `other`'s entry differs from `mine` (a phrase), or None."""
    ours, theirs = mine["config"], other["config"]
    keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    named = f" ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''} differ)" if keys else ""
    if other["region"] != mine["region"] or other["token"] != mine["token"]:
        return f"map different primary regions ({other['region']} and {mine['region']}){named}"
    if keys:
        return f"were started with different kvtier configs{named}"
    return None


def _plain(name: str) -> bool:
    return 0 < len(name) <= 128 and all(c.isalnum() or c in "._-" for c in name)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22): with
    the pid, it names one process even after the pid is reused. None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # after the command, which may hold spaces
    return fields[19].decode() if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    """This process's pid namespace (`pid:[<inode>]`); None where /proc cannot say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(entry: dict[str, Any]) -> bool:
    """Whether the role of `entry` still runs: by its pid (the same process: its start time
    agrees) in our pid namespace, else by its region being held with its token."""
    namespace = entry.get("pidns")
    if namespace is None or namespace != _pid_namespace():
        return _region_held(Path(entry["region"]), entry["token"])
    pid = entry["pid"]
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = _start_time(pid)
    return started is None or entry["started"] is None or started == entry["started"]


def _region_held(path: Path, token: str) -> bool:
    """Whether a process holds the region at `path` and it is the one of `token`."""
    if held(path) is not True:
        return False
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        found = read_header(path)
    except (OSError, RegionError):
        return False
    return found is not None and found[2].hex() == token


def _sweep(mine: Path) -> None:
    """Remove the rosters beside `mine` whose roles are all dead, each under its lock (not
    waited for: a roster in use is left), if this user's regular file, untouched for
    `SWEEP_AGE`."""
    now = time.time()
    for path in itertools.islice(mine.parent.glob(_PATTERN), SWEEP_FILES):
        if path == mine:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if now - st.st_mtime < SWEEP_AGE:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            if any(_alive(e) for e in _read(fd, path)):
                continue
            if os.path.samestat(st, os.stat(path)):
                path.unlink()
                log.info("kvtier: removed the roster %s: none of its roles runs", path)
        except OSError as e:
            log.debug("kvtier: cannot sweep the roster %s: %s", path, e)
        finally:
            os.close(fd)
