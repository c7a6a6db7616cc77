"""Packed documents: several documents in one training sequence, each attending only to itself.

A packed batch carries, beside ``idx [B, T]``, a document id per token: ``ids [B, T]`` integers, non-decreasing
along each row (document ``k`` of a row is the run of tokens whose id is ``k``). Query ``t`` then sees key ``s``
iff ``s <= t`` and ``ids[s] == ids[t]`` (per-document causal attention); without ids the model is exactly the plain
causal one. The public input is ``model(idx, targets, doc_ids=...)`` with either a ``[B, T]`` integer tensor or a
:class:`Documents`; :meth:`Documents.from_eos` derives the ids from end-of-text tokens (an end-of-text token closes
its document, the next token opens the following one), as ``TextDataModule(pack_documents=True)`` does.

:class:`Documents` also keeps, per row, the positions where a document starts (``starts``), as plain Python data
computed on the host. The ring layouts decide from them which blocks of the ``[T, T]`` attention hold no visible
pair and skip those without reading anything back from the device (:meth:`Documents.chunk_links`). When a
:class:`Documents` is built from device ids without ``starts``, the first question that needs them reads the ids
once (a host sync on a GPU); the data module builds them on the CPU, before the batch moves.

``Documents`` has a ``to`` method, so Lightning's batch transfer moves its ids and keeps ``starts`` as they are.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

WHOLE, MASKED, SKIPPED = 2, 1, 0  # the kinds of chunk pair chunk_links reports


class Documents:
    """Document ids ``ids [B, T]`` (non-decreasing integers per row) and ``starts``: per row, the sorted positions
    where a document starts (``0`` first), computed from the ids on first use unless given."""

    def __init__(self, ids: torch.Tensor, starts: tuple[tuple[int, ...], ...] | None = None) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() \
                or ids.dtype == torch.bool:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"doc_ids must be a 2-D (B, T) integer tensor, got {shape}"
                             + (f" dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else ""))
        self.ids = ids
        self._starts = None if starts is None else tuple(tuple(int(s) for s in row) for row in starts)
        self._links: dict[int, tuple[tuple[int, ...], ...]] = {}

    @classmethod
    def from_eos(cls, tokens: torch.Tensor, eos_id: int) -> "Documents":
        """Ids from end-of-text tokens ``eos_id`` in ``tokens [B, T]``: the id of token ``t`` is the number of
        end-of-text tokens before it, so an end-of-text token belongs to the document it closes."""
        eos = (tokens == eos_id).to(torch.int64)
        return cls(eos.cumsum(-1) - eos)

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    @property
    def starts(self) -> tuple[tuple[int, ...], ...]:
        """Per row, the positions where a document starts (reads the ids on the host the first time if they were
        not given; ``ValueError`` if a row's ids decrease)."""
        if self._starts is None:
            ids = self.ids.detach().cpu()
            check_non_decreasing(ids)
            change = ids[:, 1:] != ids[:, :-1]
            self._starts = tuple((0, *(int(t) + 1 for t in row.nonzero().flatten().tolist())) for row in change)
        return self._starts

    @property
    def starts_known(self) -> bool:
        """Whether ``starts`` are known already (so asking for them reads nothing from the device)."""
        return self._starts is not None

    def to(self, *args, **kwargs) -> "Documents":
        """The ids moved (``Tensor.to``'s arguments); ``starts`` kept (they are host data)."""
        return Documents(self.ids.to(*args, **kwargs), self._starts)

    def check(self, idx: torch.Tensor, values: bool = False) -> None:
        """``ValueError`` naming both shapes unless the ids have ``idx``'s shape; with ``values``, also unless every
        row is non-decreasing (reads the ids: only for host tensors)."""
        if tuple(self.ids.shape) != tuple(idx.shape):
            raise ValueError(f"doc_ids must have idx's shape (B, T) = {tuple(idx.shape)}, got "
                             f"{tuple(self.ids.shape)}")
        if values and self.ids.device.type == "cpu" and self.ids.numel():
            check_non_decreasing(self.ids)

    def mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool, True where query ``t`` may see key ``s`` (``s <= t``, same document): the whole
        mask, for the single-device model and tests (the ring layouts never build it)."""
        T = self.ids.shape[1]
        same = self.ids.unsqueeze(-1) == self.ids.unsqueeze(-2)  # (B, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return (same & causal).unsqueeze(1)

    def chunk_links(self, chunks: int) -> tuple[tuple[int, ...], ...]:
        """For the sequence cut into ``chunks`` equal chunks, ``links[a][b]`` (``b <= a``; query chunk ``a``, key
        chunk ``b``) over the whole batch: :data:`SKIPPED` when no query of ``a`` may see a key of ``b`` in any row
        (a document starts between the last key and the first query), :data:`WHOLE` when every row's tokens from
        chunk ``b`` to chunk ``a`` are one document (the plain causal block, no document mask), :data:`MASKED`
        otherwise. Entries ``b > a`` are :data:`SKIPPED` (causally empty). Plain Python from ``starts``; cached."""
        if chunks not in self._links:
            T = self.ids.shape[1]
            if chunks < 1 or T % chunks:
                raise ValueError(f"chunk_links: {T} tokens do not cut into {chunks} equal chunks")
            c = T // chunks
            starts = self.starts

            def any_start(lo: int, hi: int, row: tuple[int, ...]) -> bool:  # a start in [lo, hi]?
                k = bisect_left(row, lo)
                return k < len(row) and row[k] <= hi

            def kind(a: int, b: int) -> int:
                if b > a:
                    return SKIPPED
                if b < a and all(any_start((b + 1) * c, a * c, row) for row in starts):
                    return SKIPPED
                whole = not any(any_start(b * c + 1, (a + 1) * c - 1, row) for row in starts)
                return WHOLE if whole else MASKED

            self._links[chunks] = tuple(tuple(kind(a, b) for b in range(chunks)) for a in range(chunks))
        return self._links[chunks]

    def __repr__(self) -> str:
        return f"Documents(ids {tuple(self.ids.shape)} on {self.ids.device})"


def check_non_decreasing(ids: torch.Tensor) -> None:
    """``ValueError`` naming the first row and position where host ids ``[B, T]`` decrease."""
    drops = (ids[:, 1:] < ids[:, :-1]).nonzero()
    if drops.numel():
        b, t = (int(v) for v in drops[0])
        raise ValueError(f"doc_ids must be non-decreasing along each row (document k = the tokens with id k); row {b} "
                         f"goes from {int(ids[b, t])} to {int(ids[b, t + 1])} at position {t + 1}")


def as_documents(doc_ids: "torch.Tensor | Documents | None", idx: torch.Tensor,
                 values: bool = False) -> Documents | None:
    """``doc_ids`` as :class:`Documents` (``None`` stays ``None``), checked against ``idx``
    (:meth:`Documents.check`)."""
    if doc_ids is None:
        return None
    documents = doc_ids if isinstance(doc_ids, Documents) else Documents(doc_ids)
    documents.check(idx, values=values)
    return documents


def pair_mask(ids: torch.Tensor, q_rows: slice, k_rows: slice, causal: bool) -> torch.Tensor:
    """``[B, 1, Lq, Lk]`` bool: True where query position ``q_rows`` may see key position ``k_rows`` (same document;
    with ``causal``, the two ranges are the same chunk and the key is at or before the query)."""
    mask = ids[:, q_rows].unsqueeze(-1) == ids[:, k_rows].unsqueeze(-2)  # (B, Lq, Lk)
    if causal:
        mask &= torch.ones(mask.shape[-2:], dtype=torch.bool, device=ids.device).tril()
    return mask.unsqueeze(1)


__all__ = ["Documents", "MASKED", "SKIPPED", "WHOLE", "as_documents", "check_non_decreasing", "pair_mask"]
