"""What the configuration file holds: one frozen dataclass per section, each key declared once.

Every key is an `option` (its default, its help line, how its YAML value is read): the loader
(`tiering.config.loader`), the JSON Schema and the documentation table
(`tiering.config.generate`) are all produced from these declarations, so they cannot disagree.
A section inside a section is a `section` field. A tier's own options are not here: each tier
class declares them as its `Options` record (`tiering.tier.options.TierOptions`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from tiering.errors import ConfigError
from tiering.tier.envelope import MIN_SECRET_BYTES
from tiering.tier.options import TierOptions, option
from tiering.units import format_size

__all__ = [
    "SCHEMA_VERSION",
    "SECTION",
    "WRITE_MODES",
    "AuthConfig",
    "BreakerConfig",
    "Config",
    "FaultsConfig",
    "MetricsConfig",
    "PrimaryConfig",
    "PromotionConfig",
    "ShutdownConfig",
    "TraceConfig",
    "TierConfig",
    "section",
    "sections_of",
]

SCHEMA_VERSION: Final = 1
WRITE_MODES: Final = ("through", "back", "selective")
NAME_PATTERN: Final = r"[a-z][a-z0-9_-]{0,31}"
"""What a tier's name looks like."""
ENV_PATTERN: Final = r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}"
"""`${NAME}`: the environment variable NAME."""
NAME: Final = re.compile(rf"{NAME_PATTERN}\Z")
ENGINE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
"""What an engine identity looks like (`primary.engine_id`): safe in every store's names."""
SECTION: Final = "kvtier.section"
"""The key of a dataclass field's metadata that makes it a section: the section's class."""


def section(cls: type[Any], *, help: str) -> Any:
    """A field holding a section of its own (a dataclass of options), by default its defaults."""
    return field(default_factory=cls, metadata={SECTION: cls, "help": help})


def sections_of(cls: type[Any]) -> dict[str, tuple[type[Any], str]]:
    """The sections inside section `cls`: name -> (its class, its help line)."""
    return {
        f.name: (f.metadata[SECTION], f.metadata["help"])
        for f in dataclasses.fields(cls)
        if SECTION in f.metadata
    }


