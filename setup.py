"""Build of the compiled helpers (everything else is in pyproject.toml): the copy engine's
batch copy and the Redis tier's reply reader, both loaded with ctypes, and the core of the
ARC eviction policy."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tiers.copy._hostcopy", ["tiers/copy/_hostcopy.c"], extra_compile_args=["-O2"]),
        Extension("tiering.policies._arc", ["tiering/policies/_arc.c"], extra_compile_args=["-O2"]),
        Extension("tiers.redis._respread", ["tiers/redis/_respread.c"], extra_compile_args=["-O2"]),
        Extension("tiering._pool", ["tiering/_pool.c"], extra_compile_args=["-O2"]),
    ]
)
