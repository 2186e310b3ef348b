"""Who may call a specmesh service, and over what: keys, TLS and mTLS, and where a service may dial.

Every entry point goes through the one check here: the gateway's REST routes (`RequireKey`, ASGI), the
gateway's gRPC front and the internal draft and verify services (`AuthInterceptor`, grpc.aio). A caller
presents `authorization: Bearer <key>` (an HTTP header or gRPC metadata); the key is compared with every
accepted key in constant time (`hmac.compare_digest`), so timing tells nothing of how much of it matched.
Health stays open by default (load balancers and kubelets probe it without credentials); that, like
metrics, is the operator's explicit choice.

Keys are read from a file (one a line) or from the environment, never from the command line, where any
user of the machine can read them (`ps`, /proc/PID/cmdline).

TLS: one process has one certificate, key and CA bundle (`TLSConfig`). Its servers present the
certificate and, with `client_auth`, demand a client certificate signed by the CA (mTLS); when it dials
another service it verifies that service against the CA and presents the same certificate as its client
certificate. `bind` is the one way a gRPC server opens its port and `dial` the one way a service opens a
channel to another, so every hop is secured the same way.

`AllowList`: a service that dials an address a request names (the draft service's `verify_address`) only
dials what the operator configured, so no caller can make it connect anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hmac
import ipaddress
import logging
import os
import socket
import ssl
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmesh.errors import PermissionDenied

log = logging.getLogger("specmesh.security")

AUTH_HEADER = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MISSING_KEY = "invalid or missing API key (Authorization: Bearer <key>)"


# keys --------------------------------------------------------------------------------------------------
def read_key_file(path: str, flag: str) -> tuple[str, ...]:
    """The keys in `path`, one a line (blank lines and `#` comments skipped). `flag` names the flag that
    gave the path in errors."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read it ({e.strerror})") from None
    if mode & stat.S_IROTH:
        log.warning("%s %s is readable by every user of the machine; chmod 600 it", flag, path)
    keys = tuple(k for k in (ln.strip() for ln in lines) if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"{flag} {path!r} holds no key (one key a line)")
    return keys


def keys_from(file: str = "", env_value: str = "", flag: str = "--api-key-file") -> tuple[str, ...]:
    """Keys from a file (one a line) and from an environment variable's value (comma-separated), in that
    order, without duplicates."""
    keys = read_key_file(file, flag) if file else ()
    keys += tuple(k.strip() for k in env_value.split(",") if k.strip())
    return tuple(dict.fromkeys(keys))


class KeyRing:
    """The keys a server accepts. Empty: authentication is off."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in keys if k)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never the keys themselves (logs, tracebacks)
        return f"KeyRing({len(self._keys)} keys)"

    def accepts(self, presented: bytes | str | None) -> bool:
        """Whether `presented` is one of the keys: every key is compared, each in constant time."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok

    def accepts_authorization(self, value: bytes | str | None) -> bool:
        """Whether an `authorization` header / metadata value is `Bearer <one of the keys>`."""
        return self.accepts(bearer_token(value))


