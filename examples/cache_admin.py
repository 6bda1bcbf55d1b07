"""Admin endpoints of ``examples/server.py``: pins with expiry and warm-up (#26).

* ``POST /cache/pin``   ``{"tokens": [...], "ttl": 60, "tier": "device"|"host", "tenant": ...}``
  -> ``{"pin_id", "tier", "pinned_len", "pages", "expires_in_s"}`` (409: over the pinned cap;
  404: nothing of the prompt resident in that tier)
* ``POST /cache/unpin`` ``{"pin_id": n}`` -> ``{"released": true}`` (``false``: it had
  expired; 404: no such pin)
* ``POST /cache/warm``  ``{"tokens": [...], "tier": "device"|"host", "timeout": 5, "tenant"}``
  -> the ``WarmResult`` (``device_len``, ``host_len``, ``storage_tokens``, ``timed_out``, ...)

Bodies are read like ``/generate``'s (bounded size, JSON only) and their token ids checked
like its (``validate_tokens``: ints in the model's vocabulary, no bools; else a 400 naming
the first bad one); the other numbers are checked by the cache itself (a typed error is a
400).  A ``pin_id`` that is missing or not an int is a 400.  The server binds 127.0.0.1 like the
rest: these are operator controls, not for the open network.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Protocol

from aiohttp import web
from server_requests import BadRequest, RequestLimits, read_json_body, validate_tokens

from aiocache_kv import CachePin, HiCache, PinState
from aiocache_kv.errors import KVCacheError, NotCachedError, PinLimitError

__all__ = ["CacheAdminRoutes"]

PIN_FIELDS = frozenset({"tokens", "ttl", "tier", "tenant"})
UNPIN_FIELDS = frozenset({"pin_id"})
WARM_FIELDS = frozenset({"tokens", "tier", "timeout", "tenant"})


class Served(Protocol):
    """What the routes need of the server."""

    cache: HiCache | None
    limits: RequestLimits


def _error(exc: BaseException) -> web.Response:
    if isinstance(exc, BadRequest):
        return web.json_response({"error": exc.message}, status=exc.status)
    if isinstance(exc, PinLimitError):
        status = 409
    elif isinstance(exc, NotCachedError):
        status = 404
    else:
        status = 400 if isinstance(exc, (ValueError, TypeError)) else 503
    return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=status)


def _fields(obj: object, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadRequest(400, "body must be a JSON object")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise BadRequest(400, f"unknown fields {unknown}; allowed {sorted(allowed)}")
    return obj


class CacheAdminRoutes:
    """The handlers of ``/cache/pin``, ``/cache/unpin`` and ``/cache/warm``."""

    def __init__(self, server: Served) -> None:
        self.server = server
        self.pins: dict[int, CachePin] = {}  #: the server's pins by id (ended ones pruned)
        self._ids = itertools.count(1)

    def add_to(self, app: web.Application) -> None:
        """Register the routes."""
        app.router.add_post("/cache/pin", self.pin)
        app.router.add_post("/cache/unpin", self.unpin)
        app.router.add_post("/cache/warm", self.warm)

    def _cache(self) -> HiCache:
        cache = self.server.cache
        if cache is None:
            raise BadRequest(503, "starting")
        return cache

    async def pin(self, request: web.Request) -> web.Response:
        """``POST /cache/pin``."""
        try:
            cache = self._cache()
            body = _fields(await read_json_body(request, self.server.limits), PIN_FIELDS)
            if "tokens" not in body or "ttl" not in body:
                raise BadRequest(400, "tokens and ttl are required")
            pin = cache.pin(
                validate_tokens(body["tokens"], self.server.limits),
                ttl=body["ttl"],
                tier=body.get("tier", "device"),
                tenant=body.get("tenant"),
            )
        except (BadRequest, KVCacheError) as exc:
            return _error(exc)
        self.pins = {k: p for k, p in self.pins.items() if p.state is PinState.ACTIVE}
        pin_id = next(self._ids)
        self.pins[pin_id] = pin
        left = pin.expires_at - asyncio.get_running_loop().time()
        return web.json_response(
            {
                "pin_id": pin_id,
                "tier": pin.tier.name.lower(),
                "pinned_len": pin.pinned_len,
                "pages": pin.pages,
                "expires_in_s": round(left, 3),
            }
        )

    async def unpin(self, request: web.Request) -> web.Response:
        """``POST /cache/unpin``."""
        try:
            cache = self._cache()
            body = _fields(await read_json_body(request, self.server.limits), UNPIN_FIELDS)
            pin_id = body.get("pin_id")
            if type(pin_id) is not int:  # bool is no pin id
                raise BadRequest(400, f"pin_id must be an int, got {pin_id!r:.40}")
            pin = self.pins.pop(pin_id, None)
            if pin is None:
                raise BadRequest(404, f"no pin {pin_id!r}")
            released = cache.unpin(pin)
        except (BadRequest, KVCacheError) as exc:
            return _error(exc)
        return web.json_response({"released": released})

    async def warm(self, request: web.Request) -> web.Response:
        """``POST /cache/warm``."""
        try:
            cache = self._cache()
            body = _fields(await read_json_body(request, self.server.limits), WARM_FIELDS)
            if "tokens" not in body:
                raise BadRequest(400, "tokens are required")
            res = await cache.warm(
                validate_tokens(body["tokens"], self.server.limits),
                tier=body.get("tier", "device"),
                timeout=body.get("timeout"),
                tenant=body.get("tenant"),
            )
        except (BadRequest, KVCacheError) as exc:
            return _error(exc)
        return web.json_response(
            {
                "tokens": res.tokens,
                "device_len": res.device_len,
                "host_len": res.host_len,
                "storage_tokens": res.storage_tokens,
                "timed_out": res.timed_out,
                "error": res.error,
            }
        )
