"""Sidecar components of hybrid models: what each needs for a prefix to be reusable.

Beside the full-attention KV, a hybrid model keeps other state per page: sliding-window
attention (SWA) KV, Mamba/SSM recurrent state, DSA/NSA indexer keys.  Each is a
:class:`Component` with its own device and host buffers (one slot per KV page, indexed by the
same page ids, so one allocation serves every component), its own storage-key suffix after the
single namespace tag, and a hit policy:

* ``ALL_PAGES`` - every page of the prefix must be present (DSA indexer);
* ``TRAILING_PAGES`` - only the last ``window`` pages before the prefix end must be present
  (the SWA window; the Mamba state at the end of the prefix: one page).

The usable prefix of a match or a prefetch is the minimum over components.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import torch

from aiocache_kv.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,15}$")


class HitPolicy(enum.Enum):
    """Which pages of a prefix a component needs."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True)
class Component:
    """A sidecar pool: ``page_shape`` elements of ``dtype`` per KV page.

    ``window_tokens`` (TRAILING_PAGES only) is how many tokens before the prefix end must be
    present; it is rounded up to whole pages by :meth:`window_pages`.

    Raises:
        ConfigError: bad name, shape (a list is kept as a tuple), dtype, hit policy or window.
    """

    name: str
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    hit_policy: HitPolicy
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name == "kv":
            raise ConfigError(
                f"component name must match {_NAME.pattern} (not 'kv'): {self.name!r}"
            )
        shape = self.page_shape
        if (
            not isinstance(shape, (tuple, list))
            or not shape
            or any(type(d) is not int or d < 1 for d in shape)
        ):
            raise ConfigError(
                f"component {self.name}: page_shape must be a non-empty tuple of ints >= 1, "
                f"got {shape!r}"
            )
        object.__setattr__(self, "page_shape", tuple(shape))  # frozen: hashable, immutable
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"component {self.name}: dtype must be a torch.dtype")
        try:
            policy = HitPolicy(self.hit_policy)
        except ValueError:
            raise ConfigError(
                f"component {self.name}: hit_policy must be one of "
                f"{[p.value for p in HitPolicy]}, got {self.hit_policy!r}"
            ) from None
        object.__setattr__(self, "hit_policy", policy)
        if type(self.window_tokens) is not int or self.window_tokens < 0:
            raise ConfigError(
                f"component {self.name}: window_tokens must be an int >= 0, "
                f"got {self.window_tokens!r}"
            )
        if policy is HitPolicy.TRAILING_PAGES and (
            type(self.window_tokens) is not int or self.window_tokens < 1
        ):
            raise ConfigError(f"component {self.name}: a trailing window needs window_tokens >= 1")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page slot's payload."""
        return math.prod(self.page_shape) * torch.empty((), dtype=self.dtype).element_size()

    def window_pages(self, page_size: int) -> int:
        """Pages that must be present at the prefix end (all of them for ALL_PAGES: 0)."""
        if self.hit_policy is HitPolicy.ALL_PAGES:
            return 0
        return -(-self.window_tokens // page_size)


def SlidingWindow(
    window: int,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float16,
    name: str = "swa",
) -> Component:
    """Sliding-window attention KV: K and V of the SWA layers, only the last window needed."""
    return Component(
        name,
        (num_layers, 2, page_size, num_kv_heads, head_dim),
        dtype,
        HitPolicy.TRAILING_PAGES,
        window,
    )


def MambaState(
    state_shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    page_size: int,
    name: str = "mamba",
) -> Component:
    """Mamba/SSM recurrent state after each page; only the state at the prefix end is needed.

    Raises:
        ConfigError: ``state_shape`` not a non-empty tuple/list of ints >= 1, or as
            :class:`Component` does.
    """
    return Component(name, state_shape, dtype, HitPolicy.TRAILING_PAGES, page_size)


def Indexer(
    *,
    num_layers: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float16,
    name: str = "indexer",
) -> Component:
    """DSA/NSA indexer keys: one key per token per layer, every page needed."""
    return Component(name, (num_layers, page_size, head_dim), dtype, HitPolicy.ALL_PAGES)
