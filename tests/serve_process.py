"""A real ``python -m prefixstore serve`` in a subprocess, for tests that need a process boundary.

Readiness is never a sleep: the server logs the address it actually bound
(``--port 0`` picks a free port), then ``/healthz`` is polled until it answers,
both under a deadline. Every process started through :func:`serving` is
killed when it exits, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

READY_RE = re.compile(r"prefixstore serving on (https?://\S+) \(ram=(\S+), lmdb=(\S+)\)")
START_DEADLINE_S = 20.0


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any PREFIXSTORE_* knob but PREFIXSTORE_NIXL=off, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXSTORE_")}
    env["COLUMNS"] = "1000"  # argparse: no help wrapping, so texts can be matched whole
    # HTTP only unless a test asks (--nixl on): clients default to NIXL where a store serves it,
    # and most tests test the HTTP path (tests/nixl/ tests NIXL); it also keeps starts fast.
    env["PREFIXSTORE_NIXL"] = "off"
    env.update(extra)
    return env


def http_get(url: str, timeout_s: float = 5.0, ca_file: str | None = None,
             client_cert: tuple[str, str] | None = None) -> tuple[int, bytes]:
    """GET; an https URL is verified against ``ca_file`` (or the system's CAs); ``client_cert``
    (certificate, key) is presented to a store that asks for one (mutual TLS)."""
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https://") else None
    if context is not None and client_cert is not None:
        context.load_cert_chain(*client_cert)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def run_cli(args: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m prefixstore ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "prefixstore", *args], env=dict(env or clean_env()),
                          capture_output=True, text=True, timeout=timeout_s)


class ServeProcess:
    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 ca_file: str | None = None, client_cert: tuple[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        """``preexec``: run in the child before it execs (e.g. lower a resource limit)."""
        self.args = list(args)
        self.ca_file = ca_file  # verifies the health poll of a store serving https
        self.client_cert = client_cert  # and presents this to one under mutual TLS
        self.lines: list[str] = []
        self.url: str | None = None
        self.ram: str | None = None
        self.lmdb: str | None = None
        self._seen = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixstore", "serve", *args], env=dict(env or clean_env()), cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            preexec_fn=preexec)
        # Drain output on a thread: the pipe must never fill, and the ready line
        # is waited for with a deadline, not a blocking readline.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = READY_RE.search(line)
            if m and self.url is None:
                self.url, self.ram, self.lmdb = m.groups()
                self._seen.set()
        self._seen.set()  # EOF: the process exited

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> str:
        """Wait for the ready line, then for /healthz. Returns the base URL."""
        end = time.monotonic() + deadline_s
        if not self._seen.wait(deadline_s) or self.url is None:
            self.kill()
            raise AssertionError(f"store did not report its address (rc={self.proc.poll()}):\n{self.output}")
        delay = 0.005
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"store exited with {self.proc.returncode}:\n{self.output}")
            try:
                status, _ = http_get(self.url + "/healthz", timeout_s=1.0, ca_file=self.ca_file,
                                     client_cert=self.client_cert)
                if status == 200:
                    return self.url
            except OSError:
                pass
            if time.monotonic() > end:
                self.kill()
                raise AssertionError(f"/healthz did not answer within {deadline_s}s:\n{self.output}")
            time.sleep(delay)  # a poll interval, not a readiness guess
            delay = min(delay * 2, 0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Send ``sig`` and wait for the exit; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"store did not exit within {timeout_s}s of signal {sig}:\n{self.output}") from None
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


class StartServe(Protocol):
    def __call__(self, *args: str, env: Mapping[str, str] | None = None, ready: bool = True,
                 ca_file: str | None = None, client_cert: tuple[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> ServeProcess: ...


@contextlib.contextmanager
def serving() -> Iterator[StartServe]:
    """``with serving() as serve: proc = serve("--port", "0", ...)``; every process is killed on exit.

    Test modules wrap it in a ``serve`` fixture (one line), which keeps the
    fixture's origin visible without importing fixtures by name."""
    procs: list[ServeProcess] = []

    def start(*args: str, env: Mapping[str, str] | None = None, ready: bool = True,
              ca_file: str | None = None, client_cert: tuple[str, str] | None = None,
              preexec: Callable[[], None] | None = None) -> ServeProcess:
        p = ServeProcess(args, env, ca_file=ca_file, client_cert=client_cert, preexec=preexec)
        procs.append(p)
        if ready:
            p.wait_ready()
        return p

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
