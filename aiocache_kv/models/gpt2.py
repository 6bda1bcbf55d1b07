"""A small GPT-2 with seeded random weights, and the cache shape that matches it.

Nothing is downloaded: the model is built from a ``GPT2Config`` under ``torch.manual_seed``,
so two processes with the same :class:`GPT2Spec` get bit-identical weights (which is what
lets a second node reuse KV that the first one stored).  ``KVShape``, ``kv_shape`` and
``cache_config_for`` are :mod:`aiocache_kv.models.arch`'s, kept here under their old names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.errors import ConfigError
from aiocache_kv.models.arch import KVShape, cache_config_for, kv_shape


@dataclass(frozen=True)
class GPT2Spec:
    """Size and seed of a random-weight GPT-2 (defaults: ~9M parameters, 4 layers)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 50257
    n_positions: int = 1024
    seed: int = 0
    #: std of the random weights; GPT-2's own 0.02 makes a random model repeat one token,
    #: 0.2 gives varied greedy outputs (a stronger identity check)
    initializer_range: float = 0.2
    attn_implementation: str = "sdpa"

    @property
    def head_dim(self) -> int:
        """Per-head width of K and V."""
        return self.n_embd // self.n_head

    @property
    def name(self) -> str:
        """A namespace for the cache: changes whenever the weights would."""
        return (
            f"gpt2-random-L{self.n_layer}-H{self.n_head}-D{self.n_embd}-V{self.vocab_size}"
            f"-P{self.n_positions}-i{self.initializer_range}-s{self.seed}"
        )


def build_gpt2(spec: GPT2Spec | None = None) -> Any:
    """A ``GPT2LMHeadModel`` in eval mode with weights drawn under ``torch.manual_seed``.

    Construction reads no files and opens no sockets, but it is slow-ish CPU work: call it
    off the event loop (``await asyncio.to_thread(build_gpt2, spec)``) in a server.

    Raises:
        ConfigError: ``n_embd`` is not a multiple of ``n_head``.
    """
    s = spec if spec is not None else GPT2Spec()
    if s.n_embd % s.n_head:
        raise ConfigError(f"n_embd {s.n_embd} must be a multiple of n_head {s.n_head}")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=s.n_layer,
        n_head=s.n_head,
        n_embd=s.n_embd,
        vocab_size=s.vocab_size,
        n_positions=s.n_positions,
        initializer_range=s.initializer_range,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=True,
        bos_token_id=s.vocab_size - 1,
        eos_token_id=s.vocab_size - 1,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(s.seed)
        model = GPT2LMHeadModel(config)
        model.set_attn_implementation(s.attn_implementation)
    finally:
        torch.random.set_rng_state(state)
    model.eval()  # type: ignore[no-untyped-call]
    model.requires_grad_(False)
    return model


__all__ = ["GPT2Spec", "KVShape", "build_gpt2", "cache_config_for", "kv_shape"]
