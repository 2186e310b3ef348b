"""Command-line flags generated from config dataclasses, also settable by environment variables.

A config dataclass declares its flags in its fields (`option`): the help text, and where needed choices, a
type to parse with or a default of the flag's own. `add_config_flags` makes a flag of each such field
(`max_sessions`: --max-sessions), `parse_config` builds the config back from the parsed flags, and
`to_argv` renders a config, or some of its fields, as the flags that give it back: a launcher passes
settings on without writing flags by hand, and a flag has one declaration wherever it appears.

Flags follow SGLang's names where one exists (`--model-path`, `--host`, `--port`,
`--speculative-num-steps`, `--speculative-algorithm`, `--max-batch-size`, ...). Every flag `--foo-bar`
of a service with env prefix `SPECMESH_VERIFY_` can also be given as `SPECMESH_VERIFY_FOO_BAR`; the
command line wins over the environment, which wins over the default. `--help` shows each variable.

The flags that more than one command declares live here, once: where a model service listens and runs
(`host_option`, `attention_backend_option`, ...), the process flags of every service (`Logging`,
`ServiceProcess`), and where the gateway listens (`GatewayListen`, which `specmesh serve` takes and passes
on).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")
FLAG = "specmesh.flag"  # the field metadata key of an Option


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()  # an Option's flag defaults to its field's default


def _env_name(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def comma_list(text: str) -> tuple[str, ...]:
    """`a, b,,c` -> ("a", "b", "c"): how a tuple field is written as one flag."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse where every option's default may come from `<env_prefix><FLAG_NAME>` (no environment when
    `env_prefix` is None: a launcher's flags, which it passes on to services that read their own)."""

    def __init__(self, *a, env_prefix: str | None, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*a, **kw)
        self.env_prefix = env_prefix
        self.secrets: dict[str, str] = {}  # dest -> the environment variable that alone may set it
        self.process_only: tuple[str, ...] = ()  # dests that configure the process, not the service's config

    @contextlib.contextmanager
    def process_flags(self) -> Iterator[None]:
        """Every flag added inside configures the process, not the service: parse_config keeps it out of the
        config and returns it with the process flags."""
        before = len(self._actions)
        try:
            yield
        finally:
            self.process_only += tuple(a.dest for a in self._actions[before:])

    def secret_flag(self, name: str, *, file_flag: str, help: str) -> None:
        """A secret (a key) that only the environment may give: on the command line any user of the machine
        could read it (ps, /proc/PID/cmdline), so there it is refused with a pointer to `file_flag`."""
        env = _env_name(self.env_prefix or "", name)

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

    def flag(self, name: str, *, type=str, default=None, help: str, choices=None, required: bool = False, **kw):
        """An option whose default the environment may set; `kw`: more of add_argument's (dest), `aliases`
        (other names) and `group` (the argument group that shows it)."""
        env = _env_name(self.env_prefix, name) if self.env_prefix is not None else None
        raw = os.environ.get(env) if env else None
        help = f"{help} [env {env}]" if env else help
        names, into = (name, *kw.pop("aliases", ())), kw.pop("group", None) or self
        if type is bool:
            value = _parse_bool(raw) if raw is not None else bool(default)
            into.add_argument(*names, action=argparse.BooleanOptionalAction, default=value, help=help, **kw)
            return
        if raw is not None:
            try:
                default = type(raw)
            except ValueError as e:
                raise SystemExit(f"{env}={raw!r}: {e}") from None
            required = False
        into.add_argument(*names, type=type, default=default, choices=choices, required=required, help=help, **kw)


# --- flags declared by config fields ------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line (`option`)."""

    help: str
    choices: tuple | None = None
    type: Callable | None = None  # what parses the flag's text; default: the type of the default
    flag_default: Any = FIELD_DEFAULT  # the flag's, where it is not the field's (code that builds the config gets that)
    required: bool = False
    name: str = ""  # the flag's name, where it is not the field's (`--served-model-name` for model_name)
    aliases: tuple[str, ...] = ()  # other names it is accepted by (SGLang's spellings)


def option(default: Any, help: str, *, choices: Sequence | None = None, **kw) -> Any:
    """A config field that is also a command-line flag (`add_config_flags`): `field = option(4, "what it is")`;
    `kw`: the rest of Option (type, flag_default, required, name, aliases)."""
    return field(default=default, metadata={FLAG: Option(help, tuple(choices) if choices is not None else None, **kw)})


