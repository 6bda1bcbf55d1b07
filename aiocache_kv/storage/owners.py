"""One cache per storage backend object: a backend is claimed when a cache starts using it.

A backend object carries per-user state: ``FileStorage``'s index and its queue of evicted
keys (a second user's tier would take the first one's eviction notices, and the first would
keep claiming pages the store no longer has), ``MooncakeStorage.defer_checksum`` (set by a
``HiCache`` whose load-back verifies, it would make an ``EmbeddingCache``'s reads check
trailers only), and its ``close`` (the first user's close would close it under the other).
So a ``HiCache`` (its storage tier) and an ``EmbeddingCache`` claim their backend before they
open it, and a second user's start is refused with a ``ConfigError``: give each cache a
backend object of its own (two ``FileStorage`` on two directories, two Mooncake clients).

A backend built to be shared (a store every node reaches through the one object, whose
calls keep no per-user state: the test double ``MemoryStorage``) says so with a true
``multi_user`` attribute and is never claimed.

A claim ends when its owner closes the backend (:func:`release`), when its start gives up
(a retry, by a new cache too, may claim it), or when the owner is garbage-collected without
closing (the claim holds it weakly; the backend is let go then).  Claims are per process and
thread-safe (caches on different loops may start at once).
"""

from __future__ import annotations

import functools
import threading
import weakref

from aiocache_kv.errors import ConfigError

__all__ = ["claim", "release", "usable_by"]

#: reentrant: an owner collected while this thread holds the lock (a collection triggered
#: inside a claim) ends its claim from the weak reference's callback
_lock = threading.RLock()
#: id(backend) -> (backend, its owner, weakly): the backend is held so its id stays its own,
#: until the owner closes it or is collected (the reference's callback drops the entry)
_claims: dict[int, tuple[object, weakref.ref[object]]] = {}


def _collected(key: int, ref: weakref.ref[object]) -> None:
    """An owner was collected without closing: its claim (still the one ``ref`` made, not a
    later owner's) ends, and the backend is no longer held here (any thread)."""
    with _lock:
        held = _claims.get(key)
        if held is not None and held[1] is ref:
            del _claims[key]


def _owner_of(backend: object) -> object | None:
    held = _claims.get(id(backend))
    if held is None:
        return None
    owner = held[1]()
    if owner is None:  # collected without closing: the claim is void
        del _claims[id(backend)]
    return owner


def claim(backend: object, owner: object) -> None:
    """Record ``owner`` as the user of ``backend`` (again by the same owner: no change; a
    ``multi_user`` backend: nothing).

    Raises:
        ConfigError: another live owner holds ``backend`` (nothing changes).
    """
    if getattr(backend, "multi_user", False) is True:
        return
    with _lock:
        other = _owner_of(backend)
        if other is not None and other is not owner:
            raise ConfigError(
                f"storage backend {type(backend).__name__} at {id(backend):#x} is already used "
                f"by {type(other).__name__} at {id(other):#x}; each cache needs a backend "
                "object of its own (its index, eviction notices and close are per user)"
            )
        if other is owner:
            return
        key = id(backend)
        _claims[key] = (backend, weakref.ref(owner, functools.partial(_collected, key)))


def usable_by(backend: object, owner: object) -> bool:
    """Whether ``owner`` may close ``backend``: it holds the claim, or nobody does."""
    with _lock:
        return _owner_of(backend) in (None, owner)


def release(backend: object, owner: object) -> None:
    """End ``owner``'s claim on ``backend`` (none held, or another's: no change)."""
    with _lock:
        if _owner_of(backend) is owner:
            del _claims[id(backend)]
