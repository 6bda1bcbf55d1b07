"""MooncakeStorage against a real mooncake_master on 127.0.0.1, plus return-code mapping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from aiocache_kv.errors import ConfigError, InvalidInputError, StorageUnavailableError
from aiocache_kv.storage import FRAME_OVERHEAD, MooncakeStorage, PageBuffer, StorageIO, integrity
from aiocache_kv.storage.integrity import py_checksum
from aiocache_kv.storage.keys import parse_storage_key, storage_key
from aiocache_kv.storage.mooncake import MooncakeNotInstalledError, parse_size
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage

from .conftest import LOOPBACK, MasterProc

PAGE = 64 << 10
SLOT = PAGE + FRAME_OVERHEAD
#: pools registered with the session's client stay alive for the session: the client keeps
#: their ranges registered, and a later buffer allocated over a freed one's range would be
#: refused as overlapping (-600)
SESSION_REGISTERED: list[object] = []


class HostPool:
    """A tiny page-first host pool: one registered uint8 tensor, one slot per page."""

    def __init__(self, n: int, seed: int | None = None) -> None:
        if seed is None:
            self.tensor = torch.zeros(n * SLOT, dtype=torch.uint8)
        else:
            g = torch.Generator().manual_seed(seed)
            self.tensor = torch.randint(0, 256, (n * SLOT,), dtype=torch.uint8, generator=g)
        self.slots = [
            PageBuffer.from_tensor(self.tensor[i * SLOT : (i + 1) * SLOT]) for i in range(n)
        ]

    def payload(self, i: int) -> bytes:
        return bytes(self.slots[i].view[:PAGE])


def keys_for(tag: str, n: int) -> list[str]:
    return [storage_key(tag, (0xABC000 + i).to_bytes(32, "big")) for i in range(n)]


pytestmark = pytest.mark.mooncake


def test_round_trip_zero_copy(mc_storage: MooncakeStorage, tag: str) -> None:
    src, dst = HostPool(8, seed=1), HostPool(8)
    mc_storage.register_buffer(src.tensor)
    mc_storage.register_buffer(dst.tensor)
    mc_storage.register_buffer(src.tensor)  # idempotent
    SESSION_REGISTERED.extend((src, dst))
    before = mc_storage.statistics()
    keys = keys_for(tag, 8)
    assert mc_storage.put(keys, src.slots) == [True] * 8
    assert mc_storage.get_into(keys, dst.slots) == [True] * 8
    assert torch.equal(src.tensor, dst.tensor)  # payload and trailer bit-identical
    after = mc_storage.statistics()
    assert after.unregistered_buffers == before.unregistered_buffers  # all zero-copy
    assert after.bytes_written - before.bytes_written == 8 * SLOT
    assert after.hits - before.hits == 8
    assert mc_storage.exists([*keys, storage_key(tag, (1).to_bytes(32, "big"))]) == [True] * 8 + [
        False
    ]
    assert (
        mc_storage.leading_hits(
            [keys[0], keys[1], storage_key(tag, (1).to_bytes(32, "big")), keys[2]]
        )
        == 2
    )


def test_existing_keys_are_not_resent(mc_storage: MooncakeStorage, tag: str) -> None:
    keys = keys_for(tag, 4)
    first = HostPool(4, seed=2)
    assert mc_storage.put(keys[:2], first.slots[:2]) == [True, True]
    before = mc_storage.statistics()
    other = HostPool(4, seed=3)
    mc_storage.check_existing = True
    try:
        assert mc_storage.put(keys, other.slots) == [True] * 4
    finally:
        mc_storage.check_existing = False
    after = mc_storage.statistics()
    assert after.bytes_written - before.bytes_written == 2 * SLOT  # only the two new keys
    assert after.put_skipped - before.put_skipped == 2
    dst = HostPool(4)
    assert mc_storage.get_into(keys, dst.slots) == [True] * 4
    assert [dst.payload(i) for i in range(2)] == [first.payload(i) for i in range(2)]


def test_put_without_check_keeps_the_stored_value(mc_storage: MooncakeStorage, tag: str) -> None:
    """The default put sends no existence check: on a present key the real store answers 0 and
    keeps the old value (what makes skipping the check safe), and both verify."""
    keys = keys_for(tag, 4)
    first, other = HostPool(4, seed=12), HostPool(4, seed=13)
    assert mc_storage.put(keys[:2], first.slots[:2]) == [True, True]
    before = mc_storage.statistics()
    assert mc_storage.put(keys, other.slots) == [True] * 4
    after = mc_storage.statistics()
    assert (after.put_ok - before.put_ok, after.put_failed - before.put_failed) == (4, 0)
    dst = HostPool(4)
    assert mc_storage.get_into(keys, dst.slots) == [True] * 4  # every stored page verifies
    assert [dst.payload(i) for i in range(4)] == [
        first.payload(0),
        first.payload(1),
        other.payload(2),
        other.payload(3),
    ]


def test_missing_keys_are_misses(mc_storage: MooncakeStorage, tag: str) -> None:
    before = mc_storage.statistics()
    assert mc_storage.get_into(keys_for(tag, 3), HostPool(3).slots) == [False] * 3
    assert mc_storage.statistics().misses - before.misses == 3


def test_raw_keys_one_tag_and_no_cross_reads(mc_storage: MooncakeStorage, tag: str) -> None:
    raw = mc_storage.raw_client
    tag_a, tag_b = f"{tag}A", f"{tag}B"
    src = HostPool(3, seed=4)
    keys_a = keys_for(tag_a, 3)
    assert mc_storage.put(keys_a, src.slots) == [True] * 3
    for i, key in enumerate(keys_a):
        assert raw.is_exist(key) == 1
        assert parse_storage_key(key).tag == tag_a  # exactly one tag, no double prefix
        assert raw.is_exist(f"{tag_a}/{key}") == 0
        blob = raw.get(key)
        assert (
            len(blob) == SLOT and blob[:PAGE] == src.payload(i) and blob[PAGE : PAGE + 4] == b"AKVP"
        )
    keys_b = keys_for(tag_b, 3)  # same page hashes, other namespace
    assert [raw.is_exist(k) for k in keys_b] == [0, 0, 0]
    assert mc_storage.get_into(keys_b, HostPool(3).slots) == [False] * 3


def _raw_frame(mc_storage: MooncakeStorage, key: str) -> bytearray:
    return bytearray(mc_storage.raw_client.get(key))


def test_corrupted_values_are_misses(mc_storage: MooncakeStorage, tag: str) -> None:
    raw = mc_storage.raw_client
    keys = keys_for(tag, 5)
    src = HostPool(5, seed=5)
    assert mc_storage.put(keys, src.slots) == [True] * 5
    flipped = _raw_frame(mc_storage, keys[1])
    flipped[1234] ^= 0x01
    assert raw.upsert(keys[1], bytes(flipped)) == 0
    assert raw.upsert(keys[2], bytes(_raw_frame(mc_storage, keys[2])[:-9])) == 0  # truncated
    assert raw.upsert(keys[3], bytes(_raw_frame(mc_storage, keys[3])) + b"\0" * 64) == 0  # longer
    before = mc_storage.statistics()
    dst = HostPool(5)
    assert mc_storage.get_into(keys, dst.slots) == [True, False, False, False, True]
    after = mc_storage.statistics()
    assert after.corrupt - before.corrupt == 3
    assert after.hits - before.hits == 2 and after.misses == before.misses
    assert dst.payload(0) == src.payload(0) and dst.payload(4) == src.payload(4)
    # Corrupt objects are removed, so the next put stores good pages again.
    assert [raw.is_exist(k) for k in keys] == [1, 0, 0, 0, 1]
    assert mc_storage.put(keys, src.slots) == [True] * 5
    assert mc_storage.get_into(keys, dst.slots) == [True] * 5
    assert torch.equal(dst.tensor, src.tensor)


def test_other_process_reads_bit_identical_pages(
    mc_storage: MooncakeStorage, mooncake_master: MasterProc, tag: str
) -> None:
    keys = keys_for(tag, 4)
    src = HostPool(4, seed=6)
    assert mc_storage.put(keys, src.slots) == [True] * 4
    script = textwrap.dedent(
        f"""
        import hashlib, json, sys, torch
        from aiocache_kv.storage import MooncakeStorage, PageBuffer
        s = MooncakeStorage(master={mooncake_master.rpc_addr!r},
                            metadata_server={mooncake_master.metadata_url!r},
                            local_hostname={LOOPBACK!r}, global_segment_size=0,
                            local_buffer_size=16 << 20)
        pool = torch.zeros({4 * SLOT}, dtype=torch.uint8)
        s.register_buffer(pool)
        bufs = [PageBuffer.from_tensor(pool[i * {SLOT}:(i + 1) * {SLOT}]) for i in range(4)]
        ok = s.get_into({keys!r}, bufs)
        sha = hashlib.sha256(pool.numpy().tobytes()).hexdigest()
        print("RESULT " + json.dumps({{"ok": ok, "sha": sha}}))
        sys.stdout.flush()
        s.close()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    import hashlib

    assert result["ok"] == [True] * 4
    assert result["sha"] == hashlib.sha256(src.tensor.numpy().tobytes()).hexdigest()


