"""``aiocache-kv bench fairness``: per-tenant quotas against a flooding tenant (issue #26).

Two tenants share one cache (CPU, small pools).  ``small`` keeps requesting a working set of
prompts that fits its share; ``flood`` sends new prompts (never reused) after each of them.
The suite prints ``small``'s hit rate (tokens found cached / tokens asked, after a warm-up
round) alone, under the flood without quotas, and under the flood with ``flood`` capped by a
:class:`~aiocache_kv.quotas.TenantQuota`; and ``flood``'s own hit rate (0: nothing reused).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.loop import run as run_loop
from aiocache_kv.quotas import TenantQuota

__all__ = ["FairnessOptions", "run"]


@dataclass(frozen=True)
class FairnessOptions:
    """Sizes of the fairness workload (pages are ``page_size`` tokens)."""

    device_pages: int = 256
    host_pages: int = 256
    page_size: int = 16
    working_set: int = 12  #: ``small``'s prompts
    prompt_pages: int = 8  #: pages per ``small`` prompt
    flood_pages: int = 16  #: pages per ``flood`` prompt
    flood_per_request: int = 3  #: ``flood`` prompts after each ``small`` request
    rounds: int = 6  #: passes over the working set (the first one warms up)
    seed: int = 0


async def _hit_rates(o: FairnessOptions, flood: bool, quota: bool) -> dict[str, float]:
    rng = random.Random(o.seed)
    share = o.device_pages - o.working_set * o.prompt_pages
    quotas = {"flood": TenantQuota(device_pages=share // 2, host_pages=share // 2)} if quota else {}
    cfg = CacheConfig(
        page_size=o.page_size,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        device_pages=o.device_pages,
        host_pages=o.host_pages,
        host_memory_reserve_bytes=0,
        tenant_quotas=quotas,
    )
    n = o.prompt_pages * o.page_size
    working = [[rng.randrange(1 << 30) for _ in range(n)] for _ in range(o.working_set)]
    hits = {"small": 0, "flood": 0}
    asked = {"small": 0, "flood": 0}
    async with HiCache(cfg) as cache:

        async def request(tokens: list[int], tenant: str, count: bool) -> None:
            m = cache.match_prefix(tokens, tenant=tenant)
            if count:
                hits[tenant] += m.matched_len
                asked[tenant] += len(tokens)
            cache.release(m)
            slots = cache.alloc(len(tokens))
            r = cache.insert(tokens, slots, tenant=tenant)
            if r.write_through is not None:
                await r.write_through
            cache.release(r)

        for rnd in range(o.rounds):
            order = list(working)
            rng.shuffle(order)
            for tokens in order:
                await request(tokens, "small", rnd > 0)
                for _ in range(o.flood_per_request if flood else 0):
                    fresh = [rng.randrange(1 << 30) for _ in range(o.flood_pages * o.page_size)]
                    await request(fresh, "flood", rnd > 0)
        cache.check_invariants()
        evicted = dict(cache.statistics().quota_evictions)
    return {
        "small_hit_rate": hits["small"] / max(asked["small"], 1),
        "flood_hit_rate": hits["flood"] / max(asked["flood"], 1),
        "quota_evicted_pages": float(sum(evicted.values())),
    }


def run(options: FairnessOptions) -> dict[str, Any]:
    """Run the three arms; print and return ``small``'s hit rate in each."""
    arms = {
        "alone": (False, False),
        "flood, no quota": (True, False),
        "flood, flood quota": (True, True),
    }
    out: dict[str, Any] = {}
    print(f"\nfairness: {options}")
    print(f"{'arm':<22} {'small hit rate':>15} {'flood hit rate':>15} {'quota evictions':>16}")
    for name, (flood, quota) in arms.items():
        res = run_loop(_hit_rates(options, flood, quota))
        out[name] = res
        print(
            f"{name:<22} {res['small_hit_rate']:>15.3f} {res['flood_hit_rate']:>15.3f} "
            f"{int(res['quota_evicted_pages']):>16}"
        )
    return out
