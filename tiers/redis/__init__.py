"""The Redis tier (`RedisTier`): blocks as Redis strings, on one server or a Redis Cluster.

`tier` holds the tier, `options` its settings, `errors` the translation of the server's errors,
`pipelines` its batches, `bounds` the check of the server's memory bounds, `usage` the store-wide
usage and the last-write marker; `resp`, `resp_commands` and `resp_pool` are kvtier's RESP client
(with the compiled reader of `_respread.c`) that carries blocks on a plain-TCP server.
"""

from tiers.redis.tier import RedisOptions, RedisTier

__all__ = ["RedisOptions", "RedisTier"]
