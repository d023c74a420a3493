"""Build hook for the optional native modules; all metadata lives in pyproject.toml.

``prefixstore.protocol._chain`` speeds up the block hash chain;
``prefixstore.protocol._checksums`` checks a batch of payloads with the GIL
released. Both are optional: where no C compiler is available the install
still succeeds and protocol/hashing.py and protocol/checksums.py use their
pure-Python loops (same answers, slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"prefixstore.protocol.{name}", sources=[f"protocol/{name}.c"],
                             include_dirs=["protocol"], extra_compile_args=["-O3"], optional=True)
                   for name in ("_chain", "_checksums")])
