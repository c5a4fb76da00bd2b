"""How the Redis tier's calls fail: redis-py's and the RESP client's errors translated into the
tier's, at the edge, and the readings of replies that are an object's fault rather than the
server's (the runtime's loop thread, like the tier; pure, any thread).

Anyone who can write to the server can put another type under a block's key (a list, say):
reads of its value answer WRONGTYPE, which is that object's fault, not the tier's (a `magic`
corrupt miss, refused and deleted like any foreign object). A SET the server refuses because it
is full (an OOM reply: `maxmemory` with `noeviction`) is `TierFull`. Connection errors become
`TierUnavailable`, a TLS failure behind one `TlsError`. No message carries the tier's secrets
(`tiering.secrets`).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

from redis import exceptions as redis_errors

from tiering.errors import (
    CorruptObject,
    TierError,
    TierFull,
    TierTimeout,
    TierUnavailable,
    TlsError,
)
from tiering.secrets import redact_text
from tiers.redis.resp import ReplyError, RespError
from tiers.tls import tls_cause

__all__ = ["RedisErrors", "empty", "replies", "within", "wrong_type"]


class RedisErrors:
    """The error translation of one Redis tier (its name, URL as shown, secrets and whether it
    talks to a Cluster): any thread, it holds no state that changes."""

    def __init__(self, tier: str, url: str, secrets: Sequence[str | None], cluster: bool) -> None:
        self.tier = tier
        self.url = url
        """The server's URL as messages show it (its password masked)."""
        self._secrets = list(secrets)
        self._cluster = cluster

    def scrub(self, message: str) -> str:
        """`message` without this tier's secrets, should a library or the server quote one."""
        return redact_text(message, self._secrets)

    @contextlib.contextmanager
    def around(self, what: str) -> Iterator[None]:
        """Translate what a call of `what` (a command's name, for messages) raises."""
        try:
            yield
        except redis_errors.TimeoutError as e:
            raise TierTimeout(f"tier {self.tier!r}: {what} timed out ({self.url})") from e
        except (redis_errors.ConnectionError, OSError, redis_errors.RedisClusterException) as e:
            tls = _ssl_error(e)
            if tls is not None:
                message = self.scrub(f"tier {self.tier!r}: {what}: TLS: {tls_cause(tls)}")
                raise TlsError(f"{message} ({self.url})") from e
            # RedisClusterException is not a RedisError: redis-py raises it when no node of
            # the Cluster answers (its start, or every node's connection refused).
            message = self.scrub(f"tier {self.tier!r}: {what} failed: {e} ({self.url})")
            raise TierUnavailable(message) from e
        except ReplyError as e:
            raise self.reply(e, what) from e
        except redis_errors.ResponseError as e:
            raise self.reply(e, what, of_a_read=False) from e
        except (redis_errors.RedisError, RespError) as e:
            raise TierError(self.scrub(f"tier {self.tier!r}: {what} failed: {e}")) from e

    @contextlib.contextmanager
    def one_value(self, what: str) -> Iterator[None]:
        """`around` a read of one key's value, where a key of another type is that object's
        fault (`not_a_string`). Batches decide reply by reply instead: raised out of a
        pipeline, a `CorruptObject` would be taken for every block's and refuse them all."""
        with self.around(what):
            try:
                yield
            except (redis_errors.ResponseError, ReplyError) as e:
                if wrong_type(e):
                    raise not_a_string(e) from e
                raise

    def reply(self, error: BaseException, what: str, of_a_read: bool = True) -> TierError:
        """What the server's error reply to one command means: a `magic` corrupt miss of that
        key when it holds another type (`wrong_type`; `of_a_read` False where the reply cannot
        be a read's), `TierFull` when the server is out of memory (`OOM`), else a
        `TierError` (one that says so when the server is a Cluster node and the tier is not
        set to `cluster`)."""
        if of_a_read and wrong_type(error):
            return not_a_string(error)
        if isinstance(error, redis_errors.OutOfMemoryError) or str(error).startswith("OOM"):
            return TierFull(
                self.scrub(f"tier {self.tier!r}: {what} refused, the server is full: {error}")
            )
        message = self.scrub(f"tier {self.tier!r}: {what} failed: {error}")
        redirected = isinstance(error, redis_errors.MovedError | redis_errors.AskError)
        if (redirected or str(error).startswith(("MOVED ", "ASK "))) and not self._cluster:
            return TierError(f"{message} (the server is a Redis Cluster node: set cluster: true)")
        return TierError(message)


def _ssl_error(error: BaseException) -> ssl.SSLError | None:
    """The TLS failure behind a connection error (redis-py wraps it), if it is one."""
    seen: BaseException | None = error
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def wrong_type(error: BaseException) -> bool:
    """Whether an error reply says that the key holds another type than a string: WRONGTYPE,
    which only a command on one key's value (GET, GETRANGE, STRLEN) answers. Other error
    replies (LOADING, NOPERM, ...) are the server's state, not the object's: tier errors."""
    is_reply = isinstance(error, redis_errors.ResponseError | ReplyError)
    return is_reply and str(error).startswith("WRONGTYPE")


def not_a_string(error: BaseException) -> CorruptObject:
    return CorruptObject("magic", f"not a string value: {error}")


def replies(results: list[Any]) -> list[Any]:
    """The replies of a redis-py pipeline run with `raise_on_error=False`, each command's error
    reply in its place; any other failure raised, as without that flag (a Cluster pipeline puts
    a node's connection error in the list too)."""
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, redis_errors.ResponseError):
            raise result
    return results


def empty(answers: Sequence[Any]) -> bytes | None:
    """After an empty GETRANGE, EXISTS and STRLEN tell a missing key (None) from an empty value
    (b"", a corrupt object: refused and deleted); a value that appeared in between (or another
    type: STRLEN's error reply) is a miss, not an object to delete."""
    exists, size = answers
    return b"" if exists and size == 0 else None


def within(head: bytes, limit: int) -> bytes:
    """A value read by `GETRANGE name 0 limit` (at most `limit + 1` bytes: a GET of a crafted
    512 MiB value would make redis-py read and allocate all of it), refused when it is longer
    than `limit` bytes."""
    if len(head) > limit:
        raise CorruptObject(
            "length", f"object of more than {limit} bytes, at most {limit} expected"
        )
    return head
