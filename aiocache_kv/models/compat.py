"""What differs between the ``transformers`` 5.x releases the adapter supports.

transformers 5.24 renamed the forward argument that carries the KV cache from
``past_key_values`` to ``cache`` (the old name warns with a ``FutureWarning`` and goes in 5.40);
earlier 5.x releases know only ``past_key_values``.  :func:`cache_kwargs` names it the way the
model at hand expects.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_kwargs"]


@functools.lru_cache(maxsize=64)
def _cache_arg(model_type: Any) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` with the name ``model.forward`` takes its KV cache under."""
    model_type: Any = type(model)
    return {_cache_arg(model_type): cache}
