"""The ``prefixstore`` command: ``serve`` runs a store node, ``demo`` runs the reference hybrid
model (gpu_staging/) against an embedded store; the operators' commands (``stats``, ``flush``,
``delete``, ``namespaces``, ``config``) are prefixstore/admin_cli.py's, the simulator's
(``trace``, ``simulate``, ``plan``) prefixstore/sim/cli.py's.

``serve`` has one flag per :class:`~prefixstore.store.StoreConfig` field (prefixstore/flags.py),
with the precedence flag > environment > file > default.

This is the only place that configures logging (prefixstore/logs.py); library code only logs
through ``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import lmdb
from aiohttp import web

from . import __version__, logs, preflight
from .flags import add_knob_flags, flag_name, format_size, knob_sources, load_config, with_source
from prefixstore.store.admin import sources_of
from prefixstore.store.cluster import MEMBERSHIP
from prefixstore.store.config import ENV_PREFIX, ConfigError, StoreConfig
from .preflight import check_memory
from prefixstore.store.heap import keep_freed_memory
from prefixstore.store.runner import StoreRunner
from prefixstore.store.server import STORE, create_app

if TYPE_CHECKING:
    from prefixstore.gpu_staging.demo import DemoOptions

log = logging.getLogger("prefixstore.serve")

EXIT_OK = 0
EXIT_FAILURE = 1  # could not start or reach the store
EXIT_USAGE = 2  # a bad flag or config value: same code argparse uses
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # stdout's reader went away

# In-flight requests get this long to finish after SIGTERM. Lookups and reads
# take milliseconds; the bound stays well inside Kubernetes' default 30 s
# termination grace period, so LMDB is closed by us rather than by SIGKILL.
SHUTDOWN_TIMEOUT_S = 10.0

# torch's CPU build, from its CPU wheel index: PyPI's default build pulls gigabytes of CUDA libraries.
TORCH_CPU_INSTALL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


# ---------------------------------------------------------------- parser


def _paragraphs(*texts: str) -> str:
    """Pre-wrapped paragraphs: RawDescriptionHelpFormatter keeps them apart, and the examples aligned."""
    return "\n\n".join(textwrap.fill(t, 79) for t in texts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixstore",
        description="prefixstore: a networked prefix store (KV blocks and recurrent-state "
                    "snapshots) for LLM serving engines.",
        epilog="examples:\n"
               "  prefixstore serve                          # 127.0.0.1:8077, 256MiB RAM, LMDB in ~/.local/share\n"
               "  prefixstore serve --port 0 --data-dir none  # a free port, RAM only\n"
               "  prefixstore serve --config store.toml --ram-bytes 8GiB\n"
               "  prefixstore stats http://127.0.0.1:8077     # hit rates, occupancy, uptime (--cluster: every node)\n"
               "  prefixstore namespaces; prefixstore delete --tenant team-a --cluster --yes\n"
               "  prefixstore config --config store.toml       # every knob's value and where it came from\n"
               "  prefixstore bench -c 16 -n 5000 URL         # load a running store: p50/p99 per operation, hit rates\n"
               "  prefixstore demo --turns 3                  # a conversation against an embedded store\n"
               "  prefixstore plan --model all                # bytes per token, crossover, snapshot interval\n"
               "  prefixstore simulate --workload multi-turn --capacity 4GiB,16GiB --policy all\n\n"
               "Run 'prefixstore COMMAND --help' for the options of a command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"prefixstore {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve", help="run a store node (HTTP plane, RAM arena, LMDB tier)",
        description=_paragraphs(
            "Run a store node until SIGTERM or SIGINT, then shut down gracefully "
            "(in-flight requests finish, LMDB is closed).",
            "Every option below is a field of StoreConfig. Each can also be set by an "
            f"environment variable ({ENV_PREFIX}<FIELD>, e.g. {ENV_PREFIX}RAM_BYTES=4GiB) "
            "or a key of the TOML config file (ram_bytes = \"4GiB\"). Precedence: "
            "flag > environment > config file > default. Sizes accept units "
            "(65536, 64KiB, 4GiB, 1.5GB). A bad value exits with status 2, naming the knob."),
        epilog=_paragraphs(
            "Once listening, one line is logged to stderr: 'prefixstore serving on "
            "http(s)://HOST:PORT (ram=SIZE, lmdb=PATH|none)', with the address and port actually "
            "bound (useful with --port 0)."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_knob_flags(serve)
    serve.set_defaults(run=cmd_serve)

    from .admin_cli import add_commands as add_admin_commands

    add_admin_commands(commands)

    from .bench import add_commands as add_bench_commands

    add_bench_commands(commands)

    demo = commands.add_parser(
        "demo", help="run a multi-turn conversation of a small hybrid model against an embedded store",
        description=_paragraphs(
            "Start a store on a free loopback port, run a multi-turn conversation of the reference "
            "hybrid model (gpu_staging/reference_model.py: 4 delta-rule + 2 attention layers, random "
            "seeded weights, float32 on CPU) against it, and print per turn how many tokens were "
            "reused and the KV and state hit rates. Stops the store when done. Needs torch "
            f"(the CPU build is enough: {TORCH_CPU_INSTALL}).",
            "Each turn's prompt is the whole conversation so far plus a new user message; the previous "
            "turn saved its prompt and answer, so every turn after the first should reuse all of it."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--turns", type=int, default=4, metavar="N", help="turns of the conversation (default: 4)")
    demo.add_argument("--user-tokens", type=int, default=96, metavar="N",
                      help="tokens of each new user message (default: 96)")
    demo.add_argument("--answer-tokens", type=int, default=24, metavar="N",
                      help="tokens the model answers per turn, greedily (default: 24)")
    demo.add_argument("--block-tokens", type=int, default=16, metavar="N",
                      help="store block size B in tokens (default: 16)")
    demo.add_argument("--page-tokens", type=int, default=16, metavar="N",
                      help="engine page size in tokens, independent of B (default: 16)")
    demo.add_argument("--mode", choices=("exact", "replay", "auto"), default="exact",
                      help="exact: reuse KV + snapshot up to state_tokens; replay: reuse KV up to kv_tokens and "
                           "rebuild the state by replaying the last tokens (Tail-Replay); auto: exact when it "
                           "recomputes no more than a replay would (default: exact)")
    demo.add_argument("--replay-fraction", type=float, default=0.1, metavar="F",
                      help="Tail-Replay budget as a fraction of the reused prefix (default: 0.1)")
    demo.add_argument("--interval", type=int, default=0, metavar="TOKENS",
                      help="also snapshot every TOKENS tokens (default: 0, prompt and generation ends only)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model weights and messages (default: 0)")
    demo.add_argument("--data-dir", default="temp", metavar="DIR",
                      help="LMDB tier of the embedded store: 'temp' (a temporary directory, deleted at exit), "
                           "'none' (RAM only) or a directory to keep (default: temp)")
    demo.add_argument("--ram-bytes", default="64MiB", metavar="SIZE",
                      help="RAM arena of the embedded store (default: 64MiB)")
    demo.set_defaults(run=cmd_demo)

    from .sim.cli import add_commands

    add_commands(commands)
    # A bad flag is reported by the command it was given to, with that command's usage
    # (main() routes it there): argparse itself would print the top-level usage.
    for command_parser in commands.choices.values():
        command_parser.set_defaults(command_parser=command_parser)
    return parser


# ---------------------------------------------------------------- serve


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, lmdb.MemoryError)) or (
        isinstance(err, OSError) and err.errno == errno.ENOMEM)


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve(config: StoreConfig, ready: Callable[[str], None] | None = None,
                sources: Mapping[str, str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT. Returns the process exit status. ``sources``: where each knob's
    value came from (/v1/admin/config answers them)."""
    keep_freed_memory(config.heap_keep_bytes)  # this process's C heap (store/heap.py)
    try:
        app = create_app(config)  # maps the RAM arena and allocates the sighting filter
        if sources is not None:
            sources_of(app, sources)
    except (OSError, MemoryError) as err:
        if not _out_of_memory(err):
            raise
        # What check_memory cannot see coming: the kernel's overcommit rules, an address-space limit.
        log.error("cannot allocate the RAM arena (ram_bytes=%s) and the sighting filter (sighting_filter_bytes=%s): "
                  "%s; lower ram_bytes", format_size(config.ram_bytes), format_size(config.sighting_filter_bytes),
                  err)
        return EXIT_FAILURE
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # aiohttp's access log stays off: the store's own (access_log, slow_request_s; store/http.py)
    # names the route and the tenant, never a query string or a token.
    runner = StoreRunner(app, config, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    lmdb_text = str(config.lmdb_path) if config.lmdb_path is not None else "none"
    try:
        try:
            await runner.setup()  # opens the LMDB tier and loads its index
        except (OSError, RuntimeError, lmdb.Error, ConfigError) as err:
            # A data directory another store holds (store/lmdb_tier.py), a descriptor limit that leaves
            # no room for connections (store/runner.py): one line naming what to change, exit 1.
            # LMDB maps its whole file size up front, sized from disk_bytes: an impossible
            # disk_bytes fails here as "Cannot allocate memory", which names no knob by itself
            # (nor would the arena's mmap, were it ever made here rather than in create_app).
            hint = (f"; LMDB's memory map (sized from disk_bytes={format_size(config.disk_bytes)}) or the RAM "
                    f"arena (ram_bytes={format_size(config.ram_bytes)}) is more than this process may map: "
                    "lower it" if _out_of_memory(err) else "")
            log.error("cannot open the store (lmdb=%s): %s%s", lmdb_text, err, hint)
            return EXIT_FAILURE
        # Built (and its files read) by StoreConfig: a bad certificate failed at start-up, naming the knob.
        ssl_context = config.ssl_context()
        site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as err:
            log.error("cannot listen on %s:%d: %s", config.host, config.port, err)
            return EXIT_FAILURE
        host, port = runner.addresses[0][:2]
        url = _url(host, port, "https" if ssl_context is not None else "http")
        log.info("prefixstore serving on %s (ram=%s, lmdb=%s)", url, format_size(config.ram_bytes), lmdb_text)
        # The node's identity in placement (store/membership.py): node_url, else the address bound.
        named = host if host not in ("0.0.0.0", "::") else socket.gethostname()
        runner.app[MEMBERSHIP].set_self_url(_url(named, port, "https" if ssl_context is not None else "http"))
        if ready is not None:
            ready(url)
        await stop.wait()
        log.info("shutting down (in-flight requests get up to %.0fs)", SHUTDOWN_TIMEOUT_S)
    finally:
        try:
            await runner.cleanup()  # closes the listener, then the store and its LMDB env
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    log.info("prefixstore stopped")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args, os.environ)
        try:
            preflight.check(config)  # what `prefixstore config` checks too
        except ConfigError as err:
            raise with_source(err, args, os.environ) from err
    except ConfigError as err:
        print(f"prefixstore serve: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(config.log_level, config.log_format)
    return asyncio.run(serve(config, sources=knob_sources(args, os.environ)))


# ---------------------------------------------------------------- demo


async def demo(config: StoreConfig, options: DemoOptions) -> int:
    """Serve ``config`` on loopback, run the conversation against it, stop the store."""
    from prefixstore.gpu_staging.demo import run_conversation  # torch: imported only by this command

    runner = StoreRunner(create_app(config), config, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = _url(host, port)
        lmdb_text = str(config.lmdb_path) if config.lmdb_path is not None else "none"
        print(f"embedded store on {url} (ram={format_size(config.ram_bytes)}, lmdb={lmdb_text})", flush=True)
        await run_conversation(url, options, lambda line: print(line, flush=True))
        stats = runner.app[STORE].stats()
        for name in ("entries", "stored_bytes"):
            value = stats.get(name)
            if isinstance(value, dict) and value:
                print(f"store {name}: " + ", ".join(f"{k} {v}" for k, v in value.items()), flush=True)
    except (OSError, lmdb.Error) as err:
        print(f"prefixstore demo: cannot run the embedded store: {err}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        await runner.cleanup()
    print("store stopped", flush=True)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"prefixstore demo: needs torch (the CPU build is enough): {TORCH_CPU_INSTALL}", file=sys.stderr)
        return EXIT_FAILURE
    from prefixstore.gpu_staging.demo import DemoOptions

    try:
        options = DemoOptions(turns=args.turns, user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                              block_tokens=args.block_tokens, page_tokens=args.page_tokens, mode=args.mode,
                              replay_fraction=args.replay_fraction, interval=args.interval, seed=args.seed)
    except ValueError as err:
        print(f"prefixstore demo: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="prefixstore-demo-") as tmp:
        data_dir = os.path.join(tmp, "lmdb") if args.data_dir == "temp" else args.data_dir
        try:
            config = StoreConfig.from_sources({"host": "127.0.0.1", "port": "0", "data_dir": data_dir,
                                               "ram_bytes": args.ram_bytes}, env={})
        except ConfigError as err:
            print(f"prefixstore demo: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        return asyncio.run(demo(config, options))


# ---------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # A flag no parser knows: the command it followed reports it, with its own usage
        # (one given before the command is the top level's).
        words = list(sys.argv[1:] if argv is None else argv)
        top_level = unknown[0] in words[: words.index(args.command)] if args.command in words else True
        parser_of_command: argparse.ArgumentParser = parser if top_level else args.command_parser
        parser_of_command.error(f"unrecognized arguments: {' '.join(unknown)}")
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        status = run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return status
    except KeyboardInterrupt:  # Ctrl-C before the serve loop installed its handler
        return 130
    except BrokenPipeError:
        # The reader left (`prefixstore stats --json | head`): the rest has nowhere to go. stdout is
        # pointed at /dev/null so the interpreter's own flush at exit does not complain about it
        # either; the status is a shell's for a process a SIGPIPE ended (128 + 13), as for cat.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


__all__ = ["build_parser", "check_memory", "flag_name", "format_size", "load_config", "main", "serve"]


if __name__ == "__main__":
    sys.exit(main())
