"""The ``prefixstore`` command, run as real processes: help, config errors, precedence, stats, shutdown."""

from __future__ import annotations

import argparse

import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixstore.cli import build_parser, flag_name, format_size, load_config
from prefixstore.store.config import ConfigError, StoreConfig

from .serve_process import StartServe, clean_env, http_get, run_cli, serving


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def _squash(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- help


def test_serve_help_documents_every_field() -> None:
    out = run_cli(["serve", "--help"])
    assert out.returncode == 0, out.stderr
    text = _squash(out.stdout)
    for f in StoreConfig.knobs():
        assert flag_name(f.name) in text, f.name
        assert f"PREFIXSTORE_{f.name.upper()}" in text, f.name
        assert _squash(f.metadata["help"]) in text, f.name
    assert "--config FILE" in text
    assert "flag > environment > config file > default" in text


def test_top_level_and_stats_help() -> None:
    top = run_cli(["--help"])
    assert top.returncode == 0
    assert "serve" in top.stdout and "stats" in top.stdout
    stats = run_cli(["stats", "--help"])
    assert stats.returncode == 0
    assert "--json" in stats.stdout and "URL" in stats.stdout and "--timeout" in stats.stdout
    assert run_cli([]).returncode == 2  # a command is required


def test_every_command_explains_every_flag() -> None:
    """`--help` of every subcommand prints, and names each of its flags with some help text."""
    from prefixstore.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"serve", "stats", "demo", "simulate", "trace", "plan"} <= set(commands)
    for name, sub in commands.items():
        out = run_cli([name, "--help"])
        assert out.returncode == 0, (name, out.stderr[-500:])
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--"):
                    assert flag in out.stdout, (name, flag)
            assert action.help, (name, action.dest)


def test_bad_flag_prints_the_usage_of_its_command(tmp_path: Path) -> None:
    """`serve --bogus` is serve's mistake: serve's usage, not the top level's."""
    for command, marker in (("serve", "--ram-bytes SIZE"), ("stats", "[URL]"), ("trace", "-o OUTPUT")):
        given = {"trace": ["multi-turn", "-o", str(tmp_path / "t.jsonl")]}.get(command, [])  # its required args
        out = run_cli([command, *given, "--bogus"])
        assert out.returncode == 2, out
        assert out.stderr.startswith(f"usage: prefixstore {command} "), out.stderr
        assert marker in out.stderr
        assert f"prefixstore {command}: error: unrecognized arguments: --bogus" in out.stderr
    top = run_cli(["--bogus", "stats"])  # before the command: the top level's
    assert top.returncode == 2 and top.stderr.startswith("usage: prefixstore [-h]"), top.stderr


