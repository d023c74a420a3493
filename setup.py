"""Build hook for the one optional native module; all metadata lives in pyproject.toml.

``prefixstore.protocol._chain`` speeds up the block hash chain. It is
optional: where no C compiler is available the install still succeeds and
protocol/hashing.py uses its pure-Python loop (same bytes, slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefixstore.protocol._chain", sources=["protocol/_chain.c"],
                             include_dirs=["protocol"], extra_compile_args=["-O3"], optional=True)])