async def test_through_storage_io(mc_storage: MooncakeStorage, tag: str) -> None:
    io = StorageIO(mc_storage, workers=2)  # not closed: the session owns the client
    src, dst = HostPool(4, seed=7), HostPool(4)
    keys = keys_for(tag, 4)
    assert await io.put(keys, src.slots, timeout=5) == [True] * 4
    assert await io.get_into(keys, dst.slots, timeout=5) == [True] * 4
    assert torch.equal(src.tensor, dst.tensor)
    assert await io.remove(keys[:1], timeout=5) == [True]
    assert await io.exists(keys, timeout=5) == [False, True, True, True]
    await io.drain()


# -- return-code mapping, with a scripted client (no master needed) --------------------------


def scripted_client(exist: list[list[int]], put: list[list[int]]) -> FakeMooncakeClient:
    """The shared fake, answering from queued code lists (only the code mapping is tested)."""
    return FakeMooncakeClient(exist_codes=exist, put_codes=put)


def scripted(client: FakeMooncakeClient) -> MooncakeStorage:
    s = FakeMooncakeStorage(client, no_space_retry_delay=0.0, check_existing=True)
    s.open()
    return s


def bufs(n: int) -> list[PageBuffer]:
    return [PageBuffer.allocate(64 + FRAME_OVERHEAD) for _ in range(n)]


