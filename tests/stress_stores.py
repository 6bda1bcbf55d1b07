"""The stores the stress oracle runs over, with what it reads of them: the real
``FileStorage`` (random and stalled I/O, a few dozen pages of room, files damaged behind its
back) and the real ``MooncakeStorage`` logic on a chaotic in-memory client."""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from aiocache_kv.storage import FileStorage, PageBuffer, integrity, page_file
from aiocache_kv.storage.keys import parse_storage_key
from aiocache_kv.testing import ChaosMooncakeClient, FakeMooncakeStorage, MemoryStorage


class OracleFileStorage(FileStorage):
    """The real ``FileStorage`` with what the oracle reads: its contents (from disk), the keys
    it evicted (``dropped``: what it reported through ``take_evicted``) and the files damaged
    behind its back (``damaged``); every read and write is delayed at random (some beyond the
    storage deadline, so late completions and leases are exercised), and the capacity is a few
    dozen pages so that eviction runs all the time.

    With ``damage`` > 0, before a read or write another "process" damages a random page file
    with that probability: flips a byte of its sealed slot or of the key in its header,
    truncates it, deletes it, replaces it with a symlink to ``outside`` (a file beyond the
    directory that must never change), or *collides* it: another page's sealed slot is written
    under its key with a valid checksum and key binding, what a writer whose key collided would
    have stored (only the page identity in the trailer tells them apart).  The store learns of
    it only when it reads the page: that read must be a miss, never bytes served."""

    def __init__(
        self,
        path: Path,
        seed: int,
        capacity_bytes: int,
        max_delay: float,
        *,
        damage: float = 0.0,
        outside: Path | None = None,
    ) -> None:
        super().__init__(path, capacity_bytes=capacity_bytes)
        self.args = (path, seed, capacity_bytes)
        self.dropped: set[str] = set()
        self.corrupted: set[str] = set()  # (MemoryStorage's name; nothing is put here)
        #: keys whose files the test damaged (a later put may have stored them again)
        self.damaged: set[str] = set()
        self.damage = damage
        self.outside = outside
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def quiet(self) -> None:
        self.max_delay = 0.0
        self.damage = 0.0

    def reopened(self) -> OracleFileStorage:
        """A fresh instance on the same directory (a restarted node)."""
        again = OracleFileStorage(*self.args, max_delay=0.0, outside=self.outside)
        again.dropped = self.dropped
        again.damaged = self.damaged
        return again

    def _delay(self) -> None:
        with self._rng_lock:
            roll = self._rng.random()
            d = 0.3 if roll < 0.02 else self._rng.uniform(0, self.max_delay)
            hit = self._rng.random() < self.damage
        if hit:
            self._damage_one()
        if self.max_delay and d:
            time.sleep(d)

    def _damage_one(self) -> None:
        """Damage one page file at random, as another process on the host would."""
        files = sorted(self.root.rglob("*" + page_file.SUFFIX))
        with self._rng_lock:
            if not files:
                return
            path = self._rng.choice(files)
            kind = self._rng.choice(["flip", "key", "truncate", "unlink", "link", "collide"])
            at = self._rng.random()
            source = self._rng.choice(files)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return  # gone meanwhile, or a link already
        try:
            data = os.read(fd, os.fstat(fd).st_size)
            parsed = page_file_key(data, path.name)
            if parsed is None or len(data) <= parsed[1]:
                return
            key, start = parsed
            key_len = start - page_file.HEADER.size
            pos = start + int(at * (len(data) - start))
            if kind == "flip":  # one byte of the sealed slot (payload or trailer)
                os.pwrite(fd, bytes([data[pos] ^ 0x5A]), pos)
            elif kind == "key":  # the recorded key: another key, or bytes that are not UTF-8
                at_key = page_file.HEADER.size + int(at * key_len)
                os.pwrite(fd, bytes([data[at_key] ^ 0xC0]), at_key)
            elif kind == "truncate":
                os.ftruncate(fd, pos)
            elif kind == "collide":
                slot = collided_slot(source, key)
                if slot is None:
                    return
                os.pwrite(fd, data[:start] + slot, 0)
                os.ftruncate(fd, start + len(slot))
        except OSError:
            return
        finally:
            os.close(fd)
        if kind in ("unlink", "link"):
            try:
                os.unlink(path)
                if kind == "link" and self.outside is not None:
                    os.symlink(self.outside, path)
            except OSError:
                return
        self.damaged.add(key)

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self._delay()
        return super().put_chain(keys, buffers, parents, identities)

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self._delay()
        return super().get_into(keys, buffers, identities)

    def take_evicted(self) -> list[str]:
        keys = super().take_evicted()
        self.dropped.update(keys)
        return keys

    def contents(self) -> dict[str, bytes]:
        """Every page file's key and stored slot (payload and trailer), read from disk (the
        oracle's own reads, with ``os`` calls the blocking-call detector leaves alone)."""
        out: dict[str, bytes] = {}
        for path in self.root.rglob("*" + page_file.SUFFIX):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # evicted meanwhile, or a planted link
            try:
                data = os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            parsed = page_file_key(data, path.name)
            if parsed is not None:  # else a header damaged by the test
                out[parsed[0]] = data[parsed[1] :]
        return out


