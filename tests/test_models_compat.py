"""The model adapter names the KV-cache argument as the installed transformers expects."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from aiocache_kv.models.compat import cache_kwargs


class _Old:
    def forward(self, input_ids: object = None, past_key_values: object = None) -> None: ...


class _New:
    def forward(self, input_ids: object = None, cache: object = None) -> None: ...


def test_both_spellings() -> None:
    marker = object()
    assert cache_kwargs(_Old(), marker) == {"past_key_values": marker}
    assert cache_kwargs(_New(), marker) == {"cache": marker}


def test_the_installed_transformers_takes_it_without_a_warning() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)).eval()
    from transformers import DynamicCache

    kv = DynamicCache(config=model.config)
    kwargs = cache_kwargs(model, kv)
    assert set(kwargs) <= set(inspect.signature(model.forward).parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated name would warn here
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **kwargs)
    assert out.logits.shape == (1, 3, 50) and kv.get_seq_length() == 3
