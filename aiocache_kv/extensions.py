"""The optional C extensions, loaded where they were built.

``pip install -e .`` builds them where a C compiler is at hand (``setup.py``, ``optional=True``);
each module that has one keeps a Python path computing the same values and uses it where
:func:`optional_extension` finds nothing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["optional_extension"]


def optional_extension(name: str) -> ModuleType | None:
    """The extension module ``name`` (dotted), or ``None`` where it was not built."""
    try:
        return importlib.import_module(name)
    except ImportError:  # no compiler at install time, or a source tree never built
        return None
