"""Predicted peak bytes of one training step per rank: parameters, gradients, optimizer state, saved activations,
FSDP's gathered blocks and the backward's transient tensors, for a layout, tensor size ``p``, ``dp`` replicas, ZeRO
stage and activation checkpointing.

The step is the one ``recipes/benchmarks/zero_stages.py`` measures (an AdamW with ``foreach``, float32 parameters):
``zero_grad(set_to_none=True)``, forward, backward, data-parallel averaging, global-norm clipping, ``step``. Its
peak is what exists before the step (parameters, optimizer state) plus the peak of what the step allocates
(:class:`~lightning_tp2d.bench.measure.LiveTensorBytes` with ``count_resizes``); ``tests/test_memory_model.py``
compares the two on gloo ranks.

Where the numbers come from, per rank (``e`` = ``elem``):

* shapes: the model is built and parallelized on torch's fake process group with fake tensors (as
  :mod:`lightning_tp2d.bench.trace` does, in a forked process) and, at stages 2 and 3, sharded with
  :func:`lightning_tp2d.fsdp.shard_data_parallel`: ``parameters`` are the local at-rest bytes; the tensor-shard
  bytes of each FSDP group (one per block, one for the root) are what FSDP gathers; the bytes of a block's input
  (read by a forward hook in the same fake forward) are what full checkpointing keeps per block;
* ``gradients``: equal to the parameters (float32, like them); at stages 2 and 3 the dp shards;
* ``optimizer``: AdamW's two float32 moments per element held: ``2 x parameters``; stage 1 keeps ``1 / dp`` of
  them (:func:`lightning_tp2d.zero.shard_optimizer_state`: an even split of the flat state);
* ``activations``: traced with the same ``checkpointing`` (:func:`lightning_tp2d.bench.trace.trace_step`'s
  ``activation_bytes``, the storages the checkpointed forward keeps for the backward). ``"full"`` adds one block's
  saved tensors during its recomputation in the backward (the ``backward`` term: the difference of the
  uncheckpointed two- and one-block traces); ``"selective"``'s recipes are rebuilt one at a time and add nothing;
* ``gathered`` (stages 2, 3, ``dp > 1``): stage 2 holds every block's and the root's tensor shard from the forward
  to the backward; stage 3 the root's and two blocks' (the one computing and the one prefetched);
* ``backward``: the transient peak beyond the held bytes, at the start of the backward of the last block: the
  gradients of the root group (the head's and embeddings', made first) less their dp share, at stages 2 and 3 a
  block's unsharded gradients before their reduce-scatter; at stage 0 with ``dp > 1`` GradientSync's flat buckets
  (every gradient once, for these sizes one bucket).

Not modelled: allocator fragmentation (a GPU's caching allocator rounds and caches blocks; this is live bytes),
kernel workspaces, communication buffers inside one op, AdamW's foreach temporaries (one parameter-sized list
during ``step``, after the gradients of the backward's peak are no longer joined by activations).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_tp2d import fsdp
from lightning_tp2d.bench.measure import tensors_in
from lightning_tp2d.bench.trace import trace_step
from lightning_tp2d.families import family_of, family_of_config
from lightning_tp2d.layouts import get_layout
from lightning_tp2d.mesh import init_mesh
from lightning_tp2d.parallelize import ACTIVATION_CHECKPOINTING, parallelize

__all__ = ["Shards", "peak_bytes", "shard_bytes"]


@dataclasses.dataclass(frozen=True)
class Shards:
    """One rank's parameter bytes: at rest, each FSDP group's tensor shard (what FSDP gathers), a block's input."""

    at_rest: int  # local parameter bytes this rank holds between steps
    root: int  # tensor-shard bytes of the root group (embeddings, norms, head)
    blocks: tuple[int, ...]  # tensor-shard bytes of each block
    block_input: int  # bytes of one block's input (what full checkpointing saves per block)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(params) -> int:
    return sum(_local(q).numel() * q.element_size() for q in params)


def _shards_here(spec, cfg, batch: int, seq: int, p: int, dp: int, stage: int, elem: int, rank: int) -> Shards:
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see lightning_tp2d._private_api
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: the fake backend's store

    dist.init_process_group("fake", rank=rank, world_size=p * dp, store=FakeStore())
    try:
        mesh = init_mesh(spec, p, dp, device_type="cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = family_of_config(cfg).model_class(cfg)
            parallelize(model, mesh, spec)
            model.validate_inputs = False  # fake ids cannot be read
            blocks = list(family_of(model).block_modules(model))
            in_blocks = {id(q) for b in blocks for q in b.parameters()}
            root = _nbytes(q for q in model.parameters() if id(q) not in in_blocks)
            per_block = tuple(_nbytes(b.parameters()) for b in blocks)
            if dp > 1 and stage >= 2:
                fsdp.shard_data_parallel(model, stage)
            seen: list[int] = []
            blocks[0].register_forward_pre_hook(
                lambda m, args: seen.append(sum(_local(t).untyped_storage().nbytes() for t in tensors_in(args))))
            idx = torch.zeros(batch, seq, dtype=torch.long)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=elem == 2):
                model(idx, idx)
            return Shards(_nbytes(model.parameters()), root, per_block, seen[0])
    finally:
        dist.destroy_process_group()


