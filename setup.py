"""Build of the one compiled helper (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tiers.copy._hostcopy", ["tiers/copy/_hostcopy.c"], extra_compile_args=["-O2"]),
    ]
)
