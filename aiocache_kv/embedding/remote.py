"""The global-store side of the embedding cache that the generic ``StorageBackend`` lacks.

Entries have variable sizes, and a reader knows only the hash, while ``get_into`` needs a slot
of exactly the stored object's size.  :func:`mooncake_object_sizes` asks the master: one
``batch_is_exist`` (no error logs for missing keys) and one ``batch_get_replica_desc`` for the
present keys, whose memory descriptors carry the object size (measured: ~0.1-0.3 ms for 16-128
keys on loopback, vs ~0.07 ms *per key* for ``get_size``).  Both grant the object a read lease,
so it is not evicted between this call and the get that follows.

Blocking: run it through ``StorageIO.call``, never on the loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiocache_kv.errors import StorageError, StorageUnavailableError
from aiocache_kv.storage.mooncake import CODE_MISSING, MooncakeStorage

__all__ = ["mooncake_object_sizes"]


def mooncake_object_sizes(storage: MooncakeStorage, keys: Sequence[str]) -> list[int]:
    """Per key: the stored object's size in bytes, or a negative Mooncake code (-704 missing).

    Raises:
        StorageUnavailableError: the master answered with an error for every key.
        StorageError: the client raised.
    """
    if not keys:
        return []
    client = storage.raw_client
    keys = list(keys)
    try:
        exist = list(client.batch_is_exist(keys))
        if all(c < 0 for c in exist):
            raise StorageUnavailableError(
                f"mooncake batch_is_exist failed for all {len(keys)} keys (codes {exist[:4]})"
            )
        present = [k for k, c in zip(keys, exist, strict=True) if c == 1]
        sizes: dict[str, int] = {}
        if present:
            desc = client.batch_get_replica_desc(present)
            for key in present:
                for replica in desc.get(key, ()):
                    status = getattr(replica.status, "name", str(replica.status))
                    if replica.is_memory_replica() and status.endswith("COMPLETE"):
                        size = replica.get_memory_descriptor().buffer_descriptor.size
                        sizes[key] = int(size)
                        break
                else:  # a disk replica, or the object went away in between
                    sizes[key] = int(client.get_size(key))
    except StorageError:
        raise
    except Exception as exc:  # the binding raises on internal errors
        raise StorageError(f"mooncake size lookup raised {type(exc).__name__}: {exc}") from exc
    return [
        sizes.get(k, CODE_MISSING if c in (0, 1) else c) for k, c in zip(keys, exist, strict=True)
    ]
