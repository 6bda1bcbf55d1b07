"""Fixtures of the end-to-end tests: one small random-weight GPT-2 per session."""

from __future__ import annotations

import random
from typing import Any

import pytest

from aiocache_kv.models import GPT2Spec, build_gpt2

SPEC = GPT2Spec(n_layer=3, n_head=4, n_embd=64, vocab_size=4096, n_positions=512, seed=1)


@pytest.fixture(scope="session")
def gpt2() -> Any:
    """Built once, outside any event loop (construction is slow CPU work)."""
    return build_gpt2(SPEC)


def random_tokens(seed: int, n: int, vocab: int = SPEC.vocab_size) -> list[int]:
    """``n`` token ids drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
