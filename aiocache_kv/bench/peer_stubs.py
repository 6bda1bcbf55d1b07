"""Import SGLang's ``mem_cache`` package out of an unpacked wheel, without SGLang.

``aiocache-kv bench tree --peer-sglang DIR`` measures SGLang's radix caches beside ours in one
process.  SGLang is never a dependency: ``DIR`` is a wheel unzipped by hand
(``pip download --no-deps sglang==0.5.23``, ``unzip``), and only ``sglang.srt.mem_cache.*``,
its ``rust_extensions`` loader and ``sglang.srt.environ`` are executed from it.  Every other
``sglang`` module (``sglang/__init__.py`` included: it is never run) and the few third-party
packages ``mem_cache`` imports at module level but never calls on this path (``triton``,
``psutil``, where absent) are *stubs*: modules whose every attribute is a class that accepts
any call and attribute access, so that imports, decorators and type annotations resolve.

:func:`sglang_wheel` makes one wheel importable for the length of a ``with`` block, then
takes its modules out of ``sys.modules`` (and puts them back when it is entered again), so
two versions take turns in one process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: ``sglang`` packages executed from the wheel; everything else under ``sglang`` is a stub
REAL_PACKAGES = (
    "sglang.srt.mem_cache",
    "sglang.srt.rust_extensions",
    "sglang.srt.environ",
    "sglang.srt.utils.cpp_extension_loader",  # builds the native page hash (events on)
)
#: third-party modules ``mem_cache`` imports but the harness never calls (stubbed if absent)
THIRD_PARTY_STUBS = ("triton", "psutil")


class _StubMeta(type):
    """Class-level behaviour of stubs: any attribute is another stub class; calling a stub
    class with one callable returns that callable (a decorator), else an instance."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        one = len(args) == 1 and not kwargs and callable(args[0])
        if one and not isinstance(args[0], _StubMeta):
            return args[0]
        return type.__call__(cls, *args, **kwargs)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Stub(metaclass=_StubMeta):
    """An instance of a stub: falsy, empty, any attribute and call is another stub."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Stub()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())


def _stub_class(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class StubModule(types.ModuleType):
    """A module whose every missing attribute is a stub class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(name)
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        del module


class WheelFinder(importlib.abc.MetaPathFinder):
    """Serves ``sglang.*`` from ``root`` (an unpacked wheel): :data:`REAL_PACKAGES` as
    files, the rest as stubs; and the absent :data:`THIRD_PARTY_STUBS` as stubs."""

    def __init__(self, root: Path, third_party: tuple[str, ...]) -> None:
        self.root = root
        self.third_party = third_party
        self.loader = _StubLoader()

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = name.split(".")[0]
        if top in self.third_party:
            spec = importlib.machinery.ModuleSpec(name, self.loader, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if top != "sglang":
            return None
        if any(name == r or name.startswith(r + ".") for r in REAL_PACKAGES):
            return importlib.machinery.PathFinder.find_spec(name, path)
        folder = self.root.joinpath(*name.split("."))
        spec = importlib.machinery.ModuleSpec(name, self.loader, is_package=folder.is_dir())
        if folder.is_dir():
            spec.submodule_search_locations = [str(folder)]
        return spec


def _forget(prefixes: Sequence[str]) -> dict[str, types.ModuleType]:
    names = [m for m in sys.modules if m.split(".")[0] in prefixes]
    return {m: sys.modules.pop(m) for m in names}


@contextmanager
def sglang_wheel(root: Path) -> Iterator[Callable[[str], Any]]:
    """While the block runs, ``sglang`` is the wheel unpacked at ``root`` (stubs for the
    rest); yields ``get("module:attr")`` (``None`` for a name this version lacks).  On exit
    its modules leave ``sys.modules`` (kept for the next entry), so another version may be
    loaded next; objects made inside the block must not be used after it (a lazy import
    would find the other version).

    Raises:
        FileNotFoundError: ``root`` has no ``sglang/srt/mem_cache`` package.
    """
    if not (root / "sglang" / "srt" / "mem_cache").is_dir():
        raise FileNotFoundError(
            f"{root} is not an unpacked SGLang wheel (no sglang/srt/mem_cache): run "
            "`pip download --no-deps sglang==0.5.23` and unzip the wheel into it"
        )
    absent = tuple(m for m in THIRD_PARTY_STUBS if not _importable(m))
    finder = WheelFinder(root, absent)
    _forget(("sglang",))
    sys.modules.update(_STASH.get(root, {}))  # a wheel entered before: its modules again
    sys.meta_path.insert(0, finder)

    def get(spec: str) -> Any:
        mod, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            return None

    try:
        yield get
    finally:
        sys.meta_path.remove(finder)
        _STASH[root] = _forget(("sglang", *absent))  # a stub left would fool torch's checks


#: each wheel's modules while another is in ``sys.modules`` (an extension module such as the
#: Rust ``TreeCore`` cannot be initialized twice in one process)
_STASH: dict[Path, dict[str, types.ModuleType]] = {}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


__all__ = ["REAL_PACKAGES", "THIRD_PARTY_STUBS", "StubModule", "WheelFinder", "sglang_wheel"]
