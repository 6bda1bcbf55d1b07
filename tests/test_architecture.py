"""The package's shape: no import cycles, no module over 600 lines, the runtime below its tools.

Imports are read from the source (``ast``), every ``aiocache_kv`` import counts wherever it
sits (module level or inside a function, under ``TYPE_CHECKING`` too), so a cycle that only
lazy imports hide still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aiocache_kv

PACKAGE = Path(aiocache_kv.__file__).parent
MAX_LINES = 600
#: users of the runtime: nothing in the runtime may import them
TOOLS = (
    "aiocache_kv.bench",
    "aiocache_kv.cli",
    "aiocache_kv.demo",
    "aiocache_kv.models",
    "aiocache_kv.serving",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """``aiocache_kv`` modules ``path`` imports (a package import names the package)."""
    name = module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("aiocache_kv")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if mod.startswith("aiocache_kv"):
                out.add(mod)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    g: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for mod in imports(path):
            while mod not in files and "." in mod:  # `from pkg.mod import name` -> pkg.mod
                mod = mod.rsplit(".", 1)[0]
            if mod in files and mod != name:
                deps.add(mod)
        g[name] = deps
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle among modules, ignoring edges into a package's ``__init__`` from inside it
    (a package re-exporting its own modules is not a cycle of concerns)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def inner(a: str, b: str) -> bool:
        return a.startswith(b + ".")

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if inner(n, m):
                continue
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (c := visit(m)) is not None:
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)) is not None:
            return c
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_over_600_lines() -> None:
    big = {
        module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_runtime_does_not_import_its_tools() -> None:
    g = graph()
    bad = {
        n: sorted(d for d in deps if d.startswith(TOOLS))
        for n, deps in g.items()
        if not n.startswith(TOOLS) and any(d.startswith(TOOLS) for d in deps)
    }
    bad.pop("aiocache_kv", None)  # the package root may re-export the adapter lazily
    assert not bad, f"runtime modules importing tools: {bad}"
