"""Errors of the embedding cache, subclasses of the one hierarchy in :mod:`aiocache_kv.errors`."""

from __future__ import annotations

from aiocache_kv.errors import InvalidInputError

__all__ = ["DuplicateHashError", "EmbeddingMismatchError"]


class EmbeddingMismatchError(InvalidInputError):
    """A tensor's shape or dtype differs from the entry already cached under its hash.

    Raised before anything is stored: the whole batch is refused.
    """


class DuplicateHashError(InvalidInputError):
    """The same hash appears twice in one ``insert_batch`` (which tensor would win?)."""
