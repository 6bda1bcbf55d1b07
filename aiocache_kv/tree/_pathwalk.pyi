from typing import Any

from aiocache_kv.tree.node import Node

def bind(node_type: type[Node], absent: Any, filling: Any, resident: Any, /) -> None: ...
def prototype(node: Node, /) -> None: ...
def pin_path(node: Node, page_size: int, clock: int | None, /) -> tuple[int, int]: ...
def unpin_path(node: Node, page_size: int, /) -> tuple[int, int, list[Node] | None]: ...
def path_lens(node: Node, /) -> tuple[int, int]: ...
def descend(
    node: Node, page_size: int, tokens: list[Any], n: int, plan: bool, /
) -> tuple[Node, int, Node | None, int, list[Node] | None] | None: ...
def grow(
    root: Node,
    page_size: int,
    tokens: list[Any],
    n: int,
    skip: int,
    anchor: Node | None,
    pages: Any,
    clock: int,
    ns: Any,
    /,
) -> tuple[Node, int, int, int] | None: ...
def pin_match(
    root: Node, page_size: int, tokens: list[Any], n: int, clock: int, /
) -> tuple[Node, int, int, int] | None: ...