@dataclass(frozen=True, slots=True)
class PrimaryConfig:
    """Any thread (a frozen value): the `primary` section, the CPU primary tier."""

    capacity: int | None = option(
        None,
        kind="size",
        help="Bytes over all workers (null: vLLM's `cpu_bytes_to_use`).",
    )
    eviction: str = option(
        "lru",
        low=1,
        what="a policy name",
        help="A registered eviction policy: `lru`, `arc`, or a custom one.",
    )
    directory: str = option(
        "/dev/shm",
        low=1,
        what="a directory path",
        help="Where the shared-memory file of the primary region is created (a tmpfs).",
    )
    prefault: bool = option(
        True,
        help="Map the primary region's pages from the start (a first write to a fresh shared "
        "page costs about four times the copy): the first `prefault_sync` bytes before the "
        "engine serves, the rest in the background while the engine is idle; the whole "
        "capacity is committed early instead of as slots are first used.",
    )
    prefault_sync: int = option(
        1 << 30,
        kind="size",
        zero=True,
        help="Bytes of the primary (the slots handed out first) that `prefault` maps before "
        "the engine serves, on its start's thread (~0.4 s per GiB here, in each process that "
        "maps the region); the rest is mapped by a background thread that waits while the "
        "engine computes, so that no first request competes with it (0: all of it so).",
    )
    warm_start: int = option(
        0,
        kind="size",
        zero=True,
        help="Bytes of blocks to read into the primary at start, in the background, from the "
        "tiers a previous engine wrote: in the order of its last manifest of use (any tier), "
        "else the indexed tiers' newest blocks first, into free slots only, beside the "
        "engine's own promotions, so that a restarted engine's returning prompts hit the "
        "primary (0: none; at most the primary's capacity).",
    )

    warm_manifest_interval: float = option(
        60.0,
        kind="duration",
        zero=True,
        help="With a warm start: how often the primary's order of use (its manifest, block "
        "keys hottest first) is written to the persistent tiers, off the scheduler's thread, "
        "and at shutdown; a restart, even after a crash, follows the last one (0: at shutdown "
        "only).",
    )
    manifest_requests: float = option(
        2.0,
        kind="duration",
        zero=True,
        help="With a warm start: how often the engine looks in the tiers it writes manifests "
        "to for an operator's request to write one now (`kvtier manifest --write-now`); each "
        "look costs a failed `open` on files, a GETRANGE on Redis, a GET answered 404 on S3 "
        "(43,200 a day per engine at 2 s: raise it where S3 requests are billed; 0: never "
        "look, such requests go unanswered).",
    )
    engine_id: str | None = option(
        None,
        what="an engine identity",
        help="This engine's identity on its stores: whose manifest a restart follows (null: "
        "a digest of the host's name and the model's namespace; set one per engine where "
        "several engines of one model share a host, e.g. `${POD_NAME}`).",
    )

    def __post_init__(self) -> None:
        if self.engine_id is not None and not ENGINE_ID.match(self.engine_id):
            raise ConfigError(
                f"primary.engine_id: {self.engine_id!r} is not {ENGINE_ID.pattern[:-2]}"
            )
        if self.capacity is not None:
            self.check_warm_start(self.capacity, "primary.capacity")

    def check_warm_start(self, capacity: int, named: str) -> None:
        """ConfigError when `warm_start` asks for more than the primary's `capacity` (which
        the setting `named` gives; vLLM's `cpu_bytes_to_use` where `capacity` is null): a warm
        start fills free slots only, so it would stop short of what it was given without a
        word."""
        if self.warm_start > capacity:
            raise ConfigError(
                f"primary.warm_start: {format_size(self.warm_start)} is more than {named} "
                f"({format_size(capacity)}); a warm start fills at most the primary"
            )


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Any thread (a frozen value): one secondary tier of `tiers`, how the manager uses it and
    its backend's own options."""

    name: str = option(low=1, help="The tier's name: 1-32 lowercase letters, digits, '-', '_'.")
    type: str = option(
        low=1, what="a tier type", help="The tier class: `file`, `memory`, `redis`, `s3`, ..."
    )
    write: str = option(
        "back",
        choices=WRITE_MODES,
        help="`through`: demoted when stored in the primary; `back`: when evicted from it; "
        "`selective`: on eviction, once the block was hit `admit_after_hits` times.",
    )
    admit_after_hits: int = option(
        2, low=1, help="Hits a block needs before a `selective` tier takes it."
    )
    min_age: float = option(
        0.0,
        kind="duration",
        zero=True,
        help="How long a block must have spent in the primary before it is demoted (spares "
        "SSD wear and network on blocks that die young).",
    )
    admission: str | None = option(
        None,
        choices="tiering.placement.registry:ADMISSION_NAMES",  # any the registry knows
        help="An admission policy by name, instead of the ones `write` and `min_age` imply.",
    )
    capacity: int | None = option(
        None, kind="size", help="Bytes the tier may hold (null: unbounded, or the backend's own)."
    )
    options: Mapping[str, Any] = field(default_factory=dict)
    """The backend's own options as given (`path`, `url`, `bucket`, ...), each already read by
    its tier's `Options` record (sizes in bytes, durations in seconds): what a config shows."""
    record: TierOptions | None = field(default=None, repr=False, compare=False)
    """The record the loader checked, of the class the options select, with `capacity`: what
    the tier is built with (`tiering.config.tier_from_config`). None for an entry built in code:
    then read from `options` there."""