def test_no_space_is_retried_once_then_per_key() -> None:
    client = scripted_client(exist=[[1, 0, 0, 0, 0]], put=[[0, -200, -200, -704], [0, -200]])
    s = scripted(client)
    keys = ["a", "b", "c", "d", "e"]
    assert s.put(keys, bufs(5)) == [True, True, True, False, False]
    assert client.put_calls == [["b", "c", "d", "e"], ["c", "d"]]
    st = s.statistics()
    assert (st.put_skipped, st.put_ok, st.put_failed, st.put_retries) == (1, 2, 2, 2)


def test_all_unavailable_raises_mixed_is_per_key() -> None:
    s = scripted(scripted_client(exist=[[-1, -1]], put=[]))
    with pytest.raises(StorageUnavailableError):
        s.put(["a", "b"], bufs(2))
    s = scripted(scripted_client(exist=[[0, 0]], put=[[-900, -900]]))
    with pytest.raises(StorageUnavailableError):
        s.put(["a", "b"], bufs(2))
    client = scripted_client(exist=[[0, 0, 0]], put=[[0, -901, 0]])
    client.get_codes = [[-900, -900]]
    s = scripted(client)
    assert s.put(["a", "b", "c"], bufs(3)) == [True, False, True]
    assert s.statistics().unavailable == 1
    with pytest.raises(StorageUnavailableError):
        s.get_into(["a", "b"], bufs(2))


