"""Namespaces: model, tenant salt and LoRA.  Different namespaces never share a page."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from aiocache_kv.errors import InvalidInputError

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV of identical tokens differ: the model, a tenant salt, a LoRA adapter."""

    model: str
    tenant: str = ""
    lora: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "tenant", "lora"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidInputError(f"namespace {name} must be a str, got {value!r}")
        if not self.model:
            raise InvalidInputError("namespace model must not be empty")

    @property
    def tag(self) -> str:
        """Storage-safe tag: readable model prefix plus a digest of every part.

        The tenant salt appears only inside the digest, so keys do not reveal it.
        """
        return _tag(self.model, self.tenant, self.lora)


@functools.lru_cache(maxsize=4096)
def _tag(model: str, tenant: str, lora: str) -> str:
    digest = hashlib.blake2b("\x1f".join((model, tenant, lora)).encode(), digest_size=8)
    readable = _SAFE.sub("_", model).lstrip("._-")[:40] or "ns"
    return f"{readable}-{digest.hexdigest()}"
