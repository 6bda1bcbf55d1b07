"""``MooncakeStorage.remove_tag``: remove a namespace's pages from a Mooncake Store cluster.

The master removes every object whose key matches a regular expression
(``remove_by_regex``, force: read leases do not keep them), including objects other nodes
put, so a dropped tenant is gone for every node that reads the same store.  The tag's
characters are put in brackets rather than escaped with backslashes, which every regex
dialect (the master's ECMAScript ``std::regex`` included) reads alike.
"""

from __future__ import annotations

from typing import Any

from aiocache_kv.errors import StorageError
from aiocache_kv.logs import get_logger
from aiocache_kv.storage.keys import check_tag

log = get_logger(__name__)


def tag_regex(tag: str) -> str:
    """The regular expression of every key ``"{tag}/..."`` (``tag`` checked).

    Raises:
        StorageKeyError: ``tag`` is not a valid tag.
    """
    body = "".join(c if c.isalnum() or c == "_" else f"[{c}]" for c in check_tag(tag))
    return f"^{body}/.*$"


class MooncakeTags:
    """Mixin of :class:`~aiocache_kv.storage.mooncake.MooncakeStorage`: ``remove_tag``."""

    @property
    def raw_client(self) -> Any:  # MooncakeStorage's
        raise NotImplementedError

    def remove_tag(self, tag: str) -> int:
        """Remove every key ``"{tag}/..."`` from the store (any node's); how many.

        Raises:
            StorageKeyError: ``tag`` is not a valid tag.
            StorageError: the client has no ``remove_by_regex`` (mooncake too old), raised,
                or reported a failure code.
            StorageUnavailableError: closed.
        """
        pattern = tag_regex(tag)
        store = self.raw_client
        fn = getattr(store, "remove_by_regex", None)
        if fn is None:
            raise StorageError("this mooncake client has no remove_by_regex (upgrade mooncake)")
        try:
            n = int(fn(pattern, True))
        except Exception as exc:  # the binding raises on bad arguments / internal errors
            what = f"{type(exc).__name__}: {exc}"
            raise StorageError(f"mooncake remove_by_regex raised {what}") from exc
        if n < 0:
            raise StorageError(f"mooncake remove_by_regex failed with code {n} for {tag!r}")
        log.info("storage.mooncake.tag_removed", tag=tag, objects=n)
        return n


__all__ = ["MooncakeTags", "tag_regex"]
