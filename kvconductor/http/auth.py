"""The ``--api-key`` check, one function for every port that changes state.

The V3 port's protected routes (:mod:`kvconductor.http.api`), the Mooncake dialect's
``/register``, ``/unregister`` and ``/services`` (:mod:`kvconductor.http.mooncake`) and
the refusals written from a request's head (:mod:`kvconductor.http.limits`) all ask
:func:`bearer_ok`: ``Authorization: Bearer <key>`` (the scheme in any case, the token
compared in constant time). A refusal is 401 with :data:`UNAUTHORIZED` as its ``error``
and :data:`CHALLENGE` as ``WWW-Authenticate`` (docs/security.md).
"""

from __future__ import annotations

import hmac

#: The ``error`` of a 401.
UNAUTHORIZED = "missing or invalid bearer token (Authorization: Bearer <api key>)"
#: The ``WWW-Authenticate`` value of a 401.
CHALLENGE = 'Bearer realm="kv-conductor"'


def bearer_ok(authorization: str | bytes | None, api_key: str | None) -> bool:
    """True when ``api_key`` is ``None`` (no key: open) or ``authorization`` (the
    request's ``Authorization`` header, ``None`` when absent) is ``Bearer <api_key>``."""
    if api_key is None:
        return True
    if not authorization:
        return False
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode("latin-1", "replace"), api_key.encode()
    )
