"""What `serve` refuses beyond StoreConfig (prefixstore/preflight.py), and `config` refusing it too.

A node whose --node-url its --host cannot serve (issue 34: the README's cluster command bound
127.0.0.1 while it advertised a LAN address, and /readyz said ready) and a budget beyond the
machine's memory (`config` exited 0 on a ram_bytes `serve` refuses) both stop with status 2 and
one line naming the knob, before anything listens.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from prefixstore.preflight import check_node_url
from prefixstore.store.config import ConfigError, StoreConfig

from .serve_process import clean_env, run_cli

ROOT = Path(__file__).resolve().parent.parent

HOSTS = {"localhost": ["127.0.0.1", "::1"], "node-a": ["10.0.0.1"], "node-a-v6": ["fe80::1%eth0"],
         "127.0.0.1": ["127.0.0.1"], "10.0.0.1": ["10.0.0.1"], "10.0.0.2": ["10.0.0.2"], "fe80::1": ["fe80::1"]}


def resolver(host: str) -> list[str]:
    if host not in HOSTS:
        raise OSError(f"{host}: Name or service not known")
    return HOSTS[host]


@pytest.mark.parametrize("host, node_url", [
    ("0.0.0.0", "http://10.0.0.1:8077"),  # every interface: whatever the URL names on this machine
    ("::", "http://node-a:8077"),
    ("127.0.0.1", "http://127.0.0.1:8077"),
    ("127.0.0.1", "http://localhost:8077"),  # one of the name's addresses is bound
    ("10.0.0.1", "http://node-a:9000"),  # another port: a NAT or a proxy may map it
    ("fe80::1", "http://node-a-v6:8077"),  # a zone does not change the address
    ("127.0.0.1", "http://elsewhere.example:8077"),  # does not resolve here: the peers may know it
    ("127.0.0.1", ""),  # no node_url: the bound address is the identity
])
def test_a_node_url_the_bound_host_serves_is_accepted(host: str, node_url: str) -> None:
    check_node_url(StoreConfig(host=host, node_url=node_url), resolver)


@pytest.mark.parametrize("host, node_url, says", [
    ("127.0.0.1", "http://10.0.0.1:8077", "host=127.0.0.1 serves this machine only"),
    ("localhost", "http://node-a:8077", "node-a (10.0.0.1)"),
    ("10.0.0.2", "http://10.0.0.1:8077", "listens on 10.0.0.2 only"),
])
def test_a_node_url_the_bound_host_cannot_serve_is_refused(host: str, node_url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^node_url: ") as err:
        check_node_url(StoreConfig(host=host, node_url=node_url), resolver)
    assert says in str(err.value) and "Set host to 0.0.0.0" in str(err.value)


def readme_cluster_command() -> list[str]:
    """The flags of the README's cluster command (its first `prefixstore serve ... --peers` line)."""
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("prefixstore serve") and "--peers" in ln)
    return shlex.split(line)[2:]


def test_the_readme_cluster_command_serves_the_url_it_advertises() -> None:
    flags = readme_cluster_command()
    assert "--node-url" in flags
    out = run_cli(["config", *flags, "--data-dir", "none", "--json"])
    assert out.returncode == 0, out.stderr  # what serve checks: it would start
    # The same command without its --host (the default, 127.0.0.1) is the node peers cannot reach.
    i = flags.index("--host") if "--host" in flags else None
    bare = flags[:i] + flags[i + 2:] if i is not None else flags
    out = run_cli(["config", *bare, "--data-dir", "none"])
    assert out.returncode == 2, out.stdout
    assert re.match(r"prefixstore config: error: node_url: http://10\.0\.0\.1:8077 names 10\.0\.0\.1", out.stderr)
    assert "(set by flag --node-url)" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_node_url_it_cannot_serve_before_listening() -> None:
    out = run_cli(["serve", "--port", "0", "--data-dir", "none", "--node-url", "http://10.0.0.1:8090",
                   "--peers", "http://10.0.0.1:8090,http://10.0.0.2:8090"])
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("prefixstore serve: error: node_url: "), out.stderr
    assert "serving on" not in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_config_refuses_the_memory_serve_refuses() -> None:
    env = clean_env(PREFIXSTORE_RAM_BYTES="99TiB")
    for command in (["serve", "--port", "0", "--data-dir", "none"], ["config", "--data-dir", "none"]):
        out = run_cli(command, env=env)
        assert out.returncode == 2, (command, out.stdout)
        assert f"prefixstore {command[0]}: error: ram_bytes: 99TiB is more than" in out.stderr, out.stderr
        assert "(set by environment PREFIXSTORE_RAM_BYTES)" in out.stderr


def test_config_shows_the_data_directory_it_resolves(tmp_path: Path) -> None:
    env = clean_env(XDG_DATA_HOME=str(tmp_path))
    out = run_cli(["config", "--json"], env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["data_dir"] == {"value": str(tmp_path / "prefixstore"), "source": "default"}
    text = run_cli(["config"], env=env).stdout
    assert any(line.split() == ["data_dir", str(tmp_path / "prefixstore"), "default"] for line in text.splitlines())
    none = json.loads(run_cli(["config", "--json", "--data-dir", "none"], env=env).stdout)
    assert none["data_dir"] == {"value": "none", "source": "flag --data-dir"}
