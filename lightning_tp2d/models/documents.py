"""Packed documents: several documents in one training sequence, each attending only to itself.

A packed batch carries, beside ``idx [B, T]``, a document id per token: ``ids [B, T]`` integers, non-decreasing
along each row (document ``k`` of a row is the run of tokens whose id is ``k``). Query ``t`` then sees key ``s``
iff ``s <= t`` and ``ids[s] == ids[t]`` (per-document causal attention); without ids the model is exactly the plain
causal one. The public input is ``model(idx, targets, doc_ids=...)`` with either a ``[B, T]`` integer tensor or a
:class:`Documents`; :meth:`Documents.from_eos` derives the ids from end-of-text tokens (an end-of-text token closes
its document, the next token opens the following one), as ``TextDataModule(pack_documents=True)`` does.

:class:`Documents` also keeps, per row, the positions where a document starts (``starts``), as plain Python data
computed on the host. The ring layouts decide from them which blocks of the ``[T, T]`` attention hold no visible
pair and skip those (:meth:`Documents.chunk_links`), and cut a block that crosses a document start into the runs of
queries and keys of one document (:meth:`Documents.segments`), each attended as a plain block: no mask is built,
and nothing is read back from the device. When a
:class:`Documents` is built from device ids without ``starts``, the first question that needs them reads the ids
once (a host sync on a GPU); the data module builds them on the CPU, before the batch moves.

``Documents`` has a ``to`` method, so Lightning's batch transfer moves its ids and keeps ``starts`` as they are, and
``host_ids``: the ids as they were on the CPU before the move. Under ``torch.compile`` the ring layouts hand the
attention op those host ids (an op's arguments are tensors, not host data), so it reads them without a device sync.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import torch

WHOLE, SPLIT, SKIPPED = 2, 1, 0  # the kinds of chunk pair chunk_links reports


class Documents:
    """Document ids ``ids [B, T]`` (non-decreasing integers per row) and ``starts``: per row, the sorted positions
    where a document starts (``0`` first), computed from the ids on first use unless given. ``host_ids``: the ids
    on the CPU (``ids`` itself when on the CPU; kept by :meth:`to`), or ``None`` when built from device ids."""

    def __init__(self, ids: torch.Tensor, starts: tuple[tuple[int, ...], ...] | None = None,
                 host_ids: torch.Tensor | None = None) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() \
                or ids.dtype == torch.bool:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"doc_ids must be a 2-D (B, T) integer tensor, got {shape}"
                             + (f" dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else ""))
        self.ids = ids
        self.host_ids = host_ids if host_ids is not None else ids if ids.device.type == "cpu" else None
        self._starts = None if starts is None else tuple(tuple(int(s) for s in row) for row in starts)
        self._links: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._segments: dict[tuple[int, int, int], tuple[tuple[tuple[int, int, int, int], ...], ...]] = {}

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
            ids = (self.ids if self.host_ids is None else self.host_ids).detach().cpu()
            check_non_decreasing(ids)
            change = ids[:, 1:] != ids[:, :-1]
            self._starts = tuple((0, *(int(t) + 1 for t in row.nonzero().flatten().tolist())) for row in change)
        return self._starts

    @property
    def starts_known(self) -> bool:
        """Whether ``starts`` are known already (so asking for them reads nothing from the device)."""
        return self._starts is not None

    def to(self, *args, **kwargs) -> "Documents":
        """The ids moved (``Tensor.to``'s arguments); ``starts`` and ``host_ids`` kept (they are host data)."""
        return Documents(self.ids.to(*args, **kwargs), self._starts, self.host_ids)

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
        chunk ``b`` to chunk ``a`` are one document (the plain causal block), :data:`SPLIT` otherwise (the pair is
        attended by :meth:`segments`). Entries ``b > a`` are :data:`SKIPPED` (causally empty). Plain Python from
        ``starts``; cached."""
        if chunks not in self._links:
            c = self._chunk(chunks)
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
                return WHOLE if whole else SPLIT

            self._links[chunks] = tuple(tuple(kind(a, b) for b in range(chunks)) for a in range(chunks))
        return self._links[chunks]

    def segments(self, chunks: int, a: int, b: int) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
        """Query chunk ``a`` and key chunk ``b <= a`` (of ``chunks`` equal chunks of ``c`` tokens) cut at document
        starts: per row, the ``(q0, q1, k0, k1)`` offsets inside the two chunks of each run of queries
        ``[q0, q1)`` and the run of keys ``[k0, k1)`` of the same document that it sees. On the diagonal
        (``a == b``) every document's run in the chunk sees itself causally (``k0, k1 == q0, q1``); below it
        (``b < a``) a document's run in chunk ``a`` sees all of the same document's run in chunk ``b``, and a run
        whose document starts after chunk ``b`` sees nothing (left out). Every other (query, key) combination is
        hidden, so attending these segments as plain blocks is per-document causal attention with no mask.
        Runs in increasing order; plain Python from ``starts``; cached."""
        key = (chunks, a, b)
        if key not in self._segments:
            if not 0 <= b <= a < chunks:
                raise ValueError(f"segments: need 0 <= b <= a < chunks, got a={a}, b={b}, chunks={chunks}")
            c, T = self._chunk(chunks), self.ids.shape[1]
            q_lo, k_lo = a * c, b * c
            rows = []
            for row in self.starts:
                inner = row[bisect_right(row, q_lo):bisect_left(row, q_lo + c)]  # starts inside query chunk a
                cuts = (q_lo, *inner, q_lo + c)
                runs = []
                for s0, s1 in zip(cuts, cuts[1:]):  # [s0, s1): one document's queries
                    if a == b:
                        runs.append((s0 - q_lo, s1 - q_lo, s0 - q_lo, s1 - q_lo))
                        continue
                    d = bisect_right(row, s0) - 1  # the document of [s0, s1): starts at row[d]
                    lo, hi = max(row[d], k_lo), min(row[d + 1] if d + 1 < len(row) else T, k_lo + c)
                    if lo < hi:
                        runs.append((s0 - q_lo, s1 - q_lo, lo - k_lo, hi - k_lo))
                rows.append(tuple(runs))
            self._segments[key] = tuple(rows)
        return self._segments[key]

    def _chunk(self, chunks: int) -> int:
        """The length of each of ``chunks`` equal chunks (``ValueError`` unless they cut the sequence evenly)."""
        T = self.ids.shape[1]
        if chunks < 1 or T % chunks:
            raise ValueError(f"{T} tokens do not cut into {chunks} equal chunks")
        return T // chunks

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


__all__ = ["Documents", "SKIPPED", "SPLIT", "WHOLE", "as_documents", "check_non_decreasing"]
