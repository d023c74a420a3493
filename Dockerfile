# syntax=docker/dockerfile:1
#
# The prefixstore node image: `prefixstore serve` as a non-root user.
#
#   docker build -t prefixstore:0.1.0 .
#   docker build --build-arg EXTRAS=gpu -t prefixstore:0.1.0-gpu .   # + torch and nixl (GPU-direct path)
#   docker run -p 8077:8077 -v prefixstore-data:/var/lib/prefixstore prefixstore:0.1.0 --ram-bytes 4GiB
#
# Arguments after the image name replace CMD and go to `prefixstore serve`
# (the Helm chart passes `--config /etc/prefixstore/store.toml`). Every knob
# can also come from a PREFIXSTORE_* environment variable; see
# `docker run --rm prefixstore:0.1.0 --help`.
#
# Two stages: the build stage has a C compiler for the optional native hash
# chain (protocol/_chain.c); the runtime stage has no compiler and no pip
# cache, only the virtual environment the build stage made.

# The base image by digest (the tag alone moves under a rebuild: a different Python patch
# release, Debian packages, or pip). Both stages use it. To move it: look up the digest of the
# new tag (docker buildx imagetools inspect python:3.11-slim), change it here, rebuild, test.
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7
# pip itself, pinned like everything it installs (constraints.txt).
ARG PIP_VERSION=26.3

FROM ${PYTHON_IMAGE} AS build

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Only what the package is built from; .dockerignore keeps the rest (tests,
# benchmarks, docs, the chart, local builds) out of the context.
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY prefixstore ./prefixstore
COPY protocol ./protocol
COPY transport ./transport
COPY admission ./admission
COPY store ./store
COPY client ./client
COPY gpu_staging ./gpu_staging

# EXTRAS: optional extras of the package, e.g. "gpu" (torch + nixl, several
# GB). Empty by default: the store itself never needs torch or nixl, and with
# nixl absent `nixl = "auto"` serves HTTP only.
ARG EXTRAS=""
ARG PIP_VERSION
# Every distribution at the version constraints.txt pins, the build backend
# included (no build isolation, so no unpinned setuptools is fetched for it).
# The import check runs from / so that /src/prefixstore (the source tree, which
# lacks the other packages) does not shadow the installed package; it also
# proves the native hash chain was compiled.
RUN python -m venv /opt/prefixstore \
    && /opt/prefixstore/bin/pip install --no-cache-dir "pip==${PIP_VERSION}" \
    && /opt/prefixstore/bin/pip install --no-cache-dir -c constraints.txt setuptools \
    && /opt/prefixstore/bin/pip install --no-cache-dir --no-build-isolation -c constraints.txt ".${EXTRAS:+[$EXTRAS]}" \
    && cd / && /opt/prefixstore/bin/python -c "import prefixstore.store, prefixstore.client, prefixstore.protocol._chain"


FROM ${PYTHON_IMAGE}

# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can only verify a numeric
# USER, and the chart's fsGroup (10001) matches it so the PVC is writable.
RUN groupadd --system --gid 10001 prefixstore \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/prefixstore \
        --shell /usr/sbin/nologin prefixstore \
    && mkdir -p /var/lib/prefixstore \
    && chown 10001:10001 /var/lib/prefixstore

COPY --from=build /opt/prefixstore /opt/prefixstore

# UCX_MODULES=^ib: a process that made a UCX backend (NIXL) may segfault at
# exit with the InfiniBand module loaded (docs/design.md, data path).
ENV PATH=/opt/prefixstore/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UCX_MODULES=^ib

USER 10001:10001
WORKDIR /var/lib/prefixstore
EXPOSE 8077

# /healthz answers 200 while the node serves. The check follows
# PREFIXSTORE_PORT when the port is changed that way; a port set by flag or a
# store serving https sets PREFIXSTORE_HEALTHCHECK_URL (https://127.0.0.1:PORT/healthz:
# the certificate is not verified, this is a loopback liveness check; mutual
# TLS cannot be checked this way). Kubernetes ignores HEALTHCHECK and uses the
# chart's probes on the same endpoint.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, ssl, urllib.request; url = os.environ.get('PREFIXSTORE_HEALTHCHECK_URL') or 'http://127.0.0.1:%s/healthz' % os.environ.get('PREFIXSTORE_PORT', '8077'); ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE; urllib.request.urlopen(url, timeout=4, context=ctx)"]

ENTRYPOINT ["prefixstore", "serve"]
# Defaults for `docker run`: listen on every interface (inside the container),
# keep the LMDB tier under the home directory (mount a volume there).
CMD ["--host", "0.0.0.0", "--data-dir", "/var/lib/prefixstore/lmdb"]
