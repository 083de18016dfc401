"""PrefixView: a read-only view of the first `n` items of a list that only ever grows.

The output processor appends each step's new tokens (and logprobs) to one list per sample; the
`CompletionOutput` a step returns must stay unchanged after later steps. Copying the list each
step costs O(tokens so far) per request per step; a view of its first `n` items costs O(1) and
stays unchanged because the list is only appended to (vLLM types `CompletionOutput.token_ids`
as a `Sequence[int]` for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar, overload

T = TypeVar("T")


class PrefixView(Sequence[T]):
    """`items[:length]`, read-only, without the copy. `items` must only be appended to while
    the view lives (never shortened or overwritten)."""

    __slots__ = ("_items", "_len")

    def __init__(self, items: list[T], length: int | None = None) -> None:
        self._items = items
        self._len = len(items) if length is None else length

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        """An item, or a slice as a new list (O(slice length))."""
        n = self._len
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return self._items[start:stop]
            items = self._items  # (indices() gives a stop of -1 for "before item 0")
            return [items[i] for i in range(start, stop, step)]
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} items")
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        return islice(self._items, self._len)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PrefixView):
            other = other.tolist()
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return len(other) == self._len and self.tolist() == list(other)

    __hash__ = None  # type: ignore[assignment] - unhashable, as a list

    def __add__(self, other: Sequence[Any]) -> list[Any]:
        return self.tolist() + list(other)

    def __radd__(self, other: Sequence[Any]) -> list[Any]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())

    def tolist(self) -> list[T]:
        """The items as a new list."""
        return self._items[:self._len]
