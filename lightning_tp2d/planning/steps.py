"""One rank's training step as the cost and memory models read it: :class:`TracedStep`, what the tracer
(:mod:`lightning_tp2d.planning.trace`) records and the closed forms (:mod:`lightning_tp2d.planning.closed_step`,
:mod:`lightning_tp2d.planning.closed_grid`) compute, those by writing one rank's operations on a :class:`Stream`."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from lightning_tp2d.families import family_of_config, fits
from lightning_tp2d.planning.events import Comm
from lightning_tp2d.train_plan import CHECKPOINTING

_MATMUL, _ATTENTION = 0, 1  # compute slots, as the tracer's
# the families the closed forms (step and memory) model; any other is traced
CLOSED_FAMILIES = ("gpt2", "llama")


def closed_family_problem(cfg) -> str | None:
    """Why the closed forms do not model ``cfg``'s family (:data:`CLOSED_FAMILIES`), or ``None``."""
    family = family_of_config(cfg)
    if family is None or family.name not in CLOSED_FAMILIES:
        return f"a {type(cfg).__name__} is traced: the closed forms model GPT-2 and Llama"
    return None


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """One rank's step: the calls (merged where identical) each tagged with its overlapped FLOPs per rate, and the
    FLOPs per phase and rate."""

    # (event with overlap_flops = all overlapped FLOPs, of which matmul, of which attention, the group's global ranks)
    events: tuple[tuple[Comm, float, float, tuple[int, ...]], ...]
    flops: dict  # {"forward": {"matmul": f, "attention": f}, "backward": {...}}
    activation_bytes: int  # storages the forward created that autograd saved for the backward
    gemms: dict  # {"forward": n, "backward": n}: matmul kernels launched (each pays the GEMM overhead of the rates)
    block_calls: int | None = None  # communication calls one transformer block adds (None: traced with one block)


