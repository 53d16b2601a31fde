"""Who is calling: the tenant of a bearer key (BATCH_API_KEYS), every key compared in constant time."""

from __future__ import annotations

import hmac

from batch_pipeline.service.errors import ApiError


def tenant_of(keys: dict[str, str], authorization: str | None) -> str:
    """The tenant of `Authorization: Bearer <key>` among `keys` ({key: tenant}); 401 otherwise."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
    found = None
    for known, tenant in keys.items():  # every key compared, in constant time each
        if hmac.compare_digest(known.encode(), key.strip().encode()):
            found = tenant
    if found is None:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    return found
