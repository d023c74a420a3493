"""The store's knobs as command-line flags, and where each value came from: shared by ``serve``
(prefixstore/cli.py) and ``config`` (prefixstore/admin_cli.py).

One flag per :class:`~prefixstore.store.StoreConfig` field, generated from the dataclass, so a
new knob needs no CLI change and its ``--help`` text is the documentation written where the
field is declared. Values reach :meth:`StoreConfig.from_sources` as the strings the operator
typed: the config tree does every conversion and validation.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from prefixstore.admission import ADMISSION_POLICIES, EVICTION_POLICIES
from prefixstore.store.config import ENV_PREFIX, LOG_FORMATS, LOG_LEVELS, ConfigError, StoreConfig

CONFIG_ENV = ENV_PREFIX + "CONFIG"
"""Environment variable naming the TOML config file when --config is not given."""

# Knobs whose value is a name from a fixed set: listed in --help. The config
# tree validates them; the CLI only shows the choices.
_CHOICES: dict[str, Callable[[], Sequence[str]]] = {
    "kv_admission": lambda: sorted(ADMISSION_POLICIES),
    "state_admission": lambda: sorted(ADMISSION_POLICIES),
    "eviction": lambda: sorted(EVICTION_POLICIES),
    "log_level": lambda: LOG_LEVELS,
    "log_format": lambda: LOG_FORMATS,
}

_METAVARS = {"size": "SIZE", "host": "HOST", "data_dir": "DIR", "port": "PORT"}


def format_size(num_bytes: int) -> str:
    """65536 -> '64KiB', 1500 -> '1500B': exact binary units, the form parse_size reads back."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift and num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return f"{num_bytes}B"


def human_bytes(num_bytes: int) -> str:
    """For display: 65536 -> '64 KiB', 1536000 -> '1.46 MiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.0f} TiB" if value.is_integer() else f"{value:.3g} TiB"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _default_text(f: dataclasses.Field[object]) -> str:
    default = f.default
    if f.metadata.get("kind") == "size" and isinstance(default, int):
        return format_size(default)
    if isinstance(default, bool):
        return str(default).lower()
    if default == "":
        return "empty"
    return str(default)


def _metavar(f: dataclasses.Field[object]) -> str:
    kind = f.metadata.get("kind", "")
    if kind in _METAVARS:
        return _METAVARS[kind]
    if f.name in _METAVARS:
        return _METAVARS[f.name]
    if f.name in _CHOICES:
        return "NAME"
    if f.name.endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "NUMBER"}.get(type(f.default), "TEXT")


def _field_help(f: dataclasses.Field[object]) -> str:
    text = str(f.metadata.get("help", "")).strip()
    if f.name in _CHOICES:
        text += f" Choices: {', '.join(_CHOICES[f.name]())}."
    text += f" [env: {env_name(f.name)}; default: {_default_text(f)}]"
    return text.replace("%", "%%")  # argparse %-formats help strings



def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and one flag per StoreConfig knob (all default None: unset leaves the
    environment, the file and the default in charge)."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"TOML file of StoreConfig fields (knob = value). [env: {CONFIG_ENV}]")
    knobs = parser.add_argument_group("store configuration (StoreConfig)")
    for f in StoreConfig.knobs():
        if isinstance(f.default, bool):
            # --lmdb-sync / --no-lmdb-sync
            knobs.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=_field_help(f))
        else:
            # Strings on purpose: StoreConfig converts and validates, naming the knob.
            knobs.add_argument(flag_name(f.name), dest=f.name, metavar=_metavar(f), default=None,
                               help=_field_help(f))


def overrides_of(args: argparse.Namespace) -> dict[str, object]:
    return {f.name: getattr(args, f.name) for f in StoreConfig.knobs()}


def _source_of(knob: str, overrides: Mapping[str, object], env: Mapping[str, str], config_file: str | None) -> str:
    """Where a knob's value came from, to point the operator at the right place."""
    if overrides.get(knob) is not None:
        return f"flag {flag_name(knob)}"
    if env_name(knob) in env:
        return f"environment {env_name(knob)}"
    if config_file:
        return f"config file {config_file}"
    return "default"


def config_file_of(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    return args.config or env.get(CONFIG_ENV) or None


def with_source(err: ConfigError, args: argparse.Namespace, env: Mapping[str, str]) -> ConfigError:
    """``err`` with where its knob's value came from appended (when the message starts with a knob)."""
    overrides = overrides_of(args)
    knob = str(err).split(":", 1)[0]
    if knob not in overrides:
        return err
    return ConfigError(f"{err} (set by {_source_of(knob, overrides, env, config_file_of(args, env))})")


def load_config(args: argparse.Namespace, env: Mapping[str, str]) -> StoreConfig:
    """StoreConfig from the parsed flags, the environment and the config file. Raises ConfigError."""
    overrides = overrides_of(args)
    try:
        return StoreConfig.from_sources(overrides, env=env, config_file=config_file_of(args, env))
    except ConfigError as err:
        raise with_source(err, args, env) from err



def knob_sources(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """Where each knob's value comes from: 'flag --x', 'env PREFIXSTORE_X', 'file PATH', 'default'."""
    sources = StoreConfig.sources(overrides_of(args), env=env, config_file=config_file_of(args, env))
    return {name: f"flag {flag_name(name)}" if source == "flag" else source for name, source in sources.items()}
