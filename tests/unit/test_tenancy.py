"""gateway.tenancy: the tenant of a request, and the session id and prefix-cache scope the gateway sends downstream."""

from gateway.tenancy import SHARED_TENANT, downstream_session_id, prefix_scope, tenant_of, tenant_of_key


def test_the_tenant_comes_from_the_checked_key_only():
    assert tenant_of("Bearer sk-a", keys_checked=False) == SHARED_TENANT  # no keys: one tenant for all
    assert tenant_of(None, keys_checked=True) == SHARED_TENANT
    a, b = tenant_of("Bearer sk-a", True), tenant_of("Bearer sk-b", True)
    assert a != b and a == tenant_of("Bearer  sk-a ", True) == tenant_of_key("sk-a")
    assert "sk-a" not in a  # a hash: the key itself goes nowhere
    assert tenant_of("Basic sk-a", True) == tenant_of("Bearer ", True) == SHARED_TENANT  # no key: refused anyway
    assert tenant_of(b"Bearer sk-a", True) == a  # gRPC metadata may be bytes


def test_downstream_session_ids_are_scoped_by_tenant_and_salt():
    a, b = tenant_of_key("sk-a"), tenant_of_key("sk-b")
    assert downstream_session_id(a, "", "") == ""  # no session named: a one-off session downstream
    ids = {
        downstream_session_id(a, "", "conv"),
        downstream_session_id(b, "", "conv"),
        downstream_session_id(a, "salt", "conv"),
        downstream_session_id(SHARED_TENANT, "", "conv"),
        # the parts are length-prefixed: moving a boundary changes the id
        downstream_session_id("", "ab", "c"),
        downstream_session_id("", "a", "bc"),
    }
    assert len(ids) == 6 and "conv" not in "".join(ids)
    assert downstream_session_id(a, "", "conv") == downstream_session_id(a, "", "conv")  # stable, across gateways
    assert all(len(i) <= 64 for i in ids)


def test_prefix_scopes_are_per_tenant_and_salt_and_never_name_the_tenant():
    a, b = tenant_of_key("sk-a"), tenant_of_key("sk-b")
    assert prefix_scope(SHARED_TENANT, "") == ""  # no keys, no salt: the one shared scope
    scopes = {
        prefix_scope(a, ""),
        prefix_scope(b, ""),
        prefix_scope(a, "salt"),
        prefix_scope(b, "salt"),
        prefix_scope(SHARED_TENANT, "salt"),
        # the parts are length-prefixed: moving a boundary changes the scope
        prefix_scope("ab", "c"),
        prefix_scope("a", "bc"),
    }
    assert len(scopes) == 7 and "" not in scopes
    assert not any(a in s or b in s or "salt" in s for s in scopes)  # opaque: no tenant or salt goes downstream
    assert prefix_scope(a, "salt") == prefix_scope(a, "salt")  # stable, across gateways
    # a scope is never a session id, not even one of the same tenant and salt
    assert prefix_scope(a, "salt") != downstream_session_id(a, "salt", "x")
    assert all(len(s) <= 64 and s.startswith("p-") for s in scopes)
