"""Command-line flags that can also be set by environment variables, parsed into frozen config objects.

Flags follow SGLang's names where one exists (`--model-path`, `--host`, `--port`,
`--speculative-num-steps`, `--speculative-algorithm`, `--max-batch-size`, ...). Every flag `--foo-bar`
of a service with env prefix `SPECMESH_VERIFY_` can also be given as `SPECMESH_VERIFY_FOO_BAR`; the
command line wins over the environment, which wins over the default. `--help` shows each variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")


def _env_name(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse where every option's default may come from `<env_prefix><FLAG_NAME>`."""

    def __init__(self, *a, env_prefix: str, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*a, **kw)
        self.env_prefix = env_prefix
        self.secrets: dict[str, str] = {}  # dest -> the environment variable that alone may set it
        self.process_only: tuple[str, ...] = ()  # dests that configure the process, not the service's config

    def secret_flag(self, name: str, *, file_flag: str, help: str) -> None:
        """A secret (a key) that only the environment may give: on the command line any user of the machine
        could read it (ps, /proc/PID/cmdline), so there it is refused with a pointer to `file_flag`."""
        env = _env_name(self.env_prefix, name)

        class Refuse(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                parser.error(
                    f"{name} is refused on the command line, where any user of the machine can read it "
                    f"(ps, /proc/PID/cmdline): put the key in a file and pass {file_flag} FILE, or set {env}"
                )

        action = self.add_argument(name, action=Refuse, default=None, help=f"{help} [env {env} only]")
        self.secrets[action.dest] = env

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        for dest, env in self.secrets.items():  # read here, so --help never shows them
            setattr(ns, dest, os.environ.get(env, ""))
        return ns, rest

    def flag(self, name: str, *, type=str, default=None, help: str, choices=None, required: bool = False):
        env = _env_name(self.env_prefix, name)
        if type is bool:
            raw = os.environ.get(env)
            value = _parse_bool(raw) if raw is not None else bool(default)
            self.add_argument(name, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [env {env}]")
            return
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = type(raw)
            except ValueError as e:
                raise SystemExit(f"{env}={raw!r}: {e}") from None
            required = False
        self.add_argument(
            name, type=type, default=default, choices=choices, required=required, help=f"{help} [env {env}]"
        )


def add_config_flags(
    ap: EnvArgumentParser, defaults: Any, helps: dict[str, str], options: dict[str, dict] | None = None
) -> None:
    """A flag per config field that `helps` describes, in its order (`max_sessions`: --max-sessions), with the
    field's value in `defaults` as its default and that value's type as its own; `options[field]`: more
    keyword arguments of that flag (choices, a different type)."""
    options = options or {}
    for name, help in helps.items():
        default = getattr(defaults, name)
        kw = {"type": type(default), "default": default, "help": help, **options.get(name, {})}
        ap.flag("--" + name.replace("_", "-"), **kw)


def add_server_flags(ap: EnvArgumentParser, host: str, port: int) -> None:
    """Where a model service listens for gRPC, and the torch device its model runs on."""
    ap.flag("--host", default=host, help="address to listen on (0.0.0.0 for all interfaces)")
    ap.flag("--port", type=int, default=port, help="gRPC port (0 = any free port, printed at start)")
    ap.flag("--device", default=None, help="torch device; default cuda when available, else cpu")


PROCESS_FLAGS = ("threads", "log_level", "log_format")


def add_process_flags(ap: EnvArgumentParser, metrics_port: int = 9464) -> None:
    """Flags every service process has: metrics port (its default differs per service, so the services can
    share a host with their defaults), torch threads, logging."""
    ap.flag("--metrics-port", type=int, default=metrics_port, help="Prometheus /metrics HTTP port (-1 = off, 0 = any)")
    ap.flag("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.flag("--log-level", default="INFO", help="logging level")
    ap.flag(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object per line with trace and request ids",
    )


def split_process_flags(args: dict) -> dict:
    """Remove the process flags from parsed args (the rest builds the service's config); return them."""
    return {k: args.pop(k) for k in PROCESS_FLAGS}


def parse_config(ap: EnvArgumentParser, config_type: Callable[..., ConfigT], argv=None) -> tuple[ConfigT, dict]:
    """The service's config from every flag but the process flags, and those; a config that refuses its values
    (ValueError) is a usage error."""
    args = vars(ap.parse_args(argv))
    process = split_process_flags(args)
    process.update({k: args.pop(k) for k in ap.process_only if k in args})
    try:
        return config_type(**args), process
    except ValueError as e:
        ap.error(str(e))