class Stream:
    """One rank's operations in order, as the closed forms (:mod:`~lightning_tp2d.planning.closed_step`,
    :mod:`~lightning_tp2d.planning.closed_grid`) write them: calls posted and waited for (each with its axis and
    group), compute between them, GEMM kernels counted; :meth:`events` prices it by the tracer's overlap rule: each
    compute chunk's FLOPs shared among the calls in flight in proportion to their bytes (one stream: the tensor
    axes')."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.chunks: list[tuple[int, float]] = []
        self.calls: list[list] = []  # [kind, axis, ranks, nbytes, phase, start, end]
        self.flops = {ph: {"matmul": 0.0, "attention": 0.0} for ph in ("forward", "backward")}
        self.gemms = {"forward": 0, "backward": 0}

    def post(self, kind: str, axis: str, ranks: tuple[int, ...], nbytes: int) -> list:
        entry = [kind, axis, ranks, nbytes, self.phase, len(self.chunks), None]
        self.calls.append(entry)
        return entry

    def wait(self, entry: list) -> None:
        entry[6] = len(self.chunks)

    def blocking(self, kind: str, axis: str, ranks: tuple[int, ...], nbytes: int) -> None:
        self.wait(self.post(kind, axis, ranks, nbytes))

    def mm(self, flops: float) -> None:
        self.gemms[self.phase] += 1
        self._compute(_MATMUL, flops)

    def attention(self, flops: float) -> None:
        self._compute(_ATTENTION, flops)

    def _compute(self, slot: int, flops: float) -> None:
        if flops:
            self.flops[self.phase]["matmul" if slot == _MATMUL else "attention"] += flops
            self.chunks.append((slot, flops))

    def events(self) -> dict[tuple, int]:
        """``{(Comm with calls=1, matmul FLOPs, attention FLOPs, ranks): calls}``."""
        starts, ends = defaultdict(list), defaultdict(list)
        for n, entry in enumerate(self.calls):
            if entry[5] < entry[6]:
                starts[entry[5]].append(n)
                ends[entry[6]].append(n)
        shares = [[0.0, 0.0] for _ in self.calls]
        active: dict[int, list] = {}
        for i, (slot, flops) in enumerate(self.chunks):
            for n in ends.get(i, ()):
                del active[n]
            for n in starts.get(i, ()):
                active[n] = self.calls[n]
            total = sum(e[3] for e in active.values())
            for n, e in active.items() if total else ():
                shares[n][slot] += flops * e[3] / total
        out: dict[tuple, int] = defaultdict(int)
        for (kind, axis, ranks, nbytes, phase, _, _), (fm, fa) in zip(self.calls, shares):
            out[(Comm(kind, axis, len(ranks), nbytes, 1, fm + fa, phase), fm, fa, ranks)] += 1
        return out


def one_replica_problem(cfg, elem: int, dp: int, zero_stage: int, clip: bool) -> str | None:
    """What both step closed forms (the ring's and the grids') refuse whatever the layout: more than one replica,
    an element size other than bf16 autocast's or float32, a family other than GPT-2 and Llama (``None``: none of
    these)."""
    if (dp, zero_stage, bool(clip)) != (1, 0, False):
        return f"dp={dp}, zero_stage={zero_stage}, clip={clip}: closed forms cover one replica (dp=1, stage 0)"
    if elem not in (2, 4):
        return f"elem={elem}: closed forms cover 2 (bf16 autocast) and 4 (float32)"
    return closed_family_problem(cfg)


def split_problem(spec, cfg, p: int) -> str | None:
    """What both step closed forms refuse of a layout they model: sizes ``p`` ranks do not split (the trace regroups
    the heads then), dropout (``None``: neither)."""
    if not fits(spec, p, cfg):
        return f"p={p} does not split {type(cfg).__name__}'s sizes in {spec.name!r} (the trace regroups heads)"
    if getattr(cfg, "dropout", 0.0):
        return f"dropout={cfg.dropout}: closed forms cover training without dropout"
    return None


def checked_entry(name: str, why: str | None, spec, p: int, batch: int, seq: int, rank: int,
                  checkpointing: str) -> None:
    """The refusals both step closed forms make on entry (``name`` the function's, for the message): a case it does
    not model (``why``, its ``models()``), an unknown checkpointing mode, a rank outside ``[0, p)``, an input the
    layout refuses."""
    if why:
        raise ValueError(f"{name}: {why}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {CHECKPOINTING}")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not in [0, {p})")
    spec.check_input(p, batch, seq)


def run_passes(root, block, root_pass, block_pass, checkpointing: str) -> None:
    """One training step's passes on a root stream and a block stream (``root_pass(stream, backward)``, likewise
    ``block_pass``): both forwards, then the root's backward and the block's, the block's forward again first under
    full checkpointing (the checkpoint runs it again before its backward)."""
    root_pass(root, False)
    block_pass(block, False)
    root.phase = block.phase = "backward"
    root_pass(root, True)
    if checkpointing == "full":
        block_pass(block, False)
    block_pass(block, True)


def _order(item) -> tuple:
    ev, fm, fa, ranks = item
    return (ev.phase, ev.kind, ev.group, ev.nbytes, ev.overlap_flops, fm, fa, ranks, ev.calls)


def root_and_blocks(root, block, n_layer: int, activation_bytes: int) -> TracedStep:
    """The step of a model of ``n_layer`` identical blocks from one rank's root and one block, each a schedule
    with ``events()`` (``(event, matmul FLOPs, attention FLOPs, ranks) -> calls``), ``flops[phase][rate]`` and
    ``gemms[phase]`` (the closed forms' streams): the root's once, the block's ``n_layer`` times, the events merged
    and ordered as the tracer orders them; ``block_calls`` the calls one block adds."""
    merged: dict[tuple, int] = defaultdict(int)
    for key, n in root.events().items():
        merged[key] += n
    block_events = block.events()
    for key, n in block_events.items():
        merged[key] += n_layer * n
    events = tuple(sorted(((dataclasses.replace(ev, calls=n), fm, fa, r) for (ev, fm, fa, r), n in merged.items()),
                          key=_order))
    flops = {ph: {rate: root.flops[ph][rate] + n_layer * block.flops[ph][rate] for rate in root.flops[ph]}
             for ph in root.flops}
    gemms = {ph: root.gemms[ph] + n_layer * block.gemms[ph] for ph in root.gemms}
    return TracedStep(events, flops, activation_bytes, gemms, sum(block_events.values()))
