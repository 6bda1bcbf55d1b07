"""The C extensions against hostile arguments: an error, never a crash.

Each probe runs in a child process (a segfault there fails the test instead of killing the
run), with the C implementation required (the test fails if the extension did not build).
Found by an adversarial round:

* ``chain_hashes`` read the token list's item array while an item's ``__index__`` emptied
  the list (use after free); ``verify_many(sums=...)`` did the same to its sums list;
* ``insert_pages`` with a negative ``limit`` turned it into a huge unsigned bound (reads out
  of range);
* ``page_slots`` and the ``gather_sum`` / ``scatter_check`` / ``slot_sums`` bounds checks
  computed ``page * slot`` in wrapping arithmetic, so a huge page id or slot passed the
  check and the copy wrote or read gigabytes away from the buffer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

FASTCHECK = "import numpy as np\nfrom aiocache_kv import _fastcheck as F\n"
BLOCKSUM = "import numpy as np\nfrom aiocache_kv.storage import _blocksum as B\n"


def probe(code: str, header: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", header + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chain_hashes_survives_a_token_that_empties_the_list() -> None:
    run = probe(
        """
        from aiocache_kv.tree.hashing import HASH_IMPL, chain_hashes, py_chain_hashes
        from aiocache_kv.tree.hashing import namespace_seed
        assert HASH_IMPL == "c", HASH_IMPL
        toks = []
        class Evil:
            def __index__(self):
                toks.clear()
                junk = [object() for _ in range(1000)]  # reuse the freed item array
                return 1
        toks[:] = [Evil()] + [10**6 + i for i in range(4000)]
        want = py_chain_hashes(namespace_seed("x"), [1] + toks[1:], 16)
        got = chain_hashes(namespace_seed("x"), toks, 16)
        assert got == want, "hashes of another token list"
        print("ok", len(got))
        """
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "ok 251"


def test_verify_many_survives_sums_that_empty_themselves() -> None:
    run = probe(
        """
        from aiocache_kv.storage import integrity
        from aiocache_kv.storage.base import PageBuffer
        assert integrity.CHECKSUM_IMPL == "c", integrity.CHECKSUM_IMPL
        N = 64
        bufs = [PageBuffer.allocate(4096) for _ in range(N)]
        keys = [f"k{i}" for i in range(N)]
        integrity.seal_many(bufs, keys)
        sums = []
        class Evil:
            def __index__(self):
                sums.clear()
                junk = [(object(),) for _ in range(1000)]
                return 1
        sums[:] = [(Evil(), 2, 3)] + [(1, 2, 4024) for _ in range(N - 1)]
        verdicts = integrity.verify_many(bufs, keys, None, None, sums)
        assert verdicts[0] is integrity.Verdict.OK, verdicts[0]
        print("ok")
        """
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "ok"


CASES = [
    (
        "insert_pages negative limit",
        FASTCHECK,
        """
            slots = np.array([1 << 40], dtype=np.int64)
            out = np.empty(1, np.int64); ex = np.empty(0, np.int64)
            state = np.zeros(16, np.uint8); stamp = np.zeros(16, np.int64)
            F.insert_pages(slots, 1, -1, out, ex, state, 0, stamp, -5)
            """,
        "ValueError: limit must be >= 0",
    ),
    (
        "page_slots size overflow",
        FASTCHECK,
        """
            F.page_slots(np.array([0, 2, 1, 3], np.int64), 1 << 62, np.empty(0, np.int64))
            """,
        "ValueError: out must hold",
    ),
    (
        "gather_sum destination overflow",
        BLOCKSUM,
        """
            src = np.zeros(4096, np.uint8); dst = np.zeros(4096, np.uint8)
            B.gather_sum(src, 4096, 1, 0, np.array([0], np.int64), dst, 1 << 32,
                         np.array([(1 << 32) - 1], np.int64), None, 1)
            """,
        "IndexError: page pair 0",
    ),
    (
        "gather_sum table overflow",
        BLOCKSUM,
        """
            src = np.zeros(4096, np.uint8); dst = np.zeros(1 << 16, np.uint8)
            table = np.zeros(3, np.uint64)
            B.gather_sum(src, 16, 1, 0, np.array([0], np.int64), dst, 16,
                         np.array([384307168202282326], np.int64), table, 1)
            """,
        "IndexError: page pair 0",
    ),
    (
        "gather_sum segment overflow",
        BLOCKSUM,
        """
            src = np.zeros(4096, np.uint8); dst = np.zeros(4096, np.uint8)
            B.gather_sum(src, 1 << 62, 4, 0, np.array([0], np.int64), dst, 4096,
                         np.array([0], np.int64), None, 1)
            """,
        "ValueError: bad geometry",
    ),
    (
        "scatter_check source overflow",
        BLOCKSUM,
        """
            src = np.zeros(4096, np.uint8); dst = np.zeros(4096, np.uint8)
            B.scatter_check(src, 1 << 32, np.array([(1 << 32) - 1], np.int64), dst, 4096, 1,
                            0, np.array([0], np.int64), None, 1)
            """,
        "IndexError: page pair 0",
    ),
    (
        "slot_sums overflow",
        BLOCKSUM,
        """
            dst = np.zeros(4096, np.uint8); table = np.zeros(1 << 10, np.uint64)
            B.slot_sums(dst, 1 << 32, 16, np.array([(1 << 32) - 1], np.int64), table)
            """,
        "IndexError: page 4294967295 out of range",
    ),
]


def test_private_entry_points_refuse_out_of_range_arguments() -> None:
    """Every case in one child process (a crash fails them all; each case's outcome is
    printed on its own line otherwise)."""
    runner = """
        import json, sys, textwrap
        for name, header, code in json.loads(sys.argv[1]):
            try:
                exec(header + textwrap.dedent(code), {})
            except Exception as exc:
                print(f"{name}|{type(exc).__name__}: {exc}", flush=True)
            else:
                print(f"{name}|no error", flush=True)
        """
    cases = [(name, header, code) for name, header, code, _ in CASES]
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(runner), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-2000:]}"
    got = dict(line.split("|", 1) for line in run.stdout.splitlines())
    for name, _, _, error in CASES:
        assert error in got.get(name, "(no outcome)"), f"{name}: {got.get(name)}"