def flag_fields(config: Any) -> list[dataclasses.Field]:
    """The fields of a config dataclass (or instance) that are flags, in declaration order."""
    return [f for f in fields(config) if FLAG in f.metadata]


def flag_name(field_name: str) -> str:
    """The flag of a field by the convention every config follows (`max_sessions`: --max-sessions)."""
    return "--" + field_name.replace("_", "-")


def _flag_of(f: dataclasses.Field) -> str:
    return f.metadata[FLAG].name or flag_name(f.name)


def flag_default(f: dataclasses.Field) -> Any:
    opt: Option = f.metadata[FLAG]
    return f.default if opt.flag_default is FIELD_DEFAULT else opt.flag_default


def add_config_flags(ap: EnvArgumentParser, config_type: type, group: argparse._ArgumentGroup | None = None) -> None:
    """A flag for every field of `config_type` that `option` declares, in field order, with the field's
    default (or the flag's own) and that default's type. A tuple is one comma-separated flag. `group`: the
    argument group of `ap` that shows them."""
    for f in flag_fields(config_type):
        opt: Option = f.metadata[FLAG]
        default = flag_default(f)
        parse = opt.type or (comma_list if isinstance(default, tuple) else str if default is None else type(default))
        if isinstance(default, tuple):
            default = ",".join(default)  # argparse parses a string default with `parse`, as it will the flag
        choices = list(opt.choices) if opt.choices is not None else None
        ap.flag(
            _flag_of(f),
            type=parse,
            default=default,
            help=opt.help,
            choices=choices,
            required=opt.required,
            dest=f.name,
            aliases=opt.aliases,
            group=group,
        )


def parse_config(ap: EnvArgumentParser, config_type: Callable[..., ConfigT], argv=None) -> tuple[ConfigT, dict]:
    """The service's config from every flag but the process flags (`ap.process_only`), and those; a config
    that refuses its values (ValueError) is a usage error."""
    args = vars(ap.parse_args(argv))
    process = {k: args.pop(k) for k in ap.process_only if k in args}
    try:
        return config_type(**args), process
    except ValueError as e:
        ap.error(str(e))


def to_argv(config: Any) -> list[str]:
    """The flags that give `config` back when parsed: a flag-generated dataclass renders every flag field
    whose value is not its flag's default (the rest come back as defaults), a mapping of field names to
    values (some of a config's fields, from a launcher that cannot import the config's class) renders
    every value but None. Booleans are `--x` / `--no-x`, tuples comma-separated."""
    if isinstance(config, Mapping):
        items = [(flag_name(name), value) for name, value in config.items() if value is not None]
    else:
        values = [(_flag_of(f), getattr(config, f.name), flag_default(f)) for f in flag_fields(config)]
        items = [(name, value) for name, value, default in values if value != default]
    argv: list[str] = []
    for name, value in items:
        if value is None:
            raise ValueError(f"{name}: None cannot be written as a flag (its default is not None)")
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, (tuple, list)):
            argv += [name, ",".join(map(str, value))]
        else:
            argv += [name, str(value)]
    return argv


# --- flags that more than one command declares ------------------------------------------------------------
def host_option(default: str = "127.0.0.1") -> Any:
    return option(default, "address to listen on (0.0.0.0 for all interfaces)")


def grpc_port_option(default: int) -> Any:
    """A model service's port."""
    return option(default, "gRPC port (0 = any free port, printed at start)")


def device_option() -> Any:
    return option(None, "torch device; default cuda when available, else cpu", type=str)


def dtype_option(draft: bool = False) -> Any:
    """A model service's weights and KV dtype (vLLM's --dtype and its names); `draft`: the draft service's."""
    cpu = (
        "float32 on a CPU, where the fused one-token step reads the weights in bfloat16 panels (AVX-512 or AVX2; a "
        "draft's numerics never change the output's distribution; float32 keeps the step in float32)"
        if draft
        else "float32 on a CPU (where bf16 measured no faster at serving shapes, even with AVX-512 BF16)"
    )
    return option(
        "auto",
        f"weights and KV cache dtype: auto = bfloat16 on CUDA, {cpu}; float32 (float), bfloat16, float16 (half). "
        "Greedy output is the target's token for token in float32; in 16 bits a verify and a one-token step may "
        "round near-ties apart (see the README)",
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"),
    )