@dataclass(frozen=True, slots=True)
class PromotionConfig:
    """Any thread (a frozen value): the `promotion` section."""

    deadline: float = option(
        0.2,
        kind="duration",
        help="How long a promotion may take before it is abandoned (a miss); a batch gets at "
        "least the time recomputing its blocks would take at `prefill_rate`.",
    )
    gate: str = option(
        "auto",
        choices="tiering.placement.registry:GATE_NAMES",  # any gate the registry knows
        help="`auto`: promote only when loading is estimated faster than recomputing; "
        "`always`; `never`.",
    )
    prefill_rate: float = option(
        20_000.0,
        high=1e12,
        what="tokens per second (> 0)",
        help="Tokens per second the engine prefills: the recompute estimate of the `auto` gate "
        "and of a promotion's deadline.",
    )
    switch_interval: float = option(
        0.0005,
        kind="duration",
        zero=True,
        help="Python's switch interval while promotions, existence checks or loads that the "
        "engine waits on are in flight: kvtier's threads get the GIL back sooner from the "
        "engine's loop (0: leave the interpreter's).",
    )


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Any thread (a frozen value): the `faults.breaker` section."""

    failures: int = option(5, low=1, help="Consecutive failures that open a tier's breaker.")
    cooldown: float = option(
        10.0, kind="duration", help="How long an open breaker waits before it lets one probe in."
    )
    latency: float | None = option(
        None,
        kind="duration",
        help="A call slower than this counts as a failure (null: only errors count).",
    )


@dataclass(frozen=True, slots=True)
class FaultsConfig:
    """Any thread (a frozen value): the `faults` section."""

    timeout: float = option(0.5, kind="duration", help="Deadline of every tier call.")
    breaker: BreakerConfig = section(BreakerConfig, help="Each tier's circuit breaker.")


@dataclass(frozen=True, slots=True)
class ShutdownConfig:
    """Any thread (a frozen value): the `shutdown` section."""

    flush: float = option(
        10.0,
        kind="duration",
        zero=True,
        help="How long the engine's shutdown may spend writing what the tiers are still to get: "
        "the write-through tiers' queue, then (with `resident`) the primary's blocks (0: write "
        "nothing more; the jobs in flight still end).",
    )
    resident: bool = option(
        True,
        help="At shutdown, send the blocks still in the primary, newest first, to the "
        "write-back tiers whose medium outlives the engine (disk, remote), within `flush`: "
        "without it the next engine finds only what the primary evicted.",
    )


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Any thread (a frozen value): the `trace` section."""

    record: str | None = option(
        None,
        what="a file path",
        help="Append the manager's lookup stream to this file, one JSON line per request in "
        "the format `kvtier replay` reads (block keys re-hashed with a random salt drawn per "
        "file: no prompt content and no real key is written), with where each block was found "
        "(null: record nothing).",
    )
    max_bytes: int = option(
        64 << 20,
        kind="size",
        low=4096,
        help="The size at which the file is rotated (`PATH` becomes `PATH.1`, and so on).",
    )
    keep: int = option(
        3, low=0, high=1000, help="Rotated files kept beside the current one (0: none)."
    )


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Any thread (a frozen value): the `metrics` section."""

    prometheus_port: int | None = option(
        None,
        high=65535,
        what="a TCP port (0: any free one)",
        help="Serve kvtier's metrics at `http://<address>:<port>/metrics` (0 picks a free "
        "port; null: no endpoint).",
    )
    address: str = option(
        "127.0.0.1",
        low=1,
        what="an address to listen on",
        help="Where the endpoint listens; `0.0.0.0` for a scraper on another host.",
    )
    usage_interval: float = option(
        30.0,
        kind="duration",
        zero=True,
        help="How often the engine lists each tier's whole store (every namespace, every "
        "engine's) for the usage metrics, in the background; also each listing's deadline. A "
        "listing reads every object's name (files: a stat each; Redis: a command per key), so "
        "with many engines on one large store give most of them 0 (never).",
    )


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Any thread (a frozen value): the `auth` section."""

    secret: bytes | None = option(
        None,
        kind="text",
        repr=False,
        help="`${NAME}` of the environment variable holding the deployment's secret (at least "
        f"{MIN_SECRET_BYTES} bytes; null: none): every stored object is sealed with AES-256-GCM "
        "under keys derived from it, and stored under names it picks. Every engine sharing a "
        "tier needs the same one (or it in `previous`, during a rotation).",
    )
    """The UTF-8 bytes of the environment variable the file names."""
    encrypt: bool = option(
        False,
        help="Encrypt every stored payload too, not only authenticate it (needs `secret`). "
        "Object names, sizes and times stay visible to whoever can list the store.",
    )
    previous: tuple[bytes, ...] = option(
        (),
        kind="any",
        repr=False,
        help="`${NAME}`s of the secrets a rotation replaces: blocks stored under them (in their "
        "names) are still read, new ones are written under `secret`; `kvtier rekey` rewrites "
        "them. Drop one from here once every engine has rolled and rekey has run.",
    )
    """The UTF-8 bytes of each, in the order given."""


@dataclass(frozen=True, slots=True)
class Config:
    """Any thread (a frozen value): a whole configuration file."""

    version: int = option(
        SCHEMA_VERSION, help=f"The format of the file: {SCHEMA_VERSION} (the only one so far)."
    )
    primary: PrimaryConfig = section(PrimaryConfig, help="The CPU primary tier.")
    tiers: tuple[TierConfig, ...] = field(default=())
    """The secondary tiers, in lookup order (`TierConfig`, plus each type's own options)."""
    promotion: PromotionConfig = section(PromotionConfig, help="Secondary -> primary.")
    faults: FaultsConfig = section(FaultsConfig, help="Deadlines and circuit breakers.")
    shutdown: ShutdownConfig = section(ShutdownConfig, help="What the engine's end writes.")
    trace: TraceConfig = section(TraceConfig, help="Recording the lookup stream as a trace.")
    metrics: MetricsConfig = section(
        MetricsConfig, help="The Prometheus endpoint and the tiers' usage metrics."
    )
    auth: AuthConfig = section(AuthConfig, help="Authenticated stored objects.")
