"""``--state-url``: one source's replicated state, the same on every replica.

Every replica applies the log's entries of a source (``batch``, ``loss``, ``aged``,
``down``; :mod:`kvconductor.state.replica`); one of them, the lease holder, also consumes
the source's socket and appends those entries (through a
:class:`~kvconductor.ingest.host.SourceJournal`). :class:`ReplicaState` is what each
replica keeps of one source for that, and decides which entries count: no socket, no
clock, no log.

* ``fence``: the highest owner epoch any entry applied here had; an entry of an older
  epoch comes from a replica that lost the lease and is ignored (*fenced off*);
* ``applied``: the (seq, digest) of the last batch applied from the log; a batch at or
  below it is a duplicate (a take-over's replay repeats what the old owner appended), one
  past the next a *hole* (appends lost with the store: a loss on every replica);
* ``loss_token``: the loss whose grace period runs (its ``aged`` entry ends it);
* ``owned``, ``lease_epoch``: this replica holds the lease and consumes the source (one
  process, no ``--state-url``: it owns every source from the start);
* ``reported_down``: what the owner last appended of the source's readiness.
"""

from __future__ import annotations

#: Where a logged batch falls against the cursor (:meth:`ReplicaState.place`).
NEXT, DUPLICATE, HOLE = "next", "duplicate", "hole"


class ReplicaState:
    """The replicated state of one source (see the module docstring)."""

    __slots__ = ("applied", "fence", "loss_token", "owned", "lease_epoch", "reported_down")

    def __init__(self, fence: int = 0, *, owned: bool = False) -> None:
        self.applied: tuple[int, int] | None = None
        self.fence = fence
        self.loss_token: str | None = None
        self.owned = owned
        self.lease_epoch = 0
        self.reported_down: bool | None = None

    def current(self, epoch: int) -> bool:
        """An entry of owner epoch ``epoch`` arrived: False when it is fenced off,
        else True and the fence moves up to it."""
        if epoch < self.fence:
            return False
        self.fence = epoch
        return True

    def place(self, seq: int) -> str:
        """Where batch ``seq`` falls against the cursor: :data:`DUPLICATE` (at or below
        it), :data:`HOLE` (past the next one) or :data:`NEXT` (the next one, or no
        cursor)."""
        a = self.applied
        if a is None:
            return NEXT
        if seq <= a[0]:
            return DUPLICATE
        if seq > a[0] + 1:
            return HOLE
        return NEXT

    def lost(self, token: str) -> None:
        """A ``loss`` entry: the cursor is forgotten, loss ``token``'s grace period runs."""
        self.applied = None
        self.loss_token = token

    def down_changed(self, down: bool) -> bool:
        """The owner sees the source ``down`` (or not): True when that differs from what
        it last appended (and is now what it appended)."""
        if not self.owned or self.reported_down == down:
            return False
        self.reported_down = down
        return True