class OracleMooncakeStorage(FakeMooncakeStorage):
    """The real ``MooncakeStorage`` logic over a :class:`ChaosMooncakeClient` (delays, stalls,
    failed batches, objects damaged or removed behind the cache's back), with what the oracle
    reads: the store's objects, and the keys damaged (nothing is evicted)."""

    def __init__(self, chaos: ChaosMooncakeClient) -> None:
        super().__init__(chaos)
        self.chaos = chaos
        self.dropped: set[str] = set()
        self.corrupted: set[str] = set()

    @property
    def damaged(self) -> set[str]:
        return self.chaos.damaged

    def quiet(self) -> None:
        self.chaos.quiet()

    def reopened(self) -> OracleMooncakeStorage:
        """A fresh client on the same store (a restarted node)."""
        return OracleMooncakeStorage(self.chaos)

    def contents(self) -> dict[str, bytes]:
        with self.chaos.lock:
            return dict(self.chaos.objects)

    def drop(self, key: str) -> bool:
        """Evict ``key`` silently, as a Mooncake master does; ``True`` if it was there."""
        with self.chaos.lock:
            there = self.chaos.objects.pop(key, None) is not None
        if there:
            self.dropped.add(key)
        return there


Store = MemoryStorage | OracleFileStorage | OracleMooncakeStorage


def page_file_key(data: bytes, name: str) -> tuple[str, int] | None:
    """The key a page file's bytes record and where its slot starts; ``None`` unless the
    header is whole and names the file ``name``."""
    if len(data) < page_file.HEADER.size:
        return None
    _, key_len, _ = page_file.HEADER.unpack_from(data)
    start = page_file.HEADER.size + key_len
    try:
        key = data[page_file.HEADER.size : start].decode()
    except UnicodeDecodeError:
        return None
    if len(data) < start or page_file.file_name(key) + page_file.SUFFIX != name:
        return None
    return key, start


def collided_slot(source: Path, key: str) -> bytes | None:
    """``source``'s sealed slot as a writer whose key collided with ``key`` would have stored
    it: the same payload and page identity, the key binding and trailer crc of ``key``."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        data = os.read(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    parsed = page_file_key(data, source.name)
    if parsed is None or len(data) - parsed[1] <= integrity.FRAME_OVERHEAD:
        return None
    slot = data[parsed[1] :]
    n = len(slot) - integrity.FRAME_OVERHEAD
    trailer = bytearray(slot[n:])  # <4sHHQQQ32sII: identity at 32, key crc at 64, crc at 68
    trailer[64:68] = zlib.crc32(key.encode("utf-8", "surrogatepass")).to_bytes(4, "little")
    trailer[68:72] = zlib.crc32(trailer[:68]).to_bytes(4, "little")
    return slot[:n] + bytes(trailer)


def intact(key: str, slot: bytes, want: bytes) -> bool:
    """Whether a page file's slot (after its key) is ``want`` sealed under ``key`` for the
    page the key names (its identity is the hash in the key)."""
    if len(slot) <= integrity.FRAME_OVERHEAD or slot[: len(want)] != want:
        return False
    buf = PageBuffer.from_tensor(torch.frombuffer(bytearray(slot), dtype=torch.uint8))
    ident = parse_storage_key(key).page_hash
    return integrity.verify(buf, key, identity=ident) is integrity.Verdict.OK
