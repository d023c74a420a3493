"""The operators' commands, in the idiom of redis-cli and etcdctl: one command per question, a
store URL (default http://127.0.0.1:8077), readable output or ``--json``, exit status 1 with one
line when the store cannot be reached or refuses::

    prefixstore stats [URL] [--cluster] [--json]     GET /v1/stats (of every member: --cluster)
    prefixstore namespaces [URL] [--cluster] [--json] GET /v1/admin/namespaces
    prefixstore flush [URL] [--cluster] --yes        POST /v1/admin/flush
    prefixstore delete [URL] (--namespace ID | --tenant NAME) [--cluster] --yes
                                                     POST /v1/admin/delete
    prefixstore config [URL] [--json] [serve's flags] the effective value and source of every knob:
                                                     of a running store (URL), else what `serve`
                                                     would run with here (the same flags, env, file)

A store with tenants needs the admin token on all of them but ``config`` without URL; it is read
from ``$PREFIXSTORE_ADMIN_TOKEN``, never a flag (flags show in process lists). https stores are
verified against ``--ca-file`` (default: the system's CAs); ``--cert-file``/``--key-file`` present
a client certificate (mutual TLS). ``--cluster`` asks the URL for its members (GET /v1/members)
and then each member: a cluster's entries, and a tenant's, are spread over its nodes, so a flush
or a delete without it clears one node's share only (the command says so).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from . import preflight
from .flags import add_knob_flags, format_size, human_bytes, knob_sources, load_config, with_source
from prefixstore.protocol.wire import CONTENT_TYPE, encode_frame
from prefixstore.store.config import ENV_PREFIX, ConfigError, StoreConfig

ADMIN_TOKEN_ENV = ENV_PREFIX + "ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8077"

EXIT_OK = 0
EXIT_FAILURE = 1  # the store could not be reached, or refused
EXIT_USAGE = 2


class AdminError(Exception):
    """One line for the operator: what was asked of which store, and what went wrong."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """A store and how to reach it: the admin token, TLS files, a timeout."""

    url: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout_s: float = 5.0

    def at(self, url: str) -> Target:
        return Target(url=url.rstrip("/"), token=self.token, ca_file=self.ca_file, cert_file=self.cert_file,
                      key_file=self.key_file, timeout_s=self.timeout_s)

    def _context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def call(self, path: str, frame: Mapping[str, object] | None = None) -> dict[str, object]:
        """GET ``path`` (or POST ``frame`` to it); the JSON object answered. Raises AdminError."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        data = None
        if frame is not None:
            data = encode_frame(dict(frame))
            headers["Content-Type"] = CONTENT_TYPE
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method="GET" if frame is None else "POST")
        opener = urllib.request.build_opener(_NoRedirects, urllib.request.HTTPSHandler(context=self._context()))
        try:
            with opener.open(request, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            if 300 <= err.code < 400:
                raise AdminError(f"{self.url}{path} answered {err.code} {err.reason}, a redirect to "
                                 f"{err.headers.get('Location', '(no Location)')}; not followed (the admin token "
                                 "goes to the URL given only): give the store's own URL") from None
            raise AdminError(f"{self.url}{path} answered {err.code} {err.reason}{_refusal(err)}") from None
        except urllib.error.URLError as err:
            raise AdminError(f"cannot reach the store at {self.url}: {err.reason}") from None
        except OSError as err:  # timeouts, TLS files that do not load
            raise AdminError(f"cannot reach the store at {self.url}: {err}") from None
        except ValueError as err:
            raise AdminError(f"{self.url}{path} did not answer JSON: {err}") from None
        if not isinstance(body, dict):
            raise AdminError(f"{self.url}{path} did not answer a JSON object")
        return body

    def members(self) -> list[str]:
        answer = self.call("/v1/members")
        members = answer.get("members")
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members) or not members:
            raise AdminError(f"{self.url}/v1/members did not answer a member list")
        return [str(m) for m in members]


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are answered, never followed: urllib would resend the request, Authorization
    header included, to wherever a Location points (another host, plain http). A store never
    redirects; something between the operator and it that does is worth an error line."""

    def redirect_request(self, req: urllib.request.Request, fp: object, code: int, msg: str,
                         headers: object, newurl: str) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _refusal(err: urllib.error.HTTPError) -> str:
    """The store's own reason ({"error": ...}), when it gave one; for a 401, where the admin token
    comes from (the store cannot know that the operator's shell is where it is missing)."""
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        body = None
    reason = f": {body['error']}" if isinstance(body, dict) and isinstance(body.get("error"), str) else ""
    if err.code == 401:
        reason += (f" (the admin commands send the admin token from ${ADMIN_TOKEN_ENV}: "
                   f"{'the one set was refused' if os.environ.get(ADMIN_TOKEN_ENV) else 'it is not set'})")
    return reason


# ---------------------------------------------------------------- parser


def _target_args(parser: argparse.ArgumentParser, cluster: str | None) -> None:
    parser.add_argument("url", metavar="URL", nargs="?", default=DEFAULT_URL,
                        help=f"base URL of the store (default: {DEFAULT_URL})")
    parser.add_argument("--ca-file", metavar="FILE", default=None,
                        help="PEM CA bundle that signs an https store's certificate (default: the system's)")
    parser.add_argument("--cert-file", metavar="FILE", default=None,
                        help="PEM client certificate to present (a store with tls_client_ca_file: mutual TLS)")
    parser.add_argument("--key-file", metavar="FILE", default=None,
                        help="PEM private key of --cert-file (default: in --cert-file itself)")
    parser.add_argument("--timeout", metavar="SECONDS", type=float, default=5.0,
                        help="give up on a store after this many seconds (default: 5)")
    if cluster is not None:
        parser.add_argument("--cluster", action="store_true", help=cluster)


_TOKEN_NOTE = (f" A store with tenants needs the admin token, read from ${ADMIN_TOKEN_ENV} (never a flag: flags "
               "show in process lists). Exits 1 with one line when a store cannot be reached or refuses.")


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    stats = commands.add_parser(
        "stats", help="a running store's statistics: hit rates, occupancy, uptime, version (GET /v1/stats)",
        description="Ask a running store for its statistics (GET URL/v1/stats) and print them: lookups and "
                    "token hit rates by kind (kv, state), entries and bytes by kind and tier, the RAM arena, "
                    "the LMDB tier, leases, tenants, policies, version, uptime and whether the native "
                    "extensions are in use." + _TOKEN_NOTE)
    _target_args(stats, "ask every member of URL's cluster (GET URL/v1/members) and print one row per "
                        "node and the cluster's totals")
    stats.add_argument("--json", action="store_true", help="print the raw JSON answer (per member with --cluster)")
    stats.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                       help="redraw a table every SECONDS (default 2) until Ctrl-C: per node (with --cluster, every "
                            "member and the total) lookups per second and token hit rates over the last interval "
                            "and since start, entries, bytes; then the hit rates by model")
    stats.add_argument("--count", type=int, default=0, metavar="N",
                       help="with --watch: stop after N tables (default: 0, until Ctrl-C)")
    stats.set_defaults(run=cmd_stats)

    namespaces = commands.add_parser(
        "namespaces", help="list the namespaces a store holds, with entries and bytes (GET /v1/admin/namespaces)",
        description="List the namespaces registered on a store (id, tenant, model, revision, block size) with "
                    "the entries and payload bytes each holds. The ids are what `prefixstore delete "
                    "--namespace` takes." + _TOKEN_NOTE)
    _target_args(namespaces, "list every member's namespaces, entries and bytes summed over the members")
    namespaces.add_argument("--json", action="store_true", help="print the raw JSON answer")
    namespaces.set_defaults(run=cmd_namespaces)

    flush = commands.add_parser(
        "flush", help="delete every entry a store holds (POST /v1/admin/flush)",
        description="Delete every committed entry of a store, in RAM and in LMDB; namespaces stay registered. "
                    "Asks for --yes, as it cannot be undone." + _TOKEN_NOTE)
    _target_args(flush, "flush every member of URL's cluster (without it, only URL's node is flushed)")
    flush.add_argument("--yes", action="store_true", help="really delete (required)")
    flush.set_defaults(run=cmd_flush)

    delete = commands.add_parser(
        "delete", help="delete one namespace's or one tenant's entries (POST /v1/admin/delete)",
        description="Delete every entry of one namespace (--namespace, an id from `prefixstore namespaces`) "
                    "or of every namespace of one tenant (--tenant), in RAM and in LMDB; the namespaces stay "
                    "registered. Asks for --yes, as it cannot be undone." + _TOKEN_NOTE)
    _target_args(delete, "delete on every member of URL's cluster (a tenant's entries are spread over them; "
                         "without it only URL's node's share is deleted)")
    which = delete.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="ID", help="namespace id, 16 hex digits")
    which.add_argument("--tenant", metavar="NAME", help="tenant name (the tenants file's [tenants.NAME])")
    delete.add_argument("--yes", action="store_true", help="really delete (required)")
    delete.set_defaults(run=cmd_delete)

    config = commands.add_parser(
        "config", help="the effective value of every knob and where it came from (default, file, env, flag)",
        description="Print every StoreConfig knob with its effective value and its source: 'default', "
                    "'file PATH' (the TOML config file), 'env PREFIXSTORE_X' or 'flag --x'. With URL, those "
                    "of a running store (GET URL/v1/admin/config; a store with tenants needs the admin "
                    f"token, ${ADMIN_TOKEN_ENV}). Without, what `prefixstore serve` would run with here, given "
                    "the same flags (below), environment and config file; a bad value exits 2 naming the "
                    "knob, as serve would.")
    config.add_argument("url", metavar="URL", nargs="?", default=None,
                        help="base URL of a running store (default: none, this machine's configuration)")
    config.add_argument("--ca-file", metavar="FILE", default=None, help="as for stats: the CA of an https store")
    config.add_argument("--cert-file", metavar="FILE", default=None, help="as for stats: a client certificate")
    config.add_argument("--key-file", metavar="FILE", default=None, help="as for stats: its private key")
    config.add_argument("--timeout", metavar="SECONDS", type=float, default=5.0,
                        help="give up after this many seconds (default: 5)")
    config.add_argument("--json", action="store_true", help="print {knob: {value, source}} as JSON")
    add_knob_flags(config)
    config.set_defaults(run=cmd_config)