def test_short_result_is_never_silently_truncated() -> None:
    s = scripted(scripted_client(exist=[[0, 0, 0]], put=[[0]]))
    assert s.put(["a", "b", "c"], bufs(3)) == [True, False, False]


def test_duplicate_keys_in_a_batch_are_sent_once() -> None:
    client = scripted_client(exist=[[0, 0, 0]], put=[[0, 0]])
    s = scripted(client)
    assert s.put(["a", "b", "a"], bufs(3)) == [True, True, True]
    assert client.put_calls == [["a", "b"]]


def test_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:5")
    monkeypatch.delenv("MOONCAKE_TE_META_DATA_SERVER", raising=False)
    monkeypatch.setenv("MOONCAKE_METADATA_SERVER", "http://m:1/metadata")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.2")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_DEVICE", "mlx5_0")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "512MB")
    s = MooncakeStorage()
    assert (s.master, s.metadata_server, s.local_hostname, s.protocol, s.device_name) == (
        "10.0.0.1:5",
        "http://m:1/metadata",
        "10.0.0.2",
        "rdma",
        "mlx5_0",
    )
    assert (s.global_segment_size, s.local_buffer_size) == (4 << 30, 512 << 20)
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://te:2/metadata")
    assert MooncakeStorage().metadata_server == "http://te:2/metadata"
    assert MooncakeStorage(master="h:1").master == "h:1"  # arguments win


@pytest.mark.parametrize("bad", ["lots", "-1", "4 parsecs", -3, True])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)  # type: ignore[arg-type]
    assert parse_size("16k") == 16 << 10 and parse_size("2GiB") == 2 << 30


def test_a_segment_mooncake_would_refuse_is_refused_up_front() -> None:
    """Below 16 MiB the client's ``setup`` fails with a bare -600 at ``open``; the config
    says why at construction instead (0, no segment at all, is fine)."""
    with pytest.raises(ConfigError, match="4194304"):
        MooncakeStorage(master="127.0.0.1:1", global_segment_size="4MiB")
    assert MooncakeStorage(master="127.0.0.1:1", global_segment_size=0).global_segment_size == 0
    assert MooncakeStorage(master="127.0.0.1:1", global_segment_size="16MiB")


def test_missing_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MooncakeNotInstalledError, match="pip install"):
        MooncakeStorage(master="127.0.0.1:1").open()


