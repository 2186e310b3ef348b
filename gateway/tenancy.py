"""Whose a request is (its tenant), and the session id and prefix-cache scope the gateway sends downstream for it.

The verify and draft services cache KV per session id, a later turn reuses the longest cached prefix, and
every response says how many prompt tokens were reused (`cached_tokens`). Were a client's session id sent
downstream as it is, any caller could name another caller's session and learn from `cached_tokens` how
much of a guessed prompt matches the cached one (a prefix oracle), or overwrite or block that
conversation. So the id sent downstream is a keyed hash of the tenant, the request's `cache_salt` and the
client's session id: callers with different API keys, or with different salts, never name the same
session, and nobody can name a session without its tenant's key.

The verify service also shares full prompt blocks between sessions by content hash (prefix caching), and
a hit shows in `cached_tokens` just as well: a caller could probe whether anyone's prompt starts with a
guess. So every request also carries a prefix-cache scope downstream, a keyed hash of the tenant and the
`cache_salt`, and blocks are shared only within one scope.

The tenant is derived from the caller's identity as the gateway's own authentication established it,
never from anything else a client sends. With no API keys configured every caller is one tenant (a
`cache_salt` still separates those that want it).
"""

from __future__ import annotations

import hashlib

from specmesh.security import bearer_token

SHARED_TENANT = ""  # every caller, when the gateway checks no API keys
_TENANT_KEY = b"specmesh-tenant-v1"
_SESSION_KEY = b"specmesh-session-v1"


def tenant_of_key(api_key: str | None) -> str:
    """The tenant of a caller authenticated by `api_key`: a hash of it, so the key itself is never kept,
    logged or sent downstream."""
    if not api_key:
        return SHARED_TENANT
    return hashlib.blake2b(api_key.encode("utf-8", "surrogatepass"), digest_size=16, key=_TENANT_KEY).hexdigest()


def tenant_of(authorization: str | bytes | None, keys_checked: bool) -> str:
    """The tenant of a request with this Authorization header, on a gateway that checks API keys or not.

    The one place a request's tenant comes from. With keys checked (the request got here, so its key was
    accepted), the caller's key names its tenant: a caller can only land in the tenant of a key it holds.
    With none, everyone is the shared tenant, whatever key a client happens to send."""
    # bearer_token is the parse the key check itself uses: the tenant is that of the key that was accepted.
    return tenant_of_key(bearer_token(authorization)) if keys_checked else SHARED_TENANT


def _keyed_hash(*parts: str) -> str:
    # Each part length-prefixed, so that no two different tuples hash the same input (nor do tuples of
    # different lengths: the shorter one's input ends where the longer one's goes on).
    h = hashlib.blake2b(digest_size=16, key=_SESSION_KEY)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def downstream_session_id(tenant: str, cache_salt: str, session_id: str) -> str:
    """The session id sent to the draft and verify services: "" (a one-off session) when the client named
    none, else a keyed hash of (tenant, cache_salt, session_id)."""
    if not session_id:
        return ""
    return "s-" + _keyed_hash(tenant, cache_salt, session_id)


def prefix_scope(tenant: str, cache_salt: str) -> str:
    """The prefix-cache scope sent to the verify service: requests share cached prompt blocks only within one
    scope. "" (the shared scope) for the shared tenant without a salt, else a keyed hash of (tenant,
    cache_salt): the tenant never goes downstream as it is, and without the key nobody can name another
    tenant's scope. Its own "p-" prefix keeps it apart from every session id."""
    if tenant == SHARED_TENANT and not cache_salt:
        return ""
    return "p-" + _keyed_hash(tenant, cache_salt)
