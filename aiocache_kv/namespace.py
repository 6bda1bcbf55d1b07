"""Namespaces: model, tenant salt and LoRA.  Different namespaces never share a page."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field

from aiocache_kv.errors import InvalidInputError

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV of identical tokens differ: the model, a tenant salt, a LoRA adapter."""

    model: str
    tenant: str = ""
    lora: str = ""
    #: the hash of the parts, computed once: the tree looks namespaces up on every request
    _hash: int = field(init=False, repr=False, compare=False)
    #: storage-safe tag: a readable model prefix plus a digest of every part (the tenant
    #: salt appears only inside the digest, so keys do not reveal it); a field, computed
    #: once, as the hash: every match reads it
    tag: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "tenant", "lora"):
            value = getattr(self, name)
            if type(value) is not str:
                raise InvalidInputError(f"namespace {name} must be a str, got {value!r}")
        if not self.model:
            raise InvalidInputError("namespace model must not be empty")
        object.__setattr__(self, "_hash", hash((self.model, self.tenant, self.lora)))
        object.__setattr__(self, "tag", _tag(self.model, self.tenant, self.lora))

    def __hash__(self) -> int:
        return self._hash


@functools.lru_cache(maxsize=4096)
def namespace_of(model: str, tenant: str, lora: str) -> Namespace:
    """The (validated, shared) namespace of these parts; a bounded cache, so one-off tenant
    salts cost nothing once unused.

    Raises:
        InvalidInputError: a part is not a ``str`` or the model is empty.
    """
    return Namespace(model, tenant, lora)


def encode_parts(*parts: str) -> bytes:
    """An injective encoding of ``parts``: each part is length-prefixed, so no choice of
    characters inside a part can make two different tuples encode alike."""
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        out += len(raw).to_bytes(8, "little")
        out += raw
    return bytes(out)


@functools.lru_cache(maxsize=4096)
def _tag(model: str, tenant: str, lora: str) -> str:
    # 128 bits: finding two tenants' parts with one tag is out of reach, even on purpose
    digest = hashlib.blake2b(encode_parts(model, tenant, lora), digest_size=16)
    readable = _SAFE.sub("_", model).lstrip("._-")[:31] or "ns"
    return f"{readable}-{digest.hexdigest()}"
