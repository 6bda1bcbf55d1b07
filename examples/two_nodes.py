"""Two serving nodes sharing KV through Mooncake Store: computed on node A, served on node B.

Starts a ``mooncake_master`` on 127.0.0.1 (unless ``--master``/``--metadata`` are given) and two
``examples/server.py`` processes (node A, node B) with the same model seed and the same master,
then:

1. node A serves a long prompt (a cold miss: every token computed) and ``POST /flush``es, so
   its pages are in Mooncake Store;
2. node B serves the same prompt: its cache ``prefetch``es the prefix from storage (pages node A
   put), loads it back to device and computes only the last page - and must generate exactly
   the tokens node A generated;
3. node B serves the prompt again: now a device hit.

Run: ``python examples/two_nodes.py`` (needs the ``mooncake`` and ``server`` extras).  Exit code
0 when node B's output equals node A's and node B's prefix came from storage.  The servers'
logs go to a temporary directory, removed on success and kept (its path printed) otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from aiocache_kv.testing.mooncake_master import LoopbackMaster, loopback_client_env

HERE = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def master(args: argparse.Namespace) -> AsyncIterator[tuple[str, str]]:
    """The master's RPC address and metadata URL (started here unless given)."""
    if args.master:
        yield args.master, args.metadata
        return
    m = LoopbackMaster()
    await asyncio.to_thread(m.start)
    try:
        yield m.rpc_addr, m.metadata_url
    finally:
        await asyncio.to_thread(m.terminate)


class Node:
    """One ``examples/server.py`` process."""

    def __init__(self, name: str, port: int, logdir: str) -> None:
        self.name = name
        self.port = port
        self.url = f"http://{LOOPBACK}:{port}"
        self.log_path = os.path.join(logdir, f"node-{name}.log")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, rpc: str, metadata: str, extra: Sequence[str]) -> None:
        """Spawn the server; its logs go to ``log_path``."""
        env = dict(os.environ)
        env.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        fd = await asyncio.to_thread(os.open, self.log_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HERE / "server.py"),
                "--host",
                LOOPBACK,
                "--port",
                str(self.port),
                "--storage",
                "mooncake",
                "--master",
                rpc,
                "--metadata",
                metadata,
                *extra,
                stdout=fd,
                stderr=fd,
                env=env,
            )
        finally:
            os.close(fd)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 120.0) -> None:
        """Poll ``/health`` until the server answers."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise RuntimeError(f"node {self.name} exited; see {self.log_path}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"node {self.name} not ready after {timeout}s; see {self.log_path}")

    async def post(self, session: aiohttp.ClientSession, path: str, body: Any) -> Any:
        """POST JSON, return the JSON reply (raises on an HTTP error)."""
        async with session.post(self.url + path, json=body) as r:
            reply = await r.json()
            if r.status != 200:
                raise RuntimeError(f"node {self.name} {path}: {r.status} {reply}")
            return reply

    async def stop(self) -> None:
        """SIGINT (graceful: the cache flushes and closes), SIGKILL after 20 s."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def row(name: str, what: str, reply: dict[str, Any]) -> str:
    c = reply["cached_tokens"]
    return (
        f"{name:<7} {what:<28} {reply['prompt_tokens']:>6} {c['device']:>6} {c['host']:>5} "
        f"{c['storage']:>7} {reply['computed_tokens']:>8} {reply['ttft_ms']:>9.1f}"
    )


async def run(args: argparse.Namespace) -> int:
    loopback_client_env()
    rng = random.Random(args.seed)
    prompt = [rng.randrange(50257) for _ in range(args.prompt_tokens)]
    extra = ["--model-seed", str(args.seed), "--layers", "4", "--hidden", "256"]
    logdir = await asyncio.to_thread(tempfile.mkdtemp, prefix="aiocache-kv-two-nodes-")
    code = 1
    try:
        code = await serve_and_compare(args, prompt, extra, logdir)
    finally:  # the server logs are kept only when something went wrong
        if code == 0:
            await asyncio.to_thread(shutil.rmtree, logdir, True)
        else:
            print(f"server logs kept in {logdir}", file=sys.stderr)
    return code


async def serve_and_compare(
    args: argparse.Namespace, prompt: list[int], extra: Sequence[str], logdir: str
) -> int:
    """Node A computes ``prompt``, node B serves it from storage; 0 when they agree."""
    async with master(args) as (rpc, metadata), aiohttp.ClientSession() as session:
        print(f"mooncake master {rpc} (metadata {metadata}); server logs in {logdir}")
        a = Node("A", free_port(), logdir)
        b = Node("B", free_port(), logdir)
        try:
            await asyncio.gather(a.start(rpc, metadata, extra), b.start(rpc, metadata, extra))
            await asyncio.gather(a.wait_ready(session), b.wait_ready(session))
            body = {"tokens": prompt, "max_new_tokens": args.new_tokens}
            ra = await a.post(session, "/generate", body)
            flushed = await a.post(session, "/flush", {})
            rb = await b.post(session, "/generate", body)
            rb2 = await b.post(session, "/generate", body)
        finally:
            await asyncio.gather(a.stop(), b.stop())
    header = (
        f"{'node':<7} {'request':<28} {'prompt':>6} {'device':>6} {'host':>5} {'storage':>7} "
        f"{'computed':>8} {'TTFT ms':>9}"
    )
    print(header)
    print("-" * len(header))
    print(row("A", "cold (computes everything)", ra))
    print(row("B", "same prompt, other node", rb))
    print(row("B", "same prompt again", rb2))
    print(f"node A backed up {flushed['backup_pages_ok']} pages to Mooncake Store")
    same = ra["tokens"] == rb["tokens"] == rb2["tokens"]
    from_storage = rb["cached_tokens"]["storage"] > 0
    print(f"node B prefix from storage: {'yes' if from_storage else 'NO'}")
    print(f"outputs identical on both nodes: {'yes' if same else 'NO'} ({ra['tokens'][:8]} ...)")
    return 0 if same and from_storage else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="KV computed on node A, served from storage on B")
    p.add_argument("--master", help="Mooncake master host:port (default: start one)")
    p.add_argument("--metadata", help="Mooncake metadata server URL")
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.master is None) != (args.metadata is None):
        p.error("--master and --metadata go together")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
