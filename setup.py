"""Build hook for the optional native modules; all metadata lives in pyproject.toml.

``prefixstore.protocol._chain`` speeds up the block hash chain;
``prefixstore.protocol._checksums`` checks a batch of payloads with the GIL
released. Both are optional: where no C compiler is available the install
still succeeds and protocol/hashing.py and protocol/checksums.py use their
pure-Python loops (same answers, slower)."""

import platform

from setuptools import Extension, setup

# xxHash's runtime dispatch to AVX2 / AVX-512 (x86-64 only; elsewhere the header's portable code).
DISPATCH = ["protocol/_vendor/xxh_x86dispatch.c"] if platform.machine().lower() in ("x86_64", "amd64") else []

HEADERS = ["protocol/_vendor/xxhash.h", "protocol/_vendor/xxh_x86dispatch.h"]  # depends: shipped in the sdist

setup(ext_modules=[
    Extension("prefixstore.protocol._chain", sources=["protocol/_chain.c"], include_dirs=["protocol"],
              depends=HEADERS, extra_compile_args=["-O3"], optional=True),
    Extension("prefixstore.protocol._checksums", sources=["protocol/_checksums.c", *DISPATCH],
              include_dirs=["protocol"], depends=HEADERS + ["protocol/_vendor/xxh_x86dispatch.c"],
              extra_compile_args=["-O3"], optional=True),
])