# ---------------------------------------------------------------- running commands


def target_of(args: argparse.Namespace) -> Target:
    url = str(args.url).rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return Target(url=url, token=os.environ.get(ADMIN_TOKEN_ENV) or None, ca_file=args.ca_file,
                  cert_file=args.cert_file, key_file=args.key_file, timeout_s=args.timeout)


def _run(command: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except AdminError as err:
        print(f"prefixstore {command}: {err}", file=sys.stderr)
        return EXIT_FAILURE


def _each_member(target: Target, cluster: bool) -> Iterator[Target]:
    if not cluster:
        yield target
        return
    for url in target.members():
        yield target.at(url)


def _cluster_note(target: Target, what: str) -> str:
    """A warning when ``target`` is one node of several and only its share was touched."""
    try:
        members = target.members()
    except AdminError:
        return ""
    if len(members) <= 1:
        return ""
    return (f"note: {target.url} is one of {len(members)} members of a cluster: only its share was {what}; "
            "--cluster does every member")


# ---------------------------------------------------------------- stats


def _flatten(value: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        if not value and prefix:
            yield prefix, "-"
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return " ".join(f"{n}{u}" for n, u in ((d, "d"), (h, "h"), (m, "m")) if n) + f" {s}s" if (d or h or m) else f"{s}s"


def _text(name: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith(".rate") and isinstance(value, (int, float)):
        return f"{value:.1%}"
    if name == "uptime_s" and isinstance(value, (int, float)):
        return _duration(float(value))
    if "bytes" in name and isinstance(value, int):
        return f"{value} ({human_bytes(value)})"
    return str(value)


def _models_of(stats: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The per-model hit rates of a /v1/stats answer (``lookups.models``; absent from older stores)."""
    lookups = stats.get("lookups")
    models = lookups.get("models") if isinstance(lookups, dict) else None
    return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []


def _without_models(stats: Mapping[str, object]) -> dict[str, object]:
    lookups = stats.get("lookups")
    if not isinstance(lookups, dict):
        return dict(stats)
    return {**stats, "lookups": {k: v for k, v in lookups.items() if k != "models"}}


def format_models(models: Sequence[Mapping[str, object]]) -> str:
    """A row per (tenant, model): lookup tokens and the KV and state token hit rates (state: '-'
    for a plain transformer, which has none). The failure to see at a glance: one model's state
    hit rate collapsed while its KV hit rate is healthy."""
    head = ("tenant", "model", "tokens", "kv hit", "state hit")
    rows: list[tuple[str, ...]] = [head]
    for m in models:
        kv, state = m.get("kv"), m.get("state")
        kv_counts = kv if isinstance(kv, dict) else {}
        state_counts = state if isinstance(state, dict) else {}
        hits, misses = int(kv_counts.get("hit_tokens", 0)), int(kv_counts.get("miss_tokens", 0))
        rows.append((str(m.get("tenant")), str(m.get("model")), str(hits + misses), _rate(hits, misses),
                     _rate(int(state_counts.get("hit_tokens", 0)), int(state_counts.get("miss_tokens", 0)))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def summed_models(per_member: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Per-model token counts summed over members (a model's lookups are counted where they land)."""
    out: dict[tuple[str, str], dict[str, object]] = {}
    for stats in per_member:
        for m in _models_of(stats):
            row = out.setdefault((str(m.get("tenant")), str(m.get("model"))),
                                 {"tenant": m.get("tenant"), "model": m.get("model")})
            for kind in ("kv", "state"):
                counts = m.get(kind)
                if not isinstance(counts, dict):
                    continue
                total = row.setdefault(kind, {"hit_tokens": 0, "miss_tokens": 0})
                assert isinstance(total, dict)
                for field in ("hit_tokens", "miss_tokens"):
                    total[field] += int(counts.get(field, 0))
    for row in out.values():
        for kind in ("kv", "state"):
            counts = row.get(kind)
            if isinstance(counts, dict):
                n = counts["hit_tokens"] + counts["miss_tokens"]
                counts["rate"] = counts["hit_tokens"] / n if n else None
    return [out[k] for k in sorted(out)]


def format_stats(url: str, stats: Mapping[str, object]) -> str:
    """One 'name  value' line per leaf; hit rates in percent, sizes also in binary units. The
    headline (version, uptime, hit rates, occupancy) first; the per-model hit rates as a table."""
    first = ("version", "uptime_s", "native", "lookups", "entries", "stored_bytes", "arena", "disk")
    plain = _without_models(stats)
    ordered = {k: plain[k] for k in first if k in plain} | {k: v for k, v in plain.items() if k not in first}
    rows = [("store", url)] + [(name, _text(name, value)) for name, value in _flatten(ordered)]
    width = max(len(name) for name, _ in rows)
    text = "\n".join(f"{name.ljust(width)}  {text}" for name, text in rows)
    models = _models_of(stats)
    return text + ("\n\nhit rates by model\n" + format_models(models) if models else "")


def _num(stats: Mapping[str, object], *path: str) -> int:
    value: object = stats
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _summed(values: Iterator[Mapping[str, object]]) -> dict[str, int]:
    """Per-kind/tier counts and token counts summed over members (zeros when none answered)."""
    out: dict[str, int] = {"lookups.answered": 0} | {f"lookups.{kind}.{field}": 0 for kind in ("kv", "state")
                                                     for field in ("hit_tokens", "miss_tokens")}
    for stats in values:
        for group in ("entries", "stored_bytes"):
            g = stats.get(group)
            for k, v in (g.items() if isinstance(g, dict) else ()):
                if isinstance(v, int):
                    out[f"{group}.{k}"] = out.get(f"{group}.{k}", 0) + v
        for kind in ("kv", "state"):
            for field in ("hit_tokens", "miss_tokens"):
                key = f"lookups.{kind}.{field}"
                out[key] = out.get(key, 0) + _num(stats, "lookups", kind, field)
        out["lookups.answered"] = out.get("lookups.answered", 0) + _num(stats, "lookups", "answered")
    return out


def _entries(stats: Mapping[str, object]) -> int:
    """Entries a node holds: with an LMDB tier every committed entry is on disk (RAM holds a subset
    of them), else in RAM; counting both tiers would count most entries twice."""
    by = stats.get("entries")
    counts = {str(k): v for k, v in by.items() if isinstance(v, int)} if isinstance(by, dict) else {}
    tier = "disk" if _num(stats, "disk", "enabled") or any(k.endswith("/disk") for k in counts) else "ram"
    return sum(v for k, v in counts.items() if k.endswith("/" + tier))


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _rate(hits: int, misses: int) -> str:
    return f"{hits / (hits + misses):.1%}" if hits + misses else "-"


def format_cluster(per_member: Mapping[str, Mapping[str, object] | str]) -> str:
    """A row per member (its hit rates, entries, bytes, uptime, version, or why it did not answer),
    then the cluster's totals."""
    head = ("member", "version", "uptime", "lookups", "kv hit", "state hit", "entries", "ram", "disk")
    rows: list[tuple[str, ...]] = [head]
    answered = [s for s in per_member.values() if not isinstance(s, str)]
    for url, stats in per_member.items():
        if isinstance(stats, str):
            rows.append((url,))  # its error follows the url, outside the columns
            continue
        entries = _entries(stats)
        by_tier = {t: sum(_num(stats, "stored_bytes", f"{k}/{t}") for k in ("kv", "state")) for t in ("ram", "disk")}
        rows.append((url, str(stats.get("version", "?")), _duration(float(stats.get("uptime_s", 0) or 0)),  # type: ignore[arg-type]
                     str(_num(stats, "lookups", "answered")),
                     _rate(_num(stats, "lookups", "kv", "hit_tokens"), _num(stats, "lookups", "kv", "miss_tokens")),
                     _rate(_num(stats, "lookups", "state", "hit_tokens"),
                           _num(stats, "lookups", "state", "miss_tokens")),
                     str(entries), human_bytes(by_tier["ram"]), human_bytes(by_tier["disk"])))
    total = _summed(iter(answered))
    entries = sum(_entries(s) for s in answered)
    ram = sum(v for k, v in total.items() if k.startswith("stored_bytes.") and k.endswith("/ram"))
    disk = sum(v for k, v in total.items() if k.startswith("stored_bytes.") and k.endswith("/disk"))
    rows.append((f"total ({len(answered)} of {len(per_member)} answered)", "", "", str(total["lookups.answered"]),
                 _rate(total["lookups.kv.hit_tokens"], total["lookups.kv.miss_tokens"]),
                 _rate(total["lookups.state.hit_tokens"], total["lookups.state.miss_tokens"]),
                 str(entries), human_bytes(ram), human_bytes(disk)))
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(head))]
    table = "\n".join(f"{r[0].ljust(widths[0])}  error: {per_member[r[0]]}" if len(r) == 1 else
                      "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    models = summed_models(answered)
    return table + ("\n\nhit rates by model (all members)\n" + format_models(models) if models else "")


def _collect(target: Target, cluster: bool) -> dict[str, Mapping[str, object] | str]:
    """/v1/stats of the URL (``cluster``: of every member), or why each did not answer."""
    if not cluster:
        try:
            return {target.url: target.call("/v1/stats")}
        except AdminError as err:
            return {target.url: str(err)}
    per_member: dict[str, Mapping[str, object] | str] = {}
    try:
        members = [target.at(url) for url in target.members()]
    except AdminError as err:
        # The URL itself did not answer: it is the one member known, shown as down in the table
        # (an operator aiming at a dead node must see a table that says so, not one line).
        per_member[target.url] = str(err)
        members = []
    for member in members:
        try:
            per_member[member.url] = member.call("/v1/stats")
        except AdminError as err:
            per_member[member.url] = str(err)
    return per_member


def format_watch(per_member: Mapping[str, Mapping[str, object] | str],
                 previous: Mapping[str, Mapping[str, object]], interval_s: float) -> str:
    """One frame of ``stats --watch``: a row per member with its lookups per second and token hit
    rates over the last interval (from the counters' differences; '-' on the first frame or after
    a restart), its hit rates since start, entries and bytes; the cluster's row; the per-model
    hit rates since start."""
    head = ("member", "lookups/s", "kv hit now", "state hit now", "kv hit", "state hit", "entries", "ram", "disk")
    rows: list[tuple[str, ...]] = [head]
    sums = {"lookups": 0, "kv_h": 0, "kv_m": 0, "st_h": 0, "st_m": 0}
    answered = [s for s in per_member.values() if not isinstance(s, str)]
    have_previous = False
    for url, stats in per_member.items():
        if isinstance(stats, str):
            rows.append((url,))
            continue
        now = {"lookups": _num(stats, "lookups", "answered"),
               "kv_h": _num(stats, "lookups", "kv", "hit_tokens"), "kv_m": _num(stats, "lookups", "kv", "miss_tokens"),
               "st_h": _num(stats, "lookups", "state", "hit_tokens"),
               "st_m": _num(stats, "lookups", "state", "miss_tokens")}
        before = previous.get(url)
        delta = None
        if before is not None:
            was = {"lookups": _num(before, "lookups", "answered"),
                   "kv_h": _num(before, "lookups", "kv", "hit_tokens"),
                   "kv_m": _num(before, "lookups", "kv", "miss_tokens"),
                   "st_h": _num(before, "lookups", "state", "hit_tokens"),
                   "st_m": _num(before, "lookups", "state", "miss_tokens")}
            if all(now[k] >= was[k] for k in now):  # else the node restarted: its counters began again
                delta = {k: now[k] - was[k] for k in now}
                have_previous = True
                for k in sums:
                    sums[k] += delta[k]
        by_tier = {t: sum(_num(stats, "stored_bytes", f"{k}/{t}") for k in ("kv", "state")) for t in ("ram", "disk")}
        rows.append((url, f"{delta['lookups'] / interval_s:.1f}" if delta else "-",
                     _rate(delta["kv_h"], delta["kv_m"]) if delta else "-",
                     _rate(delta["st_h"], delta["st_m"]) if delta else "-",
                     _rate(now["kv_h"], now["kv_m"]), _rate(now["st_h"], now["st_m"]), str(_entries(stats)),
                     human_bytes(by_tier["ram"]), human_bytes(by_tier["disk"])))
    if len(per_member) > 1:
        total = _summed(iter(answered))
        rows.append((f"total ({len(answered)} of {len(per_member)} answered)",
                     f"{sums['lookups'] / interval_s:.1f}" if have_previous else "-",
                     _rate(sums["kv_h"], sums["kv_m"]) if have_previous else "-",
                     _rate(sums["st_h"], sums["st_m"]) if have_previous else "-",
                     _rate(total["lookups.kv.hit_tokens"], total["lookups.kv.miss_tokens"]),
                     _rate(total["lookups.state.hit_tokens"], total["lookups.state.miss_tokens"]),
                     str(sum(_entries(s) for s in answered)), "", ""))
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(head))]
    table = "\n".join(f"{r[0].ljust(widths[0])}  error: {per_member[r[0]]}" if len(r) == 1 else
                      "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    models = summed_models(answered)
    return table + ("\n\nhit rates by model (since start)\n" + format_models(models) if models else "")


def _watch(target: Target, args: argparse.Namespace) -> int:
    """Redraw the table every ``--watch`` seconds (a terminal: in place; else one frame after the
    other) until Ctrl-C or ``--count`` frames."""
    interval = float(args.watch)
    clear = sys.stdout.isatty()
    previous: dict[str, Mapping[str, object]] = {}
    frames = 0
    try:
        while True:
            per_member = _collect(target, args.cluster)
            frame = format_watch(per_member, previous, interval)
            print(("\x1b[H\x1b[2J" if clear else "") + f"prefixstore stats {target.url}"
                  f"{' --cluster' if args.cluster else ''}: every {interval:g}s, {time.strftime('%H:%M:%S')}\n"
                  + frame + ("" if clear else "\n"), flush=True)
            previous = {u: s for u, s in per_member.items() if not isinstance(s, str)}
            frames += 1
            if args.count and frames >= args.count:
                return EXIT_OK
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    target = target_of(args)
    if args.watch is not None:
        if args.json or args.watch <= 0:
            print("prefixstore stats: error: --watch takes a positive interval and no --json", file=sys.stderr)
            return EXIT_USAGE
        return _watch(target, args)

    def body() -> int:
        if not args.cluster:
            stats = target.call("/v1/stats")
            print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(target.url, stats))
            return EXIT_OK
        per_member = _collect(target, True)
        if args.json:
            print(json.dumps({"members": {u: s if not isinstance(s, str) else {"error": s}
                                          for u, s in per_member.items()},
                              "total": _summed(iter(s for s in per_member.values() if not isinstance(s, str))),
                              "models": summed_models([s for s in per_member.values() if not isinstance(s, str)])},
                             indent=2, sort_keys=True))
        else:
            print(format_cluster(per_member))
        failed = [u for u, s in per_member.items() if isinstance(s, str)]
        if failed:
            for url in failed:  # why each did not (a refused redirect says where it pointed)
                print(f"prefixstore stats: {url}: {per_member[url]}", file=sys.stderr)
            print(f"prefixstore stats: {len(failed)} of {len(per_member)} members did not answer", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_OK

    return _run("stats", body)


# ---------------------------------------------------------------- namespaces


def format_namespaces(listed: Sequence[Mapping[str, object]]) -> str:
    head = ("id", "tenant", "model", "revision", "B", "kv entries", "state entries", "bytes")
    rows: list[tuple[str, ...]] = [head]
    for ns in listed:
        entries = ns.get("entries")
        counts = entries if isinstance(entries, dict) else {}
        rows.append((str(ns.get("id")), str(ns.get("tenant")), str(ns.get("model")), str(ns.get("revision") or "-"),
                     str(ns.get("block_tokens")), str(counts.get("kv", 0)), str(counts.get("state", 0)),
                     human_bytes(int(counts.get("bytes", 0)))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + [f"{len(listed)} namespace(s)"])


def _merged(per_member: Sequence[Sequence[Mapping[str, object]]]) -> list[dict[str, object]]:
    """One row per namespace id, entries and bytes summed over the members that registered it."""
    out: dict[str, dict[str, object]] = {}
    for listed in per_member:
        for ns in listed:
            key = str(ns.get("id"))
            row = out.setdefault(key, {**ns, "entries": {"kv": 0, "state": 0, "bytes": 0, "fork_records": 0}})
            counts = ns.get("entries")
            total = row["entries"]
            assert isinstance(total, dict)
            for k in ("kv", "state", "bytes", "fork_records"):
                total[k] += int(counts.get(k, 0)) if isinstance(counts, dict) else 0
    return sorted(out.values(), key=lambda ns: (str(ns.get("tenant")), str(ns.get("model")), str(ns.get("id"))))


def cmd_namespaces(args: argparse.Namespace) -> int:
    target = target_of(args)

    def body() -> int:
        per_member = []
        for member in _each_member(target, args.cluster):
            listed = member.call("/v1/admin/namespaces").get("namespaces")
            if not isinstance(listed, list):
                raise AdminError(f"{member.url}/v1/admin/namespaces did not answer a namespace list")
            per_member.append([ns for ns in listed if isinstance(ns, dict)])
        listed = _merged(per_member)
        print(json.dumps({"namespaces": listed}, indent=2, sort_keys=True) if args.json else format_namespaces(listed))
        return EXIT_OK

    return _run("namespaces", body)


# ---------------------------------------------------------------- flush and delete


def _confirmed(command: str, args: argparse.Namespace, what: str) -> bool:
    if args.yes:
        return True
    print(f"prefixstore {command}: this deletes {what} at {args.url}{' and every member of its cluster' if args.cluster else ''}"
          " and cannot be undone; add --yes to go ahead", file=sys.stderr)
    return False


def cmd_flush(args: argparse.Namespace) -> int:
    if not _confirmed("flush", args, "every entry"):
        return EXIT_USAGE
    target = target_of(args)

    def body() -> int:
        total = 0
        for member in _each_member(target, args.cluster):
            flushed = member.call("/v1/admin/flush", {}).get("flushed")
            print(f"{member.url}: flushed {flushed} entries")
            total += flushed if isinstance(flushed, int) else 0
        if not args.cluster and (note := _cluster_note(target, "flushed")):
            print(note, file=sys.stderr)
        return EXIT_OK

    return _run("flush", body)


def cmd_delete(args: argparse.Namespace) -> int:
    if args.namespace is not None:
        try:
            ns_id = bytes.fromhex(args.namespace)
        except ValueError:
            ns_id = b""
        if len(ns_id) != 8:
            print(f"prefixstore delete: error: --namespace: {args.namespace!r} is not a namespace id (16 hex digits, "
                  "as `prefixstore namespaces` lists them)", file=sys.stderr)
            return EXIT_USAGE
        frame: dict[str, object] = {"namespace": ns_id}
        what = f"every entry of namespace {args.namespace}"
    else:
        frame = {"tenant": args.tenant}
        what = f"every entry of tenant {args.tenant!r}"
    if not _confirmed("delete", args, what):
        return EXIT_USAGE
    target = target_of(args)

    def body() -> int:
        for member in _each_member(target, args.cluster):
            answer = member.call("/v1/admin/delete", frame)
            namespaces = answer.get("namespaces")
            records = answer.get("fork_records")
            print(f"{member.url}: deleted {answer.get('deleted')} entries"
                  f"{f' (and {records} fork records)' if records else ''} of "
                  f"{len(namespaces) if isinstance(namespaces, list) else '?'} namespace(s)")
        if not args.cluster and (note := _cluster_note(target, "deleted")):
            print(note, file=sys.stderr)
        return EXIT_OK

    return _run("delete", body)


# ---------------------------------------------------------------- config


def _value_text(name: str, value: object) -> str:
    kinds = {f.name: f.metadata.get("kind") for f in StoreConfig.knobs()}
    if kinds.get(name) == "size" and isinstance(value, int) and not isinstance(value, bool):
        return format_size(value)
    if isinstance(value, bool):
        return str(value).lower()
    return "''" if value == "" else str(value)


def format_config(knobs: Mapping[str, Mapping[str, object]]) -> str:
    rows = [("knob", "value", "source")] + [(name, _value_text(name, k.get("value")), str(k.get("source")))
                                            for name, k in knobs.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_config(args: argparse.Namespace) -> int:
    given = [f.name for f in StoreConfig.knobs() if getattr(args, f.name) is not None]
    if args.url is None:
        try:
            config = load_config(args, os.environ)
            try:
                preflight.check(config)  # what serve refuses, config refuses: exit 2 naming the knob
            except ConfigError as err:
                raise with_source(err, args, os.environ) from err
        except ConfigError as err:
            print(f"prefixstore config: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        sources = knob_sources(args, os.environ)
        knobs: dict[str, Mapping[str, object]] = {
            f.name: {"value": config.effective(f.name), "source": sources[f.name]} for f in StoreConfig.knobs()}
    else:
        if given or args.config:
            print("prefixstore config: error: knob flags describe this machine's configuration; with URL the "
                  f"running store's is printed (drop {', '.join('--' + n.replace('_', '-') for n in given) or '--config'})",
                  file=sys.stderr)
            return EXIT_USAGE
        target = target_of(args)
        try:
            answer = target.call("/v1/admin/config").get("knobs")
        except AdminError as err:
            print(f"prefixstore config: {err}", file=sys.stderr)
            return EXIT_FAILURE
        if not isinstance(answer, dict):
            print(f"prefixstore config: {target.url}/v1/admin/config did not answer the knobs", file=sys.stderr)
            return EXIT_FAILURE
        knobs = {str(k): v for k, v in answer.items() if isinstance(v, dict)}
    print(json.dumps(knobs, indent=2) if args.json else format_config(knobs))
    return EXIT_OK


__all__ = ["ADMIN_TOKEN_ENV", "DEFAULT_URL", "AdminError", "Target", "add_commands", "format_cluster",
           "format_config", "format_namespaces", "format_stats"]
