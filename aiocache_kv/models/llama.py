"""Small Llama-family models (Llama, Qwen2, Mistral) with seeded random weights.

Nothing is downloaded: the model is built from a ``LlamaConfig`` / ``Qwen2Config`` /
``MistralConfig`` under ``torch.manual_seed``, so two processes with the same
:class:`LlamaSpec` get bit-identical weights.  The defaults exercise what GPT-2 does not:
rotary position embeddings, grouped KV heads (``kv_heads < heads``) and a head size that is
not ``hidden / heads`` (``config.head_dim`` is set explicitly).

Every layer keeps its K/V in the cache's KV pool (:class:`~aiocache_kv.models.PagedKV`).
``sliding_window`` (Mistral, Qwen2) gives sliding-window layers; they are served from the full
pool too: the model's sliding mask hides the keys before the window, so the reply is the same
as with ``transformers``' own cache, but nothing is saved (a Gemma 3 style sidecar is
:mod:`aiocache_kv.models.hybrid`).  The default is ``None``: full attention everywhere
(``MistralConfig`` itself defaults to a 4096-token window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.errors import ConfigError

#: the ``arch`` values :func:`build_llama` builds (``config.model_type``)
LLAMA_ARCHS = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class LlamaSpec:
    """Size and seed of a random-weight Llama-family model (defaults: 4 layers, 4 query heads
    over 2 KV heads of width 32 in a hidden size of 96, a 1000-token vocabulary)."""

    arch: str = "llama"  #: ``"llama"``, ``"qwen2"`` or ``"mistral"``
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 96
    intermediate: int = 192
    vocab: int = 1000
    max_positions: int = 512
    #: Mistral / Qwen2 only: a sliding window on every layer (``None``: full attention)
    sliding_window: int | None = None
    seed: int = 0
    #: std of the random weights: large enough for varied greedy outputs
    initializer_range: float = 0.2
    attn_implementation: str = "sdpa"

    @property
    def name(self) -> str:
        """A namespace for the cache: changes whenever the weights would."""
        window = "" if self.sliding_window is None else f"-W{self.sliding_window}"
        return (
            f"{self.arch}-random-L{self.layers}-H{self.heads}x{self.kv_heads}x{self.head_dim}"
            f"-D{self.hidden}-I{self.intermediate}-V{self.vocab}-P{self.max_positions}{window}"
            f"-i{self.initializer_range}-s{self.seed}"
        )


def _check_spec(s: LlamaSpec) -> None:
    if s.arch not in LLAMA_ARCHS:
        raise ConfigError(f"arch must be one of {LLAMA_ARCHS}, got {s.arch!r}")
    sizes = {
        "layers": s.layers,
        "heads": s.heads,
        "kv_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden": s.hidden,
        "intermediate": s.intermediate,
        "vocab": s.vocab,
        "max_positions": s.max_positions,
    }
    for key, value in sizes.items():
        if type(value) is not int or value < 1:
            raise ConfigError(f"{key} must be a positive int, got {value!r}")
    if s.heads % s.kv_heads:
        raise ConfigError(f"heads {s.heads} must be a multiple of kv_heads {s.kv_heads}")
    if s.head_dim % 2:
        raise ConfigError(f"head_dim must be even (rotary embeddings), got {s.head_dim}")
    w = s.sliding_window
    if w is not None:
        if s.arch == "llama":
            raise ConfigError("sliding_window is for arch 'mistral' or 'qwen2', not 'llama'")
        if type(w) is not int or w < 1:
            raise ConfigError(f"sliding_window must be a positive int or None, got {w!r}")


def _config(s: LlamaSpec) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_positions,
        initializer_range=s.initializer_range,
        tie_word_embeddings=False,  # tied random embeddings make greedy decoding repeat
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if s.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if s.arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=s.sliding_window)
    from transformers import Qwen2Config

    if s.sliding_window is None:
        return Qwen2Config(**common, use_sliding_window=False)
    return Qwen2Config(
        **common, use_sliding_window=True, sliding_window=s.sliding_window, max_window_layers=0
    )


def build_llama(spec: LlamaSpec | None = None) -> Any:
    """A ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` in eval mode with
    weights drawn under ``torch.manual_seed``.

    Construction reads no files and opens no sockets, but it is CPU work: call it off the event
    loop (``await asyncio.to_thread(build_llama, spec)``) in a server.

    Raises:
        ConfigError: an unknown ``arch``, a size that is not a positive int, ``heads`` not a
            multiple of ``kv_heads``, an odd ``head_dim``, or a ``sliding_window`` for Llama.
    """
    s = spec if spec is not None else LlamaSpec()
    _check_spec(s)
    from transformers import AutoModelForCausalLM

    config = _config(s)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(s.seed)
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        model.set_attn_implementation(s.attn_implementation)
    finally:
        torch.random.set_rng_state(state)
    model.eval()
    model.requires_grad_(False)
    return model


__all__ = ["LLAMA_ARCHS", "LlamaSpec", "build_llama"]