def test_trace_and_simulate_help_give_whole_descriptions() -> None:
    """Each workload's and policy's description in full, not its first line cut mid-sentence."""
    from prefixstore.sim.engine import POLICIES
    from prefixstore.sim.traces import WORKLOADS

    trace = _squash(run_cli(["trace", "--help"]).stdout)
    for name, fn in WORKLOADS.items():
        assert f"{name}: {_squash(fn.__doc__ or '')}" in trace, name
    simulate = _squash(run_cli(["simulate", "--help"]).stdout)
    for policy in POLICIES.values():
        assert f"{policy.name}: {_squash(policy.description)}" in simulate, policy.name
    for column in ("per token", "per request"):  # the table's units are explained
        assert column in simulate
    assert "(default: None)" not in trace + simulate


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "prefixstore"
    found = str(script) if script.exists() else shutil.which("prefixstore")
    if found is None:
        pytest.skip("the prefixstore console script is not on PATH (package not pip-installed here)")
    out = subprocess.run([found, "--version"], capture_output=True, text=True, env=clean_env(), timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("prefixstore ")


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("args, env, knob", [
    (["--ram-bytes", "lots"], {}, "ram_bytes"),
    (["--port", "http"], {}, "port"),
    (["--port", "70000"], {}, "port"),
    (["--eviction", "fifo"], {}, "eviction"),
    (["--log-level", "loud"], {}, "log_level"),
    ([], {"PREFIXSTORE_PAGE_BYTES": "0"}, "page_bytes"),
    ([], {"PREFIXSTORE_LMDB_SYNC": "maybe"}, "lmdb_sync"),
])
def test_bad_value_exits_2_naming_the_knob(args: list[str], env: dict[str, str], knob: str) -> None:
    out = run_cli(["serve", "--data-dir", "none", *args], env=clean_env(**env))
    assert out.returncode == 2, out
    assert knob in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "serving on" not in out.stderr


@pytest.mark.parametrize("args, knob", [
    (["--ram-bytes", "100000TiB"], "ram_bytes"),  # no machine has it: refused before anything is mapped
    (["--sighting-filter-bytes", "100000TiB"], "sighting_filter_bytes"),
])
def test_impossible_memory_size_exits_2_naming_the_knob(args: list[str], knob: str) -> None:
    out = run_cli(["serve", "--data-dir", "none", "--port", "0", *args])
    assert out.returncode == 2, out
    assert out.stderr.startswith(f"prefixstore serve: error: {knob}: "), out.stderr
    assert f"(set by flag {flag_name(knob)})" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


def test_arena_that_cannot_be_mapped_fails_in_one_line_naming_ram_bytes() -> None:
    """A size the machine has but this process may not map (an address-space limit, like a tight
    overcommit policy): mmap's ENOMEM becomes one line naming ram_bytes, not a traceback."""
    import resource

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    out = subprocess.run([sys.executable, "-m", "prefixstore", "serve", "--data-dir", "none", "--port", "0",
                          "--ram-bytes", "8GiB"], env=clean_env(), capture_output=True, text=True, timeout=60,
                         preexec_fn=limit_address_space)
    assert out.returncode in (1, 2), out  # 2: this machine has less than 8 GiB, refused before the mmap
    assert "ram_bytes" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_impossible_disk_size_fails_in_one_line_naming_disk_bytes(tmp_path: Path) -> None:
    """LMDB maps 1.5x disk_bytes of address space at open: beyond what any process has."""
    out = run_cli(["serve", "--data-dir", str(tmp_path / "lmdb"), "--port", "0", "--disk-bytes", "1000000TiB"])
    assert out.returncode == 1, out
    assert "disk_bytes=1000000TiB" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_memory_check_against_a_given_limit() -> None:
    from prefixstore.cli import check_memory

    config = StoreConfig(ram_bytes=3 << 30, sighting_filter_bytes=1 << 20)
    check_memory(config, None)  # unknown limit: nothing to check
    check_memory(config, 4 << 30)
    with pytest.raises(ConfigError, match=r"^ram_bytes: 3GiB is more than the 2 GiB"):
        check_memory(config, 2 << 30)
    with pytest.raises(ConfigError, match=r"^ram_bytes: 3GiB plus sighting_filter_bytes 1MiB"):
        check_memory(config, 3 << 30)


def test_bad_config_file_exits_2(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('ram_byte = "1MiB"\n')
    out = run_cli(["serve", "--config", str(unknown)])
    assert out.returncode == 2 and "ram_byte" in out.stderr and "Traceback" not in out.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("ram_bytes = \n")
    out = run_cli(["serve", "--config", str(broken)])
    assert out.returncode == 2 and str(broken) in out.stderr and "Traceback" not in out.stderr
    out = run_cli(["serve", "--config", str(tmp_path / "missing.toml")])
    assert out.returncode == 2 and "missing.toml" in out.stderr


def test_error_says_where_the_value_came_from(tmp_path: Path) -> None:
    cfg = tmp_path / "store.toml"
    cfg.write_text("max_items = -1\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg)])
    with pytest.raises(ConfigError, match=r"max_items.*config file"):
        load_config(args, {})
    args = build_parser().parse_args(["serve"])
    with pytest.raises(ConfigError, match=r"max_items.*environment PREFIXSTORE_MAX_ITEMS"):
        load_config(args, {"PREFIXSTORE_MAX_ITEMS": "many"})


# ---------------------------------------------------------------- precedence


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "store.toml"
    cfg.write_text('ram_bytes = "8MiB"\npage_bytes = "8KiB"\nmax_items = 100\nlmdb_sync = true\n')
    env = {"PREFIXSTORE_RAM_BYTES": "6MiB", "PREFIXSTORE_PAGE_BYTES": "16KiB", "PREFIXSTORE_LMDB_SYNC": "false"}
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--page-bytes", "32KiB", "--lmdb-sync"])
    c = load_config(args, env)
    assert c.page_bytes == 32 << 10  # flag > env > file
    assert c.ram_bytes == 6 << 20  # env > file
    assert c.max_items == 100  # file > default
    assert c.lmdb_sync is True  # boolean flag > env
    assert c.disk_bytes == StoreConfig().disk_bytes  # default
    # The config file may also come from PREFIXSTORE_CONFIG.
    c = load_config(build_parser().parse_args(["serve"]), {"PREFIXSTORE_CONFIG": str(cfg)})
    assert (c.ram_bytes, c.page_bytes, c.max_items) == (8 << 20, 8 << 10, 100)
    # --no-flag form of a boolean beats the file.
    c = load_config(build_parser().parse_args(["serve", "--config", str(cfg), "--no-lmdb-sync"]), {})
    assert c.lmdb_sync is False
    # Nothing given: every field at its default.
    assert load_config(build_parser().parse_args(["serve"]), {}) == StoreConfig()


def test_precedence_in_a_real_server(tmp_path: Path, serve: StartServe) -> None:
    data_dir = tmp_path / "from-file"
    cfg = tmp_path / "store.toml"
    cfg.write_text(f'ram_bytes = "8MiB"\npage_bytes = "8KiB"\ndata_dir = "{data_dir}"\nport = 1\n')
    env = clean_env(PREFIXSTORE_RAM_BYTES="6MiB", PREFIXSTORE_PAGE_BYTES="16KiB")
    p = serve("--config", str(cfg), "--page-bytes", "32KiB", "--port", "0", env=env)
    assert p.ram == format_size(6 << 20) and p.lmdb == str(data_dir)
    assert p.url is not None and not p.url.endswith(":1")
    status, body = http_get(p.url + "/v1/stats")
    assert status == 200
    stats = json.loads(body)
    assert stats["arena"]["capacity_bytes"] == 6 << 20
    assert stats["arena"]["page_bytes"] == 32 << 10
    assert stats["disk"]["path"] == str(data_dir)
    assert stats["disk"]["budget_bytes"] == StoreConfig().disk_bytes
    assert (data_dir / "data.mdb").exists()


# ---------------------------------------------------------------- serve and stats


def test_stats_of_a_running_store(tmp_path: Path, serve: StartServe) -> None:
    p = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"), "--ram-bytes", "4MiB")
    assert p.url is not None
    out = run_cli(["stats", p.url])
    assert out.returncode == 0, out.stderr
    assert p.url in out.stdout
    assert "namespaces" in out.stdout
    assert "arena.capacity_bytes" in out.stdout and "4194304 (4 MiB)" in out.stdout
    assert str(tmp_path / "lmdb") in out.stdout
    raw = run_cli(["stats", "--json", p.url + "/"])
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["arena"]["capacity_bytes"] == 4 << 20


def test_stats_shows_hit_rates_per_model(serve: StartServe) -> None:
    """Which model's state hit rate collapsed: a row per (tenant, model), alone and over a cluster."""
    from prefixstore.client import ClientConfig, SyncPrefixClient

    from .factories import kv_payload, make_namespace, state_payload

    p = serve("--port", "0", "--data-dir", "none", "--state-admission", "always")
    assert p.url is not None
    tokens = list(range(1, 13))
    for ns, snapshot in ((make_namespace(model="hybrid-7b"), True), (make_namespace(model="plain-8b", with_state=False),
                                                                     False)):
        with SyncPrefixClient(ns, ClientConfig(url=p.url)) as client:
            client.save(client.prompt(tokens), 12, lambda a, b, ns=ns: kv_payload(ns, tokens, a, b),
                        {8: state_payload(ns, tokens, 8)} if snapshot else None)
            client.release(client.lookup(tokens + [90, 91, 92, 93]).lease_id)  # kv 12/16, state 8/16
    for args in ([p.url], ["--cluster", p.url]):
        out = run_cli(["stats", *args])
        assert out.returncode == 0, out.stderr
        table = out.stdout.split("hit rates by model")[1].splitlines()[1:]
        assert table[0].split() == ["tenant", "model", "tokens", "kv", "hit", "state", "hit"], out.stdout
        assert table[1].split() == ["default", "hybrid-7b", "16", "75.0%", "50.0%"], out.stdout
        assert table[2].split() == ["default", "plain-8b", "16", "75.0%", "-"], out.stdout
    models = json.loads(run_cli(["stats", "--cluster", "--json", p.url]).stdout)["models"]
    assert [(m["model"], m["kv"]["rate"]) for m in models] == [("hybrid-7b", 0.75), ("plain-8b", 0.75)]


def test_stats_of_an_unreachable_store_fails_in_one_line() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_cli(["stats", f"http://127.0.0.1:{port}", "--timeout", "2"])
    assert out.returncode == 1
    assert "cannot reach" in out.stderr and f"127.0.0.1:{port}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_stats_of_a_whole_cluster_at_a_dead_url_shows_the_member_table() -> None:
    """`stats --cluster` at the dead default URL printed one line: the table says which member is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in ([f"http://127.0.0.1:{port}"], []):  # given, and the default URL (nothing listens there in CI)
        if not args:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", 8077)) == 0:
                    continue  # a store runs on this machine's default port: not the case tested
        out = run_cli(["stats", "--cluster", *args, "--timeout", "2"])
        url = args[0] if args else "http://127.0.0.1:8077"
        assert out.returncode == 1, out
        lines = out.stdout.splitlines()
        assert lines[0].split()[:3] == ["member", "version", "uptime"], out.stdout
        assert lines[1].startswith(url) and "error: cannot reach the store" in lines[1], out.stdout
        assert lines[2].startswith("total (0 of 1 answered)"), out.stdout
        assert "1 of 1 members did not answer" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_shuts_down_gracefully(tmp_path: Path, serve: StartServe, sig: int) -> None:
    p = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"))
    assert p.stop(sig) == 0
    assert "prefixstore stopped" in p.output
    assert "Traceback" not in p.output


def test_two_servers_on_port_0_get_different_ports(serve: StartServe) -> None:
    a = serve("--port", "0", "--data-dir", "none")
    b = serve("--port", "0", "--data-dir", "none")
    assert a.url != b.url
    assert a.lmdb == "none"


def test_port_in_use_fails_cleanly(serve: StartServe) -> None:
    a = serve("--port", "0", "--data-dir", "none")
    assert a.url is not None
    port = a.url.rsplit(":", 1)[1]
    out = run_cli(["serve", "--port", port, "--data-dir", "none"])
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def test_stats_watch_redraws_the_table_with_the_last_interval(serve: StartServe) -> None:
    """`stats --watch`: a frame every interval; from the second on, lookups per second and the hit
    rates of the interval (a stored prompt looked up again and again: 100%)."""
    import subprocess
    import threading

    from prefixstore.client import ClientConfig, SyncPrefixClient

    from .factories import kv_payload, make_namespace

    p = serve("--port", "0", "--data-dir", "none")
    assert p.url is not None
    ns = make_namespace(model="watched", with_state=False)
    tokens = list(range(1, 33))
    watch = subprocess.Popen([sys.executable, "-m", "prefixstore", "stats", p.url, "--watch", "0.3", "--count", "4"],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with SyncPrefixClient(ns, ClientConfig(url=p.url)) as client:
        client.save(client.prompt(tokens), 32, lambda a, b: kv_payload(ns, tokens, a, b))

        def look() -> None:  # lookups while the watch runs
            while watch.poll() is None:
                client.release(client.lookup(tokens).lease_id)

        looker = threading.Thread(target=look)
        looker.start()
        stdout, stderr = watch.communicate(timeout=60)
        looker.join(30)
    assert watch.returncode == 0, stderr
    frames = stdout.split(f"prefixstore stats {p.url}: every 0.3s, ")[1:]
    assert len(frames) == 4, stdout
    rows = [next(ln for ln in f.splitlines() if ln.startswith(p.url)).split() for f in frames]
    assert all(f.splitlines()[1].split()[:2] == ["member", "lookups/s"] for f in frames)
    assert rows[0][1:3] == ["-", "-"]  # no interval yet
    later = [r for r in rows[1:] if float(r[1]) > 0]
    assert later and all(r[2] == "100.0%" for r in later), rows  # the interval's KV hit rate
    assert "watched" in frames[-1]  # the per-model table follows