def bearer_token(value: bytes | str | None) -> str | None:
    """The key of an `authorization` value `Bearer <key>`, else None. The one parse of it: whoever derives
    something from the key a request was accepted with (its tenant) must read the same key from it."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value or not value.startswith("Bearer "):
        return None
    return value[7:].strip() or None


def _only(values: list) -> Any:
    """The one value of a header / metadata key sent once; None when it is missing or sent several times
    (which one would a later reader take?)."""
    return values[0] if len(values) == 1 else None


# TLS ---------------------------------------------------------------------------------------------------
def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read it ({e.strerror})") from None


@dataclass(frozen=True)
class TLSConfig:
    """A process's certificate, key and CA bundle (PEM files). Servers present the certificate; with
    `client_auth` they require a client certificate that the CA signed. Clients verify servers against the
    CA (the system roots without one) and present the certificate as their client certificate.
    `server_name`: the name a dialed server's certificate must carry, when it is not the host dialed (an
    address from DNS, such as a pod IP behind a headless Service). `flags`: the prefix of the flags that
    set it, for error messages."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    client_auth: bool = False
    server_name: str = ""
    flags: str = "--tls"
    cert_pem: bytes = field(default=b"", init=False, repr=False)
    key_pem: bytes = field(default=b"", init=False, repr=False)
    ca_pem: bytes | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        f = self.flags
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{f}-cert and {f}-key go together: give both or neither")
        if self.client_auth and not self.ca:
            raise ValueError(f"{f}-client-auth needs {f}-ca: the CA that signs the client certificates")
        if self.client_auth and not self.cert:
            raise ValueError(f"{f}-client-auth needs {f}-cert and {f}-key: only a TLS server can ask for a certificate")
        if self.cert:
            object.__setattr__(self, "cert_pem", _read(self.cert, f"{f}-cert"))
            object.__setattr__(self, "key_pem", _read(self.key, f"{f}-key"))
        if self.ca:
            object.__setattr__(self, "ca_pem", _read(self.ca, f"{f}-ca"))

    @property
    def serves(self) -> bool:
        """Servers speak TLS (they have a certificate)."""
        return bool(self.cert)

    @property
    def dials(self) -> bool:
        """Clients speak TLS (they have a CA to verify servers with, or a certificate to present)."""
        return bool(self.cert or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=self.client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem or None,
            certificate_chain=self.cert_pem or None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config keyword arguments that serve HTTPS (mTLS with `client_auth`)."""
        if not self.serves:
            return {}
        return dict(
            ssl_certfile=self.cert,
            ssl_keyfile=self.key,
            ssl_ca_certs=self.ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE,
        )

    @classmethod
    def from_flags(cls, args: dict, prefix: str = "tls", flags: str = "--tls") -> TLSConfig | None:
        """From parsed flags `<prefix>_cert`, `_key`, `_ca`, `_client_auth`, `_server_name`; None when none
        of the files is given."""
        cert, key, ca = (args.get(f"{prefix}_{k}") or "" for k in ("cert", "key", "ca"))
        client_auth = bool(args.get(f"{prefix}_client_auth"))
        if not (cert or key or ca or client_auth):
            return None
        return cls(cert, key, ca, client_auth, args.get(f"{prefix}_server_name") or "", flags)


# one process's security --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Security:
    """What a process's servers demand and what its clients present.

    `keys`: the keys callers must present (empty: none); `key`: the key this process presents when it
    dials (a service key); `open_health`: grpc.health.v1 answers without a key."""

    tls: TLSConfig | None = None
    keys: KeyRing = field(default_factory=KeyRing)
    key: str = field(default="", repr=False)
    open_health: bool = True

    def interceptor(self) -> grpc.aio.ServerInterceptor | None:
        return AuthInterceptor(self.keys, self.open_health) if self.keys else None

    @classmethod
    def from_flags(cls, args: dict) -> Security:
        """The security of a service from its parsed flags (`add_service_flags`): TLS, and service keys from
        --service-key-file or the environment (`SPECMESH_<SERVICE>_SERVICE_KEY`). The first key is the one
        it presents when it dials; it accepts all of them (several while a key is rotated)."""
        keys = keys_from(args.get("service_key_file") or "", args.get("service_key") or "", "--service-key-file")
        return cls(
            TLSConfig.from_flags(args),
            KeyRing(keys),
            keys[0] if keys else "",
            bool(args.get("open_health", True)),
        )


SERVICE_FLAGS: tuple[str, ...] = ("tls_cert", "tls_key", "tls_ca", "tls_client_auth", "tls_server_name")
SERVICE_FLAGS += ("service_key_file", "service_key", "open_health")


def add_tls_flags(ap, prefix: str, cert: str, ca: str) -> None:
    """`<prefix>-cert`, `-key` and `-ca` flags of an EnvArgumentParser (specmesh.config), PEM files:
    `cert` and `ca` say what the certificate and the CA bundle are for."""
    ap.flag(f"{prefix}-cert", default="", help=f"PEM certificate (chain): {cert}")
    ap.flag(f"{prefix}-key", default="", help=f"PEM private key of {prefix}-cert")
    ap.flag(f"{prefix}-ca", default="", help=f"PEM CA bundle: {ca}")


def add_service_flags(ap) -> None:
    """TLS, mTLS and service-key flags of an internal service (draft, verify); `ap.process_only` lists them,
    so they are kept out of the service's config (specmesh.config.parse_config)."""
    add_tls_flags(
        ap,
        "--tls",
        "this service's, served on its port (TLS) and presented as its client certificate when it dials another",
        "verifies the services it dials (else the system roots) and, with --tls-client-auth, its callers",
    )
    ap.flag(
        "--tls-client-auth", type=bool, default=False, help="require a client certificate signed by --tls-ca (mTLS)"
    )
    ap.flag(
        "--tls-server-name",
        default="",
        help="name the certificates of the services it dials must carry (default: the host dialed; set it when "
        "dialing addresses from DNS, such as pod IPs)",
    )
    ap.flag(
        "--service-key-file",
        default="",
        help="file of shared service keys, one a line: callers must present one (Authorization: Bearer); the "
        "first is presented when this service dials another",
    )
    ap.secret_flag("--service-key", file_flag="--service-key-file", help="service keys, comma-separated")
    ap.flag("--open-health", type=bool, default=True, help="grpc.health.v1 answers without a key (probes)")
    ap.process_only += SERVICE_FLAGS


# gRPC: servers -----------------------------------------------------------------------------------------
def bind(server: grpc.aio.Server, address: str, security: Security | None = None) -> int:
    """Open `address` (host:port) on `server`: TLS (mTLS with client_auth) when `security` has a certificate,
    plaintext otherwise. Returns the port bound (0 when it could not be)."""
    tls = security.tls if security is not None else None
    if tls is not None and tls.serves:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def _metadata_value(metadata, key: str) -> str | bytes | None:
    return _only([v for k, v in metadata or () if k == key])


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED (a streaming one is an async generator, as
    the interceptors around it iterate it)."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached

    ser = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **ser)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **ser)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC needs `authorization: Bearer <key>` metadata, but health checks when `open_health`.
    Reflection is protected too: it describes the API, as /openapi.json does."""

    def __init__(self, keys: KeyRing, open_health: bool = True):
        self.keys, self.open_health = keys, open_health

    async def intercept_service(self, continuation, details):
        if self.open_health and details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        if self.keys.accepts_authorization(_metadata_value(details.invocation_metadata, AUTH_HEADER)):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _denied(handler, MISSING_KEY)


# gRPC: clients -----------------------------------------------------------------------------------------
class _WithKey:
    """A multi-callable that adds the service key to every call's metadata (per call, not per message: a
    client interceptor would proxy each message of a stream through a queue)."""

    def __init__(self, inner, pair: tuple[str, str]):
        self.inner, self.pair = inner, pair

    def __call__(self, *args, metadata=None, **kw):
        return self.inner(*args, metadata=(*tuple(metadata or ()), self.pair), **kw)


class _KeyedChannel(grpc.aio.Channel):
    """A channel whose every call presents `Authorization: Bearer <key>`."""

    def __init__(self, channel: grpc.aio.Channel, key: str):
        self._channel, self._pair = channel, (AUTH_HEADER, f"Bearer {key}")

    def unary_unary(self, *a, **kw):
        return _WithKey(self._channel.unary_unary(*a, **kw), self._pair)

    def unary_stream(self, *a, **kw):
        return _WithKey(self._channel.unary_stream(*a, **kw), self._pair)

    def stream_unary(self, *a, **kw):
        return _WithKey(self._channel.stream_unary(*a, **kw), self._pair)

    def stream_stream(self, *a, **kw):
        return _WithKey(self._channel.stream_stream(*a, **kw), self._pair)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._channel.close()

    async def close(self, grace: float | None = None):
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False):
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state):
        return await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self):
        return await self._channel.channel_ready()


def dial(address: str, security: Security | None = None, options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """The one way a specmesh process opens a channel to another service: TLS when `security` has a CA or a
    certificate (the certificate doubles as the client certificate for mTLS), and `security.key` presented
    on every call."""
    opts = list(options)
    tls = security.tls if security is not None else None
    if tls is not None and tls.dials:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts + tls.channel_options())
    else:
        channel = grpc.aio.insecure_channel(address, options=opts)
    if security is not None and security.key:
        return _KeyedChannel(channel, security.key)
    return channel


# REST --------------------------------------------------------------------------------------------------
ASGIApp = Callable[..., Awaitable[None]]


class RequireKey:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <key>` except those to `open_paths`
    (health, metrics, by the operator's choice). `reject(message)` is the ASGI app that answers a refused
    request (the front's error shape); the default is a bare 401."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        open_paths: Iterable[str] = (),
        reject: Callable[[str], ASGIApp] | None = None,
    ):
        self.app, self.keys, self.open_paths = app, keys, frozenset(open_paths)
        self.reject = reject or _plain_401

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and self.keys and scope["path"] not in self.open_paths:
            auth = _only([v for k, v in scope.get("headers", ()) if k == AUTH_HEADER.encode()])
            if not self.keys.accepts_authorization(auth):
                return await self.reject(MISSING_KEY)(scope, receive, send)
        return await self.app(scope, receive, send)


def _plain_401(message: str) -> ASGIApp:
    async def app(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": message.encode()})

    return app


# where a service may dial ------------------------------------------------------------------------------
def split_address(address: str) -> tuple[str, str]:
    """(host, port) of `host:port` / `[v6]:port`; ValueError for anything else (a gRPC target scheme such
    as `unix:` or `dns:///` included)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{address!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{address!r} is not host:port")
        host = host[1:-1]
    elif ":" in host or "/" in host or "@" in host:
        raise ValueError(f"{address!r} is not host:port")
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{address!r}: the port must be 1-65535")
    return host.lower(), port


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass
class _Entry:
    host: str
    port: str  # "*" = any
    network: Any = None  # ip_network, for IP and CIDR entries
    pattern: bool = False  # shell-style (fnmatch) host pattern
    resolved: frozenset = frozenset()  # a DNS name's addresses
    resolved_at: float = -1e9


class AllowList:
    """The addresses a service may dial: comma-separated `host:port` entries. A host is an IP address, a CIDR
    block (`10.0.0.0/8`), a DNS name (matching the name and the addresses it resolves to, re-resolved when
    an address is not among them, at most once every `min_resolve_s`) or a shell-style pattern
    (`*.verify.svc.cluster.local`, matching names only); a port is a number or `*`. A name a request gives
    is never resolved here: it matches a name or a pattern, never an address, so what it resolves to at
    connect time cannot be steered past the list."""

    def __init__(
        self,
        entries: Iterable[str],
        configured: Iterable[str] = (),
        min_resolve_s: float = 1.0,
        flag: str = "--verify-allow",
    ):
        """`configured`: addresses the operator gave elsewhere (a default replica): allowed as written and,
        when they are host:port, as entries (a name's addresses included)."""
        self.flag = flag
        self.min_resolve_s = min_resolve_s
        self.exact = frozenset(a.strip() for a in configured if a.strip())
        self.entries = [self._entry(e) for e in entries if e.strip()]
        for a in self.exact:
            with contextlib.suppress(ValueError):  # a gRPC target URI (dns:///...) is matched as written only
                self.entries.append(self._entry(a))

    @classmethod
    def parse(cls, text: str, always: Iterable[str] = (), flag: str = "--verify-allow") -> AllowList:
        """Comma-separated entries, and the `always` allowed addresses."""
        return cls(text.split(","), always, flag=flag)

    def _entry(self, text: str) -> _Entry:
        text = text.strip()
        host, sep, port = text.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = (host[1:-1] if bracketed else host).lower()
        if not sep or not host or any(c.isspace() or c in "@[]" for c in host):
            raise ValueError(f"{self.flag}: {text!r} is not host:port")
        if ":" in host and not bracketed:
            raise ValueError(f"{self.flag}: {text!r}: write IPv6 addresses in brackets, [addr]:port")
        if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{self.flag}: {text!r}: the port must be 1-65535 or *")
        if "/" in host or _ip(host) is not None:
            try:
                return _Entry(host, port, network=ipaddress.ip_network(host, strict=False))
            except ValueError:
                raise ValueError(f"{self.flag}: {text!r} is not an IP address or CIDR block") from None
        return _Entry(host, port, pattern=any(c in host for c in "*?"))

    def __bool__(self) -> bool:
        return bool(self.entries or self.exact)

    def _match(self, host: str, port: str) -> tuple[bool, list[_Entry]]:
        """(matched, the DNS-name entries of this port whose addresses could match after a new resolution)."""
        ip = _ip(host)
        stale = []
        for e in self.entries:
            if e.port not in ("*", port):
                continue
            if e.network is not None:
                if ip is not None and ip in e.network:
                    return True, []
            elif e.pattern:
                if ip is None and fnmatch.fnmatchcase(host, e.host):
                    return True, []
            elif host == e.host or (ip is not None and ip in e.resolved):
                return True, []
            elif ip is not None:
                stale.append(e)
        return False, stale

    async def permits(self, address: str) -> bool:
        if address in self.exact:
            return True
        try:
            host, port = split_address(address)
        except ValueError:
            return False
        if port == "*":
            return False
        ok, names = self._match(host, port)
        now = time.monotonic()
        names = [e for e in names if now - e.resolved_at >= self.min_resolve_s]
        if ok or not names:
            return ok
        loop = asyncio.get_running_loop()
        for e in names:
            e.resolved_at = now
            e.resolved = await loop.run_in_executor(None, _resolve, e.host)
        return self._match(host, port)[0]

    async def check(self, address: str, what: str = "verify_address") -> None:
        """PermissionDenied unless `address` is on the list."""
        if not await self.permits(address):
            raise PermissionDenied(
                f"{what} {address!r} is not an address this service may dial: it dials only its configured "
                f"replicas and those {self.flag} allows"
            )


def _resolve(host: str) -> frozenset:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return frozenset()
    return frozenset(ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos)