# -- the pipelined put: chunk k is sent while chunk k + 1 is sealed ----------------------------


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of two 64 KiB slots, so a handful of pages makes a pipeline."""
    from aiocache_kv.storage import mooncake

    monkeypatch.setattr(mooncake, "PIPELINE_BYTES", 2 * SLOT)
    return 2


def test_pipelined_put_chunks_skip_present_and_seal_everything(small_chunks: int) -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    src = HostPool(8, seed=5)
    keys = [storage_key("t", (0x100 + i).to_bytes(32, "big")) for i in range(7)]
    keys.insert(3, keys[1])  # a repeated key rides along with its first copy
    assert s.put([keys[2]], [src.slots[2]]) == [True]  # present before: not re-sent
    assert s.put(keys, src.slots) == [True] * 8
    sent = client.put_calls[1:]
    assert sent == [[keys[0], keys[1]], [keys[4]], [keys[5], keys[6]], [keys[7]]]
    st = s.statistics()
    assert (st.put_ok, st.put_skipped) == (1 + 6, 2)
    dst = HostPool(8)
    distinct = [k for i, k in enumerate(keys) if k not in keys[:i]]
    assert s.get_into(distinct, dst.slots[:7]) == [True] * 7  # every stored page verifies
    by_key = {k: i for i, k in reversed(list(enumerate(keys)))}
    for j, k in enumerate(distinct):
        assert dst.payload(j) == src.payload(by_key[k])


def test_presummed_pages_go_in_one_call_after_the_existence_check(small_chunks: int) -> None:
    """With ``check_existing`` (the cache's backups), pages whose copy took their checksum
    are one ``batch_put_from`` (the raw client's one call), not one call per chunk: their
    seal only writes trailers, so chunking overlaps nothing and costs master round trips.
    Pages without the sum are still chunked (sealed while the chunk before is sent)."""
    from aiocache_kv.storage.presum import covers

    client = FakeMooncakeClient()
    s = scripted(client)
    src = HostPool(7, seed=8)
    table = np.zeros((7, 3), dtype=np.uint64)
    slots = [PageBuffer.from_tensor(b.tensor, table[i]) for i, b in enumerate(src.slots)]
    for i in range(7):
        table[i] = (*py_checksum(src.slots[i].tensor[:PAGE]), PAGE)
    assert all(covers(b) for b in slots)
    keys = keys_for("presummed", 7)
    assert s.put([keys[2]], [slots[2]]) == [True]  # present before: not re-sent
    assert s.put(keys, slots) == [True] * 7
    assert client.put_calls[1:] == [[k for i, k in enumerate(keys) if i != 2]]
    dst = HostPool(7)
    assert s.get_into(keys, dst.slots) == [True] * 7  # sealed right: every page verifies
    assert [dst.payload(i) for i in range(7)] == [src.payload(i) for i in range(7)]
    # one page without its sum: chunked as before
    client.log.clear()
    table[4, 2] = 0
    more = keys_for("partly", 7)
    assert s.put(more, slots) == [True] * 7
    assert client.put_calls == [more[0:2], more[2:4], more[4:6], more[6:]]
    assert s.get_into(more, dst.slots) == [True] * 7


def test_pipelined_put_retries_no_space_from_every_chunk(small_chunks: int) -> None:
    client = scripted_client(
        exist=[[0] * 6], put=[[0, -200], [-200, 0], [-704, -200], [0, 0, -200]]
    )
    s = scripted(client)
    keys = [f"k{i}" for i in range(6)]
    out = s.put(keys, HostPool(6).slots)
    assert client.put_calls == [keys[0:2], keys[2:4], keys[4:6], ["k1", "k2", "k5"]]
    assert out == [True, True, True, True, False, False]
    st = s.statistics()
    assert (st.put_ok, st.put_failed, st.put_retries) == (4, 2, 3)


def test_pipelined_put_seals_the_next_chunk_while_one_is_in_flight(small_chunks: int) -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    src = HostPool(4, seed=6)
    keys = [storage_key("t", (0x200 + i).to_bytes(32, "big")) for i in range(4)]
    client.gates["batch_put_from"].clear()  # the first chunk's send hangs
    result: list[list[bool]] = []
    t = threading.Thread(target=lambda: result.append(s.put(keys, src.slots)))
    t.start()
    try:
        assert client.entered["batch_put_from"].wait(10), "the first chunk was never sent"
        # the second chunk is sealed while the first is still in flight
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            integrity.verify(src.slots[i], keys[i]) is integrity.Verdict.OK for i in (2, 3)
        ):
            time.sleep(0.005)
        for i in (2, 3):
            assert integrity.verify(src.slots[i], keys[i]) is integrity.Verdict.OK
        assert client.put_calls == [keys[:2]]
    finally:
        client.gates["batch_put_from"].set()
        t.join(10)
    assert result == [[True] * 4]
    assert client.put_calls == [keys[:2], keys[2:]]


def test_pipelined_put_round_trips_on_a_real_master(
    mc_storage: MooncakeStorage, tag: str, small_chunks: int
) -> None:
    src, dst = HostPool(9, seed=7), HostPool(9)
    for pool in (src, dst):
        mc_storage.register_buffer(pool.tensor)
    SESSION_REGISTERED.extend((src, dst))
    keys = keys_for(tag, 9)
    assert mc_storage.put(keys[:1], src.slots[:1]) == [True]
    before = mc_storage.statistics()
    assert mc_storage.put(keys, src.slots) == [True] * 9
    after = mc_storage.statistics()
    # no existence check: the present key is sent too, and the store answers 0 for it
    assert (after.put_ok - before.put_ok, after.put_skipped - before.put_skipped) == (9, 0)
    assert mc_storage.get_into(keys, dst.slots) == [True] * 9
    assert torch.equal(src.tensor, dst.tensor)


def test_pipelined_get_verifies_every_chunk_and_drops_the_corrupt(small_chunks: int) -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    src, dst = HostPool(5, seed=8), HostPool(5)
    keys = [storage_key("t", (0x300 + i).to_bytes(32, "big")) for i in range(5)]
    assert s.put(keys, src.slots) == [True] * 5
    raw = bytearray(client.objects[keys[3]])
    raw[7] ^= 0xFF  # one flipped payload byte in the second chunk
    client.objects[keys[3]] = bytes(raw)
    del client.objects[keys[1]]
    assert s.get_into(keys, dst.slots) == [True, False, True, False, True]
    gets = [k for name, k in client.log if name == "batch_get_into"]
    assert gets == [keys[0:2], keys[2:4], keys[4:5]]
    for i in (0, 2, 4):
        assert dst.payload(i) == src.payload(i)
    st = s.statistics()
    assert (st.hits, st.misses, st.corrupt) == (3, 1, 1)
    assert keys[3] not in client.objects  # removed so a later put can replace it


class _HeldCall:
    """Wraps one client call: its ``nth`` call waits for ``release`` (a read or send that is
    still using the buffers when the calling thread fails)."""

    def __init__(self, fn: object, nth: int) -> None:
        self.fn = fn
        self.nth = nth
        self.calls = 0
        self.release = threading.Event()
        self.entered = threading.Event()
        self.finished = threading.Event()

    def __call__(self, *args: object) -> object:
        self.calls += 1
        if self.calls == self.nth:
            self.entered.set()
            assert self.release.wait(10)
        try:
            return self.fn(*args)  # type: ignore[operator]
        finally:
            if self.calls >= self.nth:
                self.finished.set()


@pytest.mark.parametrize("call", ["batch_get_into", "batch_put_from"])
def test_a_failure_mid_pipeline_returns_only_after_the_helper_is_done(
    small_chunks: int, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    src = HostPool(4, seed=9)
    keys = [storage_key("t", (0x400 + i).to_bytes(32, "big")) for i in range(4)]
    if call == "batch_get_into":
        assert s.put(keys, src.slots) == [True] * 4
    # get: chunk 0 is read inline, chunk 1 on the helper; put: every chunk on the helper
    held = _HeldCall(getattr(client, call), 2 if call == "batch_get_into" else 1)
    monkeypatch.setattr(client, call, held)
    step = "verify_many" if call == "batch_get_into" else "seal_checked"
    real = getattr(integrity, step)
    seen = [0]

    def fail_on_the_overlapped_one(*args: object) -> object:
        seen[0] += 1
        # get: chunk 0 is verified while chunk 1 is read; put: chunk 1 is sealed while
        # chunk 0 is sent (the first seal overlaps the existence check)
        if seen[0] == (1 if call == "batch_get_into" else 2):
            assert held.entered.wait(10)
            raise InvalidInputError("injected")
        return real(*args)

    monkeypatch.setattr(integrity, step, fail_on_the_overlapped_one)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            if call == "batch_get_into":
                s.get_into(keys, HostPool(4).slots)
            else:
                s.put(keys, src.slots)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(0.3)
    assert held.entered.is_set() and not held.finished.is_set()
    assert t.is_alive(), "returned while a helper still used the buffers"
    held.release.set()
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and "injected" in str(errors[0])
    assert held.finished.is_set()
