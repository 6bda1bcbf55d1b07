"""Component specs: every bad field is a ``ConfigError`` naming it, and a shape given as a
list is kept as a tuple (a frozen spec must stay hashable and unchanged by its caller)."""

from __future__ import annotations

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.components import HitPolicy
from aiocache_kv.errors import ConfigError


@pytest.mark.parametrize("policy", ["bogus", None, 3, HitPolicy])
def test_bad_hit_policy_is_a_config_error(policy: object) -> None:
    with pytest.raises(ConfigError, match="hit_policy"):
        akv.Component("x", (1,), torch.float32, policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [5, None, "ab", b"\x01", {1: 2}, (), [0], (2, -1), (True,)])
def test_bad_page_shape_is_a_config_error(shape: object) -> None:
    with pytest.raises(ConfigError, match="page_shape"):
        akv.Component("x", shape, torch.float32, HitPolicy.ALL_PAGES)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [5, None, "ab", ()])
def test_bad_mamba_state_shape_is_a_config_error(shape: object) -> None:
    with pytest.raises(ConfigError, match="page_shape"):
        akv.MambaState(shape, page_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("window", ["4", 2.0, -1, None])
def test_bad_window_tokens_is_a_config_error(window: object) -> None:
    with pytest.raises(ConfigError, match="window_tokens"):
        akv.Component("x", (1,), torch.float32, HitPolicy.ALL_PAGES, window)  # type: ignore[arg-type]


def test_list_page_shape_is_kept_as_a_tuple() -> None:
    shape = [2, 3]
    comp = akv.Component("x", shape, torch.float32, HitPolicy.ALL_PAGES)  # type: ignore[arg-type]
    shape.append(100)  # the caller's list changing later changes nothing
    assert comp.page_shape == (2, 3)
    assert comp.page_bytes == 2 * 3 * 4
    assert hash(comp) == hash(akv.Component("x", (2, 3), torch.float32, HitPolicy.ALL_PAGES))
    state = akv.MambaState([4, 5], page_size=2)  # type: ignore[arg-type]
    assert state.page_shape == (4, 5)
