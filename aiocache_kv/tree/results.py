"""What the tree's operations return: an insert's plan and outcome, an eviction's spoils."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from aiocache_kv.tree.node import Node

__all__ = ["Eviction", "InsertOutcome", "InsertPlan"]


@dataclass(slots=True)
class InsertOutcome:
    """What :meth:`RadixTree.insert` did."""

    node: Node  #: last node of the inserted path (pinned if ``pin=True``)
    prefix_tokens: int  #: tokens that were already in the tree (any tier)
    inserted_tokens: int = 0  #: tokens the tree now holds for this insert (see ``insert``)
    created: list[Node] = field(default_factory=list)  #: new nodes, root-most first
    adopted: list[Node] = field(default_factory=list)  #: host-only nodes given the new pages


@dataclass(slots=True)
class InsertPlan:
    """The read-only walk of an insert (:meth:`RadixTree.plan_insert`)."""

    root: Node | None  #: the namespace's root (``None``: not created yet)
    steps: list[Node] = field(default_factory=list)  #: whole nodes passed, root-most first
    split: Node | None = None  #: the node the walk ends inside (split at ``common``)
    common: int = 0
    pos: int = 0  #: tokens the walk covered
    #: the device pages of the leading run, from the walk's ``skip`` page on
    existing: list[np.ndarray] = field(default_factory=list)
    existing_pages: int = 0  #: pages in the leading device run (``skip`` included)
    #: ``tokens[pos:n]``, made while the walk checked the tokens after it (the new leaf's
    #: key; ``None``: the walk had nothing to check, or nothing is left to insert)
    key: list[int] | None = None

    def device_pages(self) -> np.ndarray:
        """Device pages the tree holds for the leading part of the walk (after ``skip``):
        int64 ids, read-only (the nodes' own array when one node holds them all)."""
        parts = self.existing
        if not parts:
            return _NO_IDS
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class Eviction:
    """What an eviction freed: page ids and the nodes whose tier copy went away (device
    pages are int64 arrays, host pages tensors)."""

    pages: list[torch.Tensor | np.ndarray] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    num_pages: int = 0
    #: host copies dropped with a deleted device victim's host-only subtree
    host_pages: list[torch.Tensor] = field(default_factory=list)
    host_nodes: list[Node] = field(default_factory=list)
    #: device pages of victims handed to ``stage`` (write-back): freed when their copy lands
    staged_pages: int = 0
