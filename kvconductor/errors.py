"""Index errors, shared by the compiled core and the pure-Python twins."""


class IndexUpdateError(Exception):
    """Base class of errors raised by an index mutation."""


class ParentBlockNotFound(IndexUpdateError):
    """A stored chain names a parent the worker does not hold."""

    def __init__(self, msg: str = "parent block not found") -> None:
        super().__init__(msg)


class InvalidBlockSequence(IndexUpdateError):
    """A stored chain repeats an engine hash (it would loop)."""

    def __init__(self, msg: str = "invalid block sequence") -> None:
        super().__init__(msg)
