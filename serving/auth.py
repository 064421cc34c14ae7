"""Who is calling and which model they may use: bearer key -> tenant, request `model` -> what to run.

The key alone decides the tenant (a tenant never names itself or hands over a path or an adapter id).
The `model` field of a request then chooses among what that tenant may use:

- the base model's name (`model.name` in the config, "base" by default): no adapter;
- the tenant's own name: its newest published adapter version (the base model while none is published);
- `<tenant>@<n>`: version n of the tenant's own adapter.

A name that is another tenant's (or another tenant's version) and one that is no tenant nor the base get
the same 404, word for word: a key learns nothing of which other tenants exist. Whether version n exists
is for the adapter set to say (serving/adapters.py, also a 404). The errors are serving/errors.py's,
which know their HTTP status and OpenAI error shape.

Pure logic: no HTTP, no registry, no engine.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from serving.errors import ModelNotFound, Unauthenticated


@dataclass(frozen=True)
class ModelChoice:
    """What a request runs on: the base model (tenant still set: it is who asked) or the tenant's adapter.

    `version` is None for "the newest published" (or for the base model); an int for an explicit version.
    """

    tenant: str
    adapter: bool
    version: int | None = None


class Authenticator:
    """Bearer key -> tenant name, by the key's SHA-256: one lookup however many tenants (comparing the key with
    each in turn cost ~0.6 ms a request at 10,000), and what its time depends on is the digest, not the key."""

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        """`keys`: (tenant name, api key) pairs, e.g. from the config's tenants."""
        self._by_digest = {hashlib.sha256(key.encode()).digest(): name for name, key in keys}

    def replace(self, keys: Iterable[tuple[str, str]]) -> None:
        """The keys from now on (a config re-read): a key no longer listed is refused from the next request."""
        self._by_digest = {hashlib.sha256(key.encode()).digest(): name for name, key in keys}

    def tenant(self, authorization: str | None) -> str:
        """The tenant whose key is in an `Authorization: Bearer <key>` header value; `Unauthenticated` if none."""
        if not authorization:
            raise Unauthenticated("missing Authorization header: send 'Authorization: Bearer <tenant key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the Authorization header must be 'Bearer <tenant key>'")
        found = self._by_digest.get(hashlib.sha256(key.strip().encode()).digest())
        if found is None:
            raise Unauthenticated("unknown API key")
        return found


def is_admin(authorization: str | None, admin_key: str | None) -> bool:
    """Whether the header carries the admin key (always false when none is configured)."""
    if admin_key is None or not authorization:
        return False
    scheme, _, key = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), admin_key.encode())


def resolve_model(model: str, *, tenant: str, base_name: str) -> ModelChoice:
    """Maps a request's `model` to a `ModelChoice` for `tenant`, or raises ModelNotFound."""
    if model == base_name:
        return ModelChoice(tenant, adapter=False)
    name, at, version_text = model.partition("@")
    if name != tenant:  # no tenant, or another's: one answer for both
        raise ModelNotFound(f"model {model!r} does not exist or your key may not use it; use {base_name!r}, "
                            f"{tenant!r} or '{tenant}@<version>'")
    if not at:
        return ModelChoice(tenant, adapter=True)
    if not re.fullmatch(r"[1-9][0-9]{0,17}", version_text):  # ASCII digits ("²".isdigit() is true)
        raise ModelNotFound(f"model {model!r}: the version after '@' must be a positive integer")
    return ModelChoice(tenant, adapter=True, version=int(version_text))
