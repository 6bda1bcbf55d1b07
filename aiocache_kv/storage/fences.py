"""How long a drop's fences stand: until the drop is done with them and every removal it
handed to a storage worker has returned.

A drop fences what it removes (``StorageTier.fence``): backups of those namespaces are not
sent and prefetches of those pages commit nothing, so nothing lands under a removal.  A
caller that stops waiting (cancelled, or its own deadline) does not stop the worker: the
removal may still take keys a backup landed since.  So the fences go only once both the drop
and each worker it started are done (a worker that never returns keeps them: the store is
stuck, and a backup sent now would queue behind it anyway).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FenceHold"]


class FenceHold:
    """Counts the drop itself and the removals it handed to workers; ``lift`` runs once, on
    the loop, when the count reaches zero."""

    __slots__ = ("_lift", "_open", "_owner_done")

    def __init__(self, lift: Callable[[], None]) -> None:
        self._lift = lift
        self._open = 1  # the drop's own share
        self._owner_done = False

    @property
    def lifted(self) -> bool:
        """Whether ``lift`` has run."""
        return self._open == 0

    def worker(self) -> Callable[[], None]:
        """A share for one worker call: the returned callable (its ``on_release``) gives it
        back, once however often it is called."""
        assert not self.lifted, "a worker share taken after the fences went"
        self._open += 1
        given = False

        def release() -> None:
            nonlocal given
            if not given:
                given = True
                self._give()

        return release

    def done(self) -> None:
        """The drop is done with the fences (idempotent)."""
        if not self._owner_done:
            self._owner_done = True
            self._give()

    def _give(self) -> None:
        self._open -= 1
        assert self._open >= 0, "a fence share given back twice"
        if self._open == 0:
            self._lift()