# --kv-cache-dtype's names (vLLM's and SGLang's) -> the cache's element; auto: the model's dtype
KV_CACHE_DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def kv_cache_dtype_option() -> Any:
    """The verify service's KV element, vLLM's and SGLang's --kv-cache-dtype (the names both take)."""
    return option(
        "auto",
        "KV cache dtype: auto = the model's (--dtype); bfloat16 (bf16) keeps a float32 model's keys and values in "
        "bfloat16 (paged runner on a CPU): half the bytes a long context's attention reads and twice the tokens "
        "per --kv-cache-budget-mb. Logits then differ from a float32 cache's by bfloat16's rounding of K and V; "
        "greedy speculation still equals target-only decoding in the same cache dtype token for token",
        choices=tuple(KV_CACHE_DTYPES),
    )


def cuda_graph_max_bs_option() -> Any:
    """SGLang's --cuda-graph-max-bs for a model service's decode steps (specmesh.runtime.graphs)."""
    return option(
        32,
        "largest batch (sequences) whose decode step runs from a CUDA graph captured at start, padded to a token "
        "bucket; larger batches and prefill run eagerly (CUDA, paged runner; 0 = no graphs)",
    )


def disable_cuda_graph_option() -> Any:
    return option(False, "SGLang's: no CUDA graphs, every step launched eagerly (--cuda-graph-max-bs 0)")


def metrics_port_option(flag_default: int) -> Any:
    """A model service's metrics port: off for code that builds its config, `flag_default` on the command
    line (it differs per service, so that the services can share a host with their defaults)."""
    return option(-1, "Prometheus /metrics HTTP port (-1 = off, 0 = any)", flag_default=flag_default)


def attention_backend_option(backends: Sequence[str]) -> Any:
    """The SDPA kernels a model service's runtime may use (`backends`: specmesh.runtime.attention's names)."""
    return option(
        "auto",
        "attention kernels the runtime may use: auto = all SDPA kernels but cuDNN on CUDA (cuDNN builds a plan "
        "per new sequence length, which a decode meets every forward), on a CPU in float32 the paged runner's "
        "block-table C kernel for decode steps and verify blocks; default = torch's own SDPA choice everywhere; "
        "no-cudnn; math (reference, slow)",
        choices=backends,
    )


def kv_cache_prefault_option() -> Any:
    return option(
        True,
        "write the batched runner's whole KV pool at start, so the process's memory is resident from the start "
        "and stays flat under load (--no-kv-cache-prefault: pages are taken as slots first fill them)",
    )


@dataclass(frozen=True)
class Logging:
    """Every service's logging flags (`specmesh serve` passes its own on to each)."""

    log_level: str = option("INFO", "logging level")
    log_format: str = option("text", "json: one object per line with trace and request ids", choices=("text", "json"))


@dataclass(frozen=True)
class ServiceProcess(Logging):
    """The process flags of a model service (draft, verify): logging and torch threads."""

    threads: int = option(0, "torch CPU threads (0 = torch's default)")


@dataclass(frozen=True)
class GatewayListen:
    """Where the gateway listens: flags of `python -m gateway`, and of `specmesh serve`, which runs one."""

    host: str = host_option()
    port: int = option(8000, "REST port (OpenAI-compatible API, /health, /metrics)")
    grpc_port: int = option(50070, "gRPC port (specmesh.v1.GatewayService); -1 = off")


def parse_service_args(config_type: type[ConfigT], argv, **parser) -> tuple[ConfigT, dict]:
    """A model service's command line (draft, verify): its config from the config's flags, and the process
    flags (ServiceProcess, and TLS and keys: specmesh.security); `parser`: EnvArgumentParser's prog,
    description and env_prefix."""
    from specmesh.security import add_service_flags

    ap = EnvArgumentParser(**parser)
    add_config_flags(ap, config_type)
    with ap.process_flags():
        add_config_flags(ap, ServiceProcess)
    add_service_flags(ap)
    return parse_config(ap, config_type, argv)
