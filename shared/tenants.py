"""Tenants of the stored state: whose requests may reuse what another request stored, as vLLM's
`cache_salt` (a per-request salt in the block hashes).

A request's tenant is its `cache_salt` when it gives one, else the bearer token the server checks
(every caller holding that token is one tenant), else the shared tenant "". The tenant is in the
root of every chunk key (shared.chunks), single-flight key and whole-context store key on both
services, so one tenant's chunks are never found by another's requests: neither reused, nor seen
through reuse statistics or the time to the first layer. The salt and the token enter only as
SHA-256 digests, tagged so that a salt can never name a token's tenant. Knows nothing about gRPC.
"""

from __future__ import annotations

import hashlib

from shared.errors import InvalidArgument

MAX_SALT_BYTES = 256


def checked_salt(value: str, field: str = "cache_salt") -> str:
    """A request's cache salt, or InvalidArgument naming the field and the limit."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_SALT_BYTES:
        raise InvalidArgument(f"{field}: {size} bytes > limit {MAX_SALT_BYTES}")
    return value


def tenant(cache_salt: str, token: str) -> str:
    """The tenant of a request with `cache_salt` to a server whose bearer token is `token` ("" for
    none): the salt's, else the token's, else the shared tenant ""."""
    if cache_salt:
        return "salt:" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()
    return ""
