"""Pure-Python twins of the compiled index core (reference models).

:class:`~kvconductor._py.tree.RadixTree`, :class:`~kvconductor._py.lower.LowerTier`
and :class:`~kvconductor._py.index.CoreIndex` implement exactly the semantics of
``docs/design.md`` with plain dicts and sets. They are a test oracle, not a
runtime fallback: the models the differential tests hold ``kvconductor._tree``,
``kvconductor._lower`` and ``kvconductor._index`` to (they use the compiled
``kvconductor._hash`` too); ``KVCONDUCTOR_IMPL=py`` or ``Index(impl="py")`` makes
an index use them. Clarity beats speed here.

:mod:`kvconductor._py.shlock` models the slot table of the cross-process lock
(``kvconductor._shlock``) the same way; :mod:`kvconductor._py.hash` is the oracle of
``kvconductor._hash.split_chunk_hashes`` (a store-only chunk's block hashes).

**Threading: exactly one writer thread calls the mutating methods; any number of
threads may call the matching and introspection methods concurrently.** Every
public method holds the object's :class:`threading.Lock` for its whole duration.
"""

from kvconductor._py.index import CoreIndex
from kvconductor._py.lower import LowerTier
from kvconductor._py.tree import RadixTree

__all__ = ["CoreIndex", "LowerTier", "RadixTree"]
