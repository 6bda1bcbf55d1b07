"""``POST /generate`` bodies of ``examples/server.py``: read, decoded, parsed and validated.

Everything a client controls is bounded before the server acts on it: the body's size (413),
its content type and charset (415), its JSON (nesting depth, digit counts, no NaN) and its
fields (token ids in the vocabulary, ``max_new_tokens`` in range, the request within the
model's context and the device pool): anything else is a 400 with a message naming it.
The body must arrive within ``RequestLimits.read_timeout`` seconds of the headers (408
otherwise); a client that leaves mid-body ends the request quietly (:class:`ClientGone`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import NoReturn

from aiohttp import web

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.tree.retention import check_priority

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "GENERATE_FIELDS",
    "JSON_CHARSETS",
    "BadRequest",
    "ClientGone",
    "GenerateRequest",
    "RequestLimits",
    "parse_generate_request",
    "read_json_body",
    "validate_generate",
    "validate_tokens",
]

#: charsets a ``/generate`` body may declare (none: UTF-8, as RFC 8259 requires of JSON)
JSON_CHARSETS = {
    "utf-8": "utf-8",
    "utf8": "utf-8",
    "us-ascii": "ascii",
    "ascii": "ascii",
    "utf-16": "utf-16",
    "utf-16le": "utf-16-le",
    "utf-16be": "utf-16-be",
    "utf-32": "utf-32",
    "utf-32le": "utf-32-le",
    "utf-32be": "utf-32-be",
}
GENERATE_FIELDS = frozenset({"tokens", "max_new_tokens", "priority", "retention_seconds"})
DEFAULT_MAX_NEW_TOKENS = 16


class BadRequest(Exception):
    """A malformed request: the HTTP status it gets and a short message naming the problem."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(BadRequest):
    """The client closed the connection before its body arrived: nobody reads the reply
    (handlers count it as an ``error`` outcome, not a bad request)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection before sending its body")


@dataclass(frozen=True)
class GenerateRequest:
    """A validated ``POST /generate`` body."""

    tokens: list[int]
    max_new_tokens: int
    priority: int | None = None  #: retention priority of the request's pages, [0, 1000]
    retention: float | None = None  #: seconds until that priority lapses


@dataclass(frozen=True)
class RequestLimits:
    """What a ``/generate`` request may ask for."""

    vocab_size: int
    max_new_tokens: int  #: the server's bound on ``max_new_tokens``
    max_positions: int  #: prompt + reply, the model's context
    max_kv_slots: int  #: prompt + reply K/V rows the engine reserves: the device pool's size
    max_body_bytes: int
    #: seconds the body may take to arrive once the headers are in (None: no deadline)
    read_timeout: float | None = None


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> NoReturn:
    raise BadRequest(400, f"body is not valid JSON: {name} is not a JSON value")


async def parse_generate_request(request: web.Request, limits: RequestLimits) -> GenerateRequest:
    """Read, decode, parse and validate a ``/generate`` body.

    Raises:
        BadRequest: 413 body over ``limits.max_body_bytes``; 415 a content type other than
            JSON or a charset outside :data:`JSON_CHARSETS`; 400 anything else malformed
            (unreadable body, bad encoding, bad JSON, bad fields).
    """
    return validate_generate(await read_json_body(request, limits), limits)


async def read_json_body(request: web.Request, limits: RequestLimits) -> object:
    """Read, decode and parse a JSON body (bounded as the module doc says).

    Raises:
        BadRequest: 413, 415 or 400 as :func:`parse_generate_request` (not the fields); 408
            the body did not arrive within ``limits.read_timeout``.
        ClientGone: the client closed the connection mid-body.
    """
    media = request.content_type  # "application/octet-stream" when the header is absent
    if "Content-Type" in request.headers and not (
        media == "application/json" or media.endswith("+json")
    ):
        raise BadRequest(415, f"content type must be application/json, got {_short(media)}")
    declared = request.charset
    codec = JSON_CHARSETS.get((declared or "utf-8").strip().lower())
    if codec is None:
        raise BadRequest(415, f"unsupported charset {_short(declared)} (send utf-8)")
    limit = limits.max_body_bytes
    too_large = BadRequest(413, f"body exceeds {limit} bytes")
    if (request.content_length or 0) > limit:
        raise too_large
    try:
        body = await asyncio.wait_for(_read_body(request, limit), limits.read_timeout)
    except asyncio.TimeoutError:
        raise BadRequest(
            408, f"body not received within {limits.read_timeout:g} s of the headers"
        ) from None
    except web.RequestPayloadError as exc:  # e.g. a corrupt Content-Encoding
        reason = str(exc).strip().splitlines()[-1].strip()  # drop aiohttp's "400, message:"
        raise BadRequest(400, f"body could not be read: {reason}") from None
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        raise ClientGone() from None
    try:
        text = body.decode(codec)
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"body is not valid {codec}: {exc.reason}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "body is not valid JSON: nested too deep") from None
    except ValueError as exc:  # e.g. int()'s digit limit: "Exceeds the limit (4300 digits) ..."
        raise BadRequest(400, f"body is not valid JSON: {str(exc).split(':')[0]}") from None
    return obj


async def _read_body(request: web.Request, limit: int) -> bytearray:
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise BadRequest(413, f"body exceeds {limit} bytes")
    return body


def validate_tokens(tokens: object, limits: RequestLimits, name: str = "tokens") -> list[int]:
    """A non-empty list of token ids in the model's vocabulary (a ``bool`` is no token id),
    else :class:`BadRequest` (400) naming the first bad id."""
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest(400, f"{name} must be a non-empty list of token ids")
    vocab = limits.vocab_size
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t < vocab:  # bool is no int here
            raise BadRequest(
                400, f"{name} must be ints in [0, {vocab}), {name}[{i}] is {_short(t)}"
            )
    return tokens


def validate_generate(obj: object, limits: RequestLimits) -> GenerateRequest:
    """A parsed JSON body -> :class:`GenerateRequest` (raises :class:`BadRequest`, 400)."""
    if not isinstance(obj, dict):
        raise BadRequest(400, "body must be a JSON object")
    unknown = sorted(set(obj) - GENERATE_FIELDS)
    if unknown:
        known = ", ".join(sorted(GENERATE_FIELDS))
        raise BadRequest(400, f"unknown fields {_short(unknown)}; known: {known}")
    tokens = validate_tokens(obj.get("tokens"), limits)
    if len(tokens) >= limits.max_positions:
        raise BadRequest(
            400, f"tokens has {len(tokens)} ids; the model's context is {limits.max_positions}"
        )
    bound = limits.max_new_tokens
    max_new = obj.get("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, bound))
    if type(max_new) is not int or not 1 <= max_new <= bound:
        raise BadRequest(
            400, f"max_new_tokens must be an int in [1, {bound}], got {_short(max_new)}"
        )
    if len(tokens) + max_new > limits.max_positions:
        raise BadRequest(
            400,
            f"{len(tokens)} tokens + max_new_tokens {max_new} exceed the model's context of "
            f"{limits.max_positions}",
        )
    if len(tokens) + max_new > limits.max_kv_slots:
        raise BadRequest(
            400,
            f"{len(tokens)} tokens + max_new_tokens {max_new} need more KV slots than the "
            f"device pool holds ({limits.max_kv_slots})",
        )
    priority, retention = retention_fields(obj)
    return GenerateRequest(tokens, max_new, priority, retention)


def retention_fields(obj: dict[str, object]) -> tuple[int | None, float | None]:
    """The optional ``priority`` (int in [0, 1000]) and ``retention_seconds`` of a request
    body, checked as ``HiCache.insert`` checks them (raises :class:`BadRequest`, 400)."""
    priority = obj.get("priority")
    retention = obj.get("retention_seconds")
    try:
        check_priority(priority, retention)
    except (InvalidInputError, InvalidTypeError) as exc:
        raise BadRequest(400, str(exc).replace("retention", "retention_seconds")) from None
    return priority, retention  # type: ignore[return-value]  # checked just above
