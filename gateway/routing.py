"""Replica pools: health, load, KV-cache affinity and DNS membership, for the verify and draft pools
(`gateway.router` combines their choices into each request's route).

- **Sessions** stick to the verify replica that holds their KV cache: consistent hashing on the session
  id (64 virtual nodes per replica), with a load bound (Mirrokni et al., "bounded-load consistent
  hashing"): walking the ring, a replica is skipped while its in-flight load exceeds
  ceil(load_factor · (total + 1) / healthy). Adding a replica moves only the sessions whose ring arc it
  takes (about 1/n of them).
- **Requests without a session** get a prefix-aware choice (as sgl-router's cache-aware policy): each
  replica remembers the chained hashes of 16-token prompt blocks it has seen (LRU); the replica with the
  longest match wins when the match covers > 30 % of the prompt and its load is within the bound;
  otherwise the least loaded replica.
- **Load** is in-flight calls, taken with `replica.track()` on every path and released on every exit
  (success, error, cancellation).
- **Health**: a background loop checks grpc.health.v1 on every replica; `fail_threshold` consecutive
  failures take it out of the pool, `success_threshold` successes bring it back. A call that fails with
  UNAVAILABLE triggers an immediate probe (`suspect`), so failover does not wait for the next round.
- **Membership**: a `host:port` entry whose host resolves to several addresses (a Kubernetes headless
  Service) becomes one replica per address; entries are re-resolved every health round, so pods that
  come and go are followed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import ipaddress
import logging
import math
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.security import Security, dial

log = logging.getLogger("specmesh.gateway.routing")
VNODES = 64
PREFIX_BLOCK = 16
PREFIX_MATCH_THRESHOLD = 0.3


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_blocks(token_ids: list[int]) -> list[int]:
    """Chained hashes of the full 16-token blocks of a prompt: block i's hash covers blocks 0..i."""
    out, h = [], 0
    for i in range(0, len(token_ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        h = _h(f"{h}:{token_ids[i : i + PREFIX_BLOCK]}")
        out.append(h)
    return out


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel | None = None
    healthy: bool = True
    inflight: int = 0
    fails: int = 0
    successes: int = 0
    prefixes: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, LRU order
    # A draft replica's last report of its goodput guard (GenerationFinished.speculation_pays) for greedy and
    # for sampled requests (each report speaks for its generation's kind: the replica guards them apart):
    # None = not measured.
    speculation_pays: bool | None = None
    speculation_pays_sampled: bool | None = None
    # Per kind (sampled or not) while speculation loses: the probes sent since it last did not, and the
    # requests still to go direct before the next one (the router's `_goodput_route`).
    probes_losing: dict[bool, int] = field(default_factory=dict)
    probe_wait: dict[bool, int] = field(default_factory=dict)
    # What the replica said of itself (the pool's `describe`) since it last turned healthy; None = not asked.
    suffix_decoding: bool | None = None

    def pays(self, sampled: bool) -> bool | None:
        """The replica's last goodput report for requests of this kind."""
        return self.speculation_pays_sampled if sampled else self.speculation_pays

    def report(self, sampled: bool, pays: bool | None) -> None:
        if sampled:
            self.speculation_pays_sampled = pays
        else:
            self.speculation_pays = pays

    @contextlib.contextmanager
    def track(self):
        self.inflight += 1
        try:
            yield self
        finally:
            self.inflight -= 1

    def remember(self, blocks: list[int], capacity: int = 4096) -> None:
        for b in blocks:
            self.prefixes[b] = None
            self.prefixes.move_to_end(b)
        while len(self.prefixes) > capacity:
            self.prefixes.popitem(last=False)

    def match(self, blocks: list[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.prefixes:
                break
            n += 1
        return n


class Pool:
    def __init__(
        self,
        name: str,
        entries: list[str],
        load_factor: float = 1.25,
        fail_threshold: int = 3,
        success_threshold: int = 2,
        health_timeout: float = 1.0,
    ):
        self.name = name
        self.entries = entries
        self.load_factor = load_factor
        self.fail_threshold = fail_threshold
        self.success_threshold = success_threshold
        self.health_timeout = health_timeout
        self.replicas: dict[str, Replica] = {}
        self._ring: list[tuple[int, str]] = []
        self.decisions: dict[str, int] = {}  # routing decisions by kind (for metrics and tests)
        self.security: Security | None = None  # TLS and service key of the channels to the replicas
        # Asks a replica that answered its health check what it is, until that succeeds once (a new process
        # after it was out of the pool is asked again).
        self.describe: Callable[[Replica], Awaitable[None]] | None = None
        self._set_members(self._static_members())

    # membership ------------------------------------------------------------------------------------
    def _static_members(self) -> list[str]:
        return [e for e in self.entries if e]

    @staticmethod
    def _resolve(entry: str) -> list[str]:
        host, _, port = entry.rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
            return [entry]
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError):
            return []
        ips = {info[4][0] for info in infos}
        # typeshed also allows a sockaddr (int, bytes): an address of a family this Python was built without
        # (IPv6), which it could not dial. Every other one starts with its host's text.
        addrs = sorted(f"[{ip}]" if ":" in ip else ip for ip in ips if isinstance(ip, str))
        return [f"{a}:{port}" for a in addrs]

    async def refresh_membership(self) -> None:
        loop = asyncio.get_running_loop()
        members: list[str] = []
        for entry in self.entries:
            members += await loop.run_in_executor(None, self._resolve, entry)
        if members:  # a DNS hiccup must not empty the pool
            self._set_members(members)

    def _set_members(self, addresses: list[str]) -> None:
        addresses = list(dict.fromkeys(addresses))
        for a in addresses:
            if a not in self.replicas:
                self.replicas[a] = Replica(a)
        for a in list(self.replicas):
            if a not in addresses:
                r = self.replicas.pop(a)
                if r.channel is not None:  # channels exist only once the pool runs on an event loop
                    asyncio.get_running_loop().create_task(r.channel.close())
        self._ring = sorted((_h(f"{a}#{v}"), a) for a in self.replicas for v in range(VNODES))

    def add(self, address: str) -> None:
        """Add a static member (tests, admin)."""
        self.entries.append(address)
        self._set_members([*self.replicas, address])

    def channel(self, replica: Replica) -> grpc.aio.Channel:
        if replica.channel is None:
            replica.channel = dial(replica.address, self.security)
        return replica.channel

    # choice ----------------------------------------------------------------------------------------
    @property
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def _bound(self) -> int:
        healthy = self.healthy
        total = sum(r.inflight for r in healthy)
        return max(1, math.ceil(self.load_factor * (total + 1) / max(1, len(healthy))))

    def count(self, kind: str) -> None:
        """Count a routing decision of this kind (the gateway's metrics show them by pool)."""
        self.decisions[kind] = self.decisions.get(kind, 0) + 1

    def for_session(self, session_id: str, exclude: AbstractSet[str] = frozenset()) -> Replica | None:
        """Bounded-load consistent hashing: the first healthy replica clockwise whose load is in bound."""
        if not self._ring:
            return None
        bound = self._bound()
        start = bisect.bisect(self._ring, (_h(session_id), ""))
        seen = set()
        first_ok = None
        for i in range(len(self._ring)):
            addr = self._ring[(start + i) % len(self._ring)][1]
            if addr in seen:
                continue
            seen.add(addr)
            r = self.replicas[addr]
            if not r.healthy or addr in exclude:
                continue
            if first_ok is None:
                first_ok = r
            if r.inflight < bound:
                self.count("session_affinity" if r is first_ok else "session_overflow")
                return r
        if first_ok is not None:
            self.count("session_affinity")
        return first_ok

    def for_prompt(self, token_ids: list[int], exclude: AbstractSet[str] = frozenset()) -> Replica | None:
        """Prefix-aware choice for requests without a session."""
        candidates = [r for r in self.healthy if r.address not in exclude]
        if not candidates:
            return None
        blocks = prefix_blocks(token_ids)
        bound = self._bound()
        chosen = None
        if blocks:
            best = max(candidates, key=lambda r: (r.match(blocks), -r.inflight))
            if best.match(blocks) / len(blocks) > PREFIX_MATCH_THRESHOLD and best.inflight < bound:
                chosen = best
                self.count("prefix_match")
        if chosen is None:
            chosen = min(candidates, key=lambda r: (r.inflight, len(r.prefixes)))
            self.count("least_loaded")
        chosen.remember(blocks)
        return chosen

    def least_loaded(self, exclude: AbstractSet[str] = frozenset(), sampled: bool = False) -> Replica | None:
        """The healthy replica with the fewest requests in flight; a draft replica whose goodput guard
        reports that speculation loses for requests of this kind (`sampled` or greedy) comes last (the gateway
        sends most requests past it, so it carries little load, and on load alone it would be chosen every
        time)."""
        candidates = [r for r in self.healthy if r.address not in exclude]
        return min(candidates, key=lambda r: (r.pays(sampled) is False, r.inflight)) if candidates else None

    # health ----------------------------------------------------------------------------------------
    async def probe(self, replica: Replica) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel(replica)).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout
            )
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        except (grpc.aio.AioRpcError, TimeoutError):
            ok = False
        self._record(replica, ok)
        if ok and self.describe is not None and replica.suffix_decoding is None:
            try:
                await self.describe(replica)
            except (grpc.aio.AioRpcError, TimeoutError) as e:  # asked again at the next check
                log.warning("%s replica %s did not describe itself: %s", self.name, replica.address, e)
        return ok

    def _record(self, replica: Replica, ok: bool) -> None:
        if ok:
            replica.fails = 0
            replica.successes += 1
            if not replica.healthy and replica.successes >= self.success_threshold:
                replica.healthy = True
                replica.speculation_pays = replica.speculation_pays_sampled = None  # maybe a new process: unmeasured
                replica.probes_losing.clear()
                replica.probe_wait.clear()
                replica.suffix_decoding = None
                log.info("%s replica %s is healthy again", self.name, replica.address)
        else:
            replica.successes = 0
            replica.fails += 1
            if replica.healthy and replica.fails >= self.fail_threshold:
                replica.healthy = False
                log.warning("%s replica %s left the pool (%d failed checks)", self.name, replica.address, replica.fails)

    async def suspect(self, replica: Replica) -> bool:
        """A call to the replica failed: probe now; if the probe fails too, take it out at once. Whether the
        replica is still in the pool."""
        if not await self.probe(replica):
            if replica.healthy:
                log.warning("%s replica %s failed a call and a probe: out of the pool", self.name, replica.address)
            replica.healthy = False
            replica.successes = 0
        return replica.healthy

    def stalled(self, replica: Replica) -> None:
        """A stream through the replica made no progress: out of the pool now. A hung process may still
        accept connections, so only `success_threshold` health checks in a row bring it back."""
        if replica.healthy:
            log.warning("%s replica %s stalled a stream: out of the pool until it answers", self.name, replica.address)
        replica.healthy = False
        replica.successes = 0

    async def check_all(self) -> None:
        await self.refresh_membership()
        await asyncio.gather(*(self.probe(r) for r in list(self.replicas.values())))

    async def run_health_checks(self, interval: float) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # the checker must outlive any one bad round
                log.exception("health round failed")
            await asyncio.sleep(interval)

    async def close(self) -> None:
        for r in self.replicas.values():
            if r.channel is not None:
                await r.channel.close()