def _serve(conn, args) -> None:
    try:
        conn.send(("ok", _shards_here(*args)))
    except BaseException as err:  # noqa: BLE001 - reported by the caller
        conn.send(("error", f"{type(err).__name__}: {err}"))


_SHARDS: dict[tuple, list[Shards]] = {}


def shard_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
                elem: int = 4) -> list[Shards]:
    """:class:`Shards` of every tensor-parallel rank of the first replica, read from the model built on the fake
    process group in a forked process (this one must have no default process group). Cached."""
    spec = get_layout(layout)
    key = (type(spec), spec.options, type(cfg).__name__, *sorted(vars(cfg).items()), batch, seq, p, dp, zero_stage,
           elem)
    if key not in _SHARDS:
        if dist.is_initialized():
            raise RuntimeError("shard_bytes builds the model on its own fake process group; call it from a process "
                               "without a default process group")
        _SHARDS[key] = [_fork(spec, cfg, batch, seq, p, dp, zero_stage, elem, rank) for rank in range(p)]
    return _SHARDS[key]


def _fork(*args) -> Shards:
    """:func:`_shards_here` in a forked process of its own: one fake process group per process, so that nothing
    torch caches about a group (DTensor's sharding propagation holds meshes) meets the next one."""
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(theirs, args), daemon=True, name="tp2d-shards")
    process.start()
    theirs.close()
    try:
        status, value = mine.recv()
    except EOFError:
        status, value = "error", f"the process died (exit code {process.exitcode})"
    process.join()
    if status != "ok":
        raise RuntimeError(f"building layout {args[0].name!r} on the fake process group failed: {value}")
    return value


def peak_bytes(layout, cfg, batch: int, seq: int, p: int, *, dp: int = 1, zero_stage: int = 0,
               checkpointing: str = "none", elem: int = 4, rank: int | None = None) -> dict:
    """Predicted peak bytes of one step on tensor-parallel rank ``rank`` (``None``: the rank with the largest
    total): ``{"parameters", "gradients", "optimizer", "activations", "gathered", "backward", "total"}`` (module
    docstring). ``batch`` is per replica."""
    if checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {ACTIVATION_CHECKPOINTING}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} is not one of 0, 1, 2, 3")
    shards = shard_bytes(layout, cfg, batch, seq, p, dp=dp, zero_stage=zero_stage, elem=elem)
    ranks = range(p) if rank is None else [rank]
    parts = [_parts(layout, cfg, batch, seq, p, dp, zero_stage, checkpointing, elem, r, shards[r]) for r in ranks]
    return max(parts, key=lambda d: d["total"])


def _parts(layout, cfg, batch, seq, p, dp, stage, checkpointing, elem, rank, s: Shards) -> dict:
    sharded = dp > 1 and stage >= 2
    params = s.at_rest
    grads = params  # float32 gradients of what this rank holds (dp shards at stages 2 and 3)
    optimizer = 2 * params // (dp if stage == 1 else 1)
    activations = trace_step(layout, cfg, batch, seq, p, elem, rank, checkpointing=checkpointing).activation_bytes
    recompute = 0
    if checkpointing == "full":  # one block's saved tensors, recomputed: what the uncheckpointed trace saves per block
        plain = trace_step(layout, cfg, batch, seq, p, elem, rank)
        one = trace_step(layout, dataclasses.replace(cfg, n_layer=1), batch, seq, p, elem, rank)
        recompute = (plain.activation_bytes - one.activation_bytes) // max(1, cfg.n_layer - 1) if cfg.n_layer > 1 \
            else one.activation_bytes  # n_layer 1: the whole step's, an overestimate of one block's
    gathered = 0
    if sharded:
        gathered = s.root + (sum(s.blocks) if stage == 2 else sum(sorted(s.blocks)[-2:]))
    full_grads = s.root + sum(s.blocks)  # the tensor shards' gradients, before any dp reduction
    if sharded:
        transient = s.root + max(s.blocks)  # root's and one block's unsharded gradients before the reduce-scatter
    elif dp > 1:
        transient = full_grads  # GradientSync's flat buckets
    else:
        transient = 0
    backward = recompute + transient
    total = params + optimizer + max(activations + gathered, grads + activations + gathered + backward)
    return {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
            "gathered": gathered, "backward": backward, "total": total}
