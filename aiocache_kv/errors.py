"""The one exception hierarchy of aiocache_kv.

Every error raised on purpose by the library derives from :class:`KVCacheError`.  Errors about
the caller's input also derive from :class:`ValueError` / :class:`TypeError` so that generic
handlers keep working.  Messages carry the offending values.  An operation that raises one of
the *input* errors below has changed nothing.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Root of every error raised by aiocache_kv."""


# -- caller input ---------------------------------------------------------------------------


class InvalidInputError(KVCacheError, ValueError):
    """An argument has the wrong value, shape, dtype, device or range.  Nothing was changed."""


class InvalidTypeError(KVCacheError, TypeError):
    """An argument has the wrong type (e.g. non-int tokens).  Nothing was changed."""


class ConfigError(InvalidInputError):
    """A :class:`~aiocache_kv.CacheConfig` (or component/storage option) is inconsistent."""


class HandleError(InvalidInputError):
    """A match/insert handle was released twice or belongs to another cache."""


class NotCachedError(InvalidInputError):
    """The operation needs cached pages and the tree holds none of the prefix in the tier it
    names (e.g. ``cache.pin`` of a prompt not resident there).  Nothing was changed."""


# -- lifecycle ------------------------------------------------------------------------------


class CacheClosedError(KVCacheError, RuntimeError):
    """The cache is not started or was closed; the call did nothing."""


class EngineClosedError(KVCacheError, RuntimeError):
    """The serving engine is not running, was closed, or aborted the request (its caller
    went away); nothing of the request is left in the engine."""


class OwnershipError(KVCacheError, RuntimeError):
    """Loop-owned state was touched from a thread that is not the owning event loop's."""


# -- concurrent changes ---------------------------------------------------------------------


class PrefixDroppedError(KVCacheError, RuntimeError):
    """``insert(..., prefix=h)`` leans on pages that left the tree after ``h`` was taken: a
    ``drop`` detached them, or a page the path waited for failed its verification (or its
    copy) at load-back.  Not the caller's mistake: its rows still hold valid KV, but the tokens
    cannot be inserted onto that prefix.  Release ``h`` and match again (recomputing what is
    gone); a serving engine restarts the request.  Nothing was changed: no page taken, no pin
    added, the slots stay the caller's.  ``tokens``: the tokens the insert skipped (leaning on
    ``h``); ``at``: the offset of the first of them that left; ``reason``: ``"dropped"``,
    ``"corrupt"`` or ``"load failed"``."""

    def __init__(self, message: str, *, tokens: int = 0, at: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.tokens = tokens
        self.at = at
        self.reason = reason


# -- capacity -------------------------------------------------------------------------------


class CapacityError(KVCacheError, RuntimeError):
    """A pool has too few free pages, even after evicting every evictable page."""


class PinLimitError(CapacityError):
    """A hard pin would take the pinned pages of a tier beyond ``max_pinned_fraction`` of its
    pool.  Nothing was pinned."""


class HostMemoryError(CapacityError):
    """Host memory admission failed at start-up (requested vs available minus reserve)."""


# -- data movement --------------------------------------------------------------------------


class TransferError(KVCacheError, RuntimeError):
    """A device<->host copy failed.  The affected pages were rolled back, not half-committed."""


class StorageError(KVCacheError, RuntimeError):
    """A storage-tier (L3) operation failed."""


class StorageUnavailableError(StorageError):
    """The storage backend is unreachable (e.g. the Mooncake master is down)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage-tier operation did not finish before its deadline."""


class MooncakeNotInstalledError(StorageUnavailableError, ImportError):
    """``mooncake.store`` cannot be imported.

    Install ``aiocache_kv[mooncake]`` (the CUDA build) on GPU machines and
    ``aiocache_kv[mooncake-cpu]`` elsewhere.
    """


class StorageKeyError(InvalidInputError):
    """A storage key is malformed (wrong type, empty, or too long)."""


class DropIncompleteError(StorageError):
    """``HiCache.drop`` removed the pages from device and host, but removing them from
    storage failed or timed out: some keys may remain there (call ``drop`` again).
    ``result`` is what the drop did."""

    result: object = None


# -- tensor parallelism, optional parts ------------------------------------------------------


class AgreementError(KVCacheError, RuntimeError):
    """A collective failed: the ranks can no longer agree (the group is broken)."""


class MissingDependencyError(KVCacheError, ImportError):
    """An optional dependency (an extra such as ``events``) is not installed."""


class BlockingCallError(KVCacheError, RuntimeError):
    """A blocking call was made on the event-loop thread (raised by the test-time detector)."""
