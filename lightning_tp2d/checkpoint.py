"""Checkpoints of parallelized GPT-2 models that load under any layout, grid or dp size, and on one device.

Two formats (``TP2DStrategy(save_distributed_checkpoint=...)``):

* **sharded**: a directory written by ``torch.distributed.checkpoint`` (DCP), each rank writing only its own
  shards, plus ``meta.pt`` with the rest of Lightning's checkpoint (loops, schedulers, callbacks, optimizer
  hyper-parameters). DCP records every tensor by its full shape and the box each shard covers, so a load under
  another mesh reads exactly the boxes it needs (resharding on load).
* **full**: one ``torch.save`` file in Lightning's usual form: ``state_dict`` of full plain tensors and
  ``optimizer_states`` in torch's own format (with ``param_names``), so a plain single-device run resumes too.

The layout trap: "2d" keeps q, k and v of one head group on one rank, so a rank's block of the fused
``c_attn`` ``[3h, in]`` is three separate row blocks (``_StridedShard``), which is not a box and which DCP cannot
describe. The sharded format therefore stores every ``attn.c_attn`` weight, bias and their optimizer states as
``[3, h, ...]`` (q/k/v first), whatever the layout (the model family names its fused q/k/v keys:
:attr:`~lightning_tp2d.families.ModelFamily.fused_qkv`; Llama's separate projections need none): there the
block is a box. A shard no box describes is gathered and saved whole (correct, only slower).

Reading a checkpoint on one device and exporting to transformers live in :mod:`lightning_tp2d.export`.

Saving is crash-safe and loading checked, by the model-agnostic :mod:`lightning_tp2d.safe_files`: everything is
written to ``<path>.tmp-tp2d`` and renamed into place only when complete, so a crash mid-save leaves the previous
checkpoint at ``path`` untouched; a save that fails on any rank (a full disk) removes the staging folder on every
rank's word and raises :class:`CheckpointError` naming the cause (:func:`save`). A sharded checkpoint records the
size and BLAKE2b digest of every file in ``checksums.json``; loading verifies them first and names every missing,
truncated or damaged file in one error. ``staging_path``, ``clear``, ``commit``, ``resolve`` and ``verify`` are
importable from here too.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp2d.errors import CheckpointError
from lightning_tp2d.families import fused_qkv_suffixes
from lightning_tp2d.fsdp import stage0_specs
from lightning_tp2d.layouts import DATA_AXIS
from lightning_tp2d import safe_files
from lightning_tp2d.safe_files import (CHECKSUMS, clear, commit, describe_failure, file_digest,  # noqa: F401
                                       gather_objects, resolve, save_staged, staging_path, verify)
from lightning_tp2d.trust import UntrustedCheckpointError, check_dcp_metadata, load_data, to_plain, warn_untrusted
from lightning_tp2d.zero import full_param_groups, sharding_of

META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
MODEL = "state_dict."
_dcp_save = dcp.save  # indirection so tests can interrupt a save


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group, even when told ``no_dist``; one process is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---- box views (the one layout-dependent step) --------------------------------------------------------------


def _qkv_shape(shape) -> tuple[int, ...]:
    return (3, shape[0] // 3, *shape[1:])


def _unview_shape(key: str, shape) -> tuple[int, ...]:
    shape = tuple(shape)
    return (shape[0] * shape[1], *shape[2:]) if _is_qkv(key) and len(shape) >= 2 else shape


def _is_qkv(key: str) -> bool:
    """Whether ``key`` (a parameter, or an optimizer state ``<parameter>.<field>``) is a fused q/k/v tensor of a
    registered model family (GPT-2's ``attn.c_attn``; keys carry no model, so every family's suffixes count)."""
    fused = fused_qkv_suffixes()
    return bool(fused) and (key.endswith(fused) or any(key.rsplit(".", 1)[0].endswith(s) for s in fused))


def _strided_over_dp_only(t: DTensor) -> bool:
    """Whether the only strided placement of ``t`` is FSDP's over ``data_parallel`` (``_StridedShard`` of dim 0
    after a tensor axis's ``Shard(0)``): each rank's local tensor is then one contiguous box of rows, whose offset
    DCP's planner computes from the placements, so it is saved and loaded as it is, with no gather."""
    names = t.device_mesh.mesh_dim_names or ()
    return all(not isinstance(pl, _StridedShard) or names[i] == DATA_AXIS for i, pl in enumerate(t.placements))


def box_view(t: torch.Tensor, qkv: bool) -> torch.Tensor:
    """What DCP stores for ``t``: itself, or for q/k/v tensors a ``[3, n/3, ...]`` view. A DTensor stays a DTensor
    whose local tensor is a view of ``t``'s (so a load into it writes into ``t``) unless no box describes its
    shard; then the full tensor (a collective) is returned."""
    if not isinstance(t, DTensor):
        return t.view(_qkv_shape(t.shape)) if qkv else t
    if not qkv and not any(isinstance(pl, _StridedShard) for pl in t.placements):
        return t
    if not qkv and _strided_over_dp_only(t):  # FSDP's cut of a tensor-parallel row shard: a box DCP computes
        return t
    places, boxed = [], True
    for pl in t.placements:
        if isinstance(pl, _StridedShard):
            boxed &= qkv and pl.dim == 0 and pl.split_factor == 3
            places.append(Shard(1))
        elif isinstance(pl, Shard):
            boxed &= not (qkv and pl.dim == 0)
            places.append(Shard(pl.dim + 1) if qkv else pl)
        else:
            places.append(pl)
    if qkv:
        mesh = t.device_mesh
        boxed &= all((t.shape[0] // 3) % mesh.size(i) == 0 for i, pl in enumerate(t.placements) if not pl.is_replicate())
    if not boxed:
        full = t.full_tensor()
        return full.view(_qkv_shape(full.shape)) if qkv else full
    local = t.to_local()
    shape = _qkv_shape(t.shape) if qkv else tuple(t.shape)
    local = local.view(_qkv_shape(local.shape)) if qkv else local
    return DTensor.from_local(local, t.device_mesh, places, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


@torch.no_grad()
def _assign(live: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a loaded (possibly viewed, possibly full) tensor into ``live``, keeping ``live``'s placement."""
    if isinstance(loaded, DTensor):
        src = loaded.to_local()
    elif isinstance(live, DTensor):
        src = _local_shard(loaded.reshape(live.shape).to(live.dtype), live)
    else:
        src = loaded
    dst = live.to_local() if isinstance(live, DTensor) else live
    if src.data_ptr() != dst.data_ptr() or src.numel() != dst.numel():
        dst.copy_(src.reshape(dst.shape))


def _local_shard(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's shard of ``full`` in ``like``'s placement: sliced locally (torch >= 2.7), else scattered
    from rank 0 (every rank calls this in the same order)."""
    try:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    except TypeError:
        return distribute_tensor(full, like.device_mesh, like.placements).to_local()


# ---- what a module and its optimizers hold -------------------------------------------------------------------


def _aliases(state: dict[str, Any]) -> dict[str, str]:
    """``{alias: first key}`` for entries that are the same tensor object (tied weights), from a
    ``state_dict(keep_vars=True)``."""
    seen: dict[int, str] = {}
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                out[key] = seen[id(value)]
            else:
                seen[id(value)] = key
    return out


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


@torch.no_grad()
def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)``: the live (sharded) tensors, tied ones recognised by identity; a
    parameter FSDP cut in a way no box describes (:func:`~lightning_tp2d.fsdp.stage0_specs`) in its stage-0 form
    (gathered over ``data_parallel``: a collective), so every stage writes the same checkpoint."""
    state = module.state_dict(keep_vars=True)
    specs = stage0_specs(module)
    gathered = {}  # by identity: tied keys keep sharing one tensor
    for key in [k for k in state if k in specs]:
        value = state[key]
        if id(value) not in gathered:
            gathered[id(value)] = specs[key].gather(value.detach())
        state[key] = gathered[id(value)]
    return state


def full_model_state(module: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Full plain tensors of ``module.state_dict()`` on ``rank`` 0 (empty elsewhere); a collective, one parameter
    at a time, so no rank holds more than one full tensor it does not keep. Tied keys share one tensor."""
    state = sharded_model_state(module)
    aliases = _aliases(state)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in aliases:
            continue
        full = _full(value) if isinstance(value, torch.Tensor) else value
        if rank == 0:
            out[key] = full.cpu() if isinstance(full, torch.Tensor) else full
    if rank == 0:
        out.update({alias: out[key] for alias, key in aliases.items()})
        return {key: out[key] for key in state}
    return {}


def _named_param_groups(names: dict[int, str], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with parameter names for ``params`` (with ZeRO-1 the full parameters)."""
    full_groups = full_param_groups(optimizer)
    if any(id(p) not in names for g in full_groups for p in g):
        raise ValueError("the optimizer holds parameters that are not in the LightningModule")
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in full]}
            for g, full in zip(optimizer.param_groups, full_groups)]


def _stage0_fields(fields: dict[str, Any], spec) -> dict[str, Any]:
    """``fields`` (one parameter's optimizer state) with each DTensor of the parameter's shape in its stage-0 form
    when FSDP cut the parameter in a way no box describes (``spec``: its :class:`~lightning_tp2d.fsdp.Stage0`, a
    gather over ``data_parallel``: a collective); as they are when ``spec`` is ``None``."""
    if spec is None:
        return fields
    return {k: spec.gather(v) if isinstance(v, DTensor) and tuple(v.shape) == spec.shape else v
            for k, v in fields.items()}


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {param name: {field: tensor}}, "param_groups": [{..., "params": [names]}]}`` with live
    (sharded) tensors, each parameter's state in its stage-0 form: with ZeRO-1 the sliced ones gathered over
    ``data_parallel`` (a collective; for the save every rank holds their replicated state, as at stage 0), FSDP's
    unboxed cuts gathered too (:func:`~lightning_tp2d.fsdp.stage0_specs`), the rest as they are."""
    names = _param_names(module)
    groups = _named_param_groups(names, optimizer)
    sharding = sharding_of(optimizer)
    if sharding is not None:
        state = {names[id(p)]: fields for p in sharding.params if (fields := sharding.full_state(p))}
    else:
        state = {names[id(p)]: dict(s) for p, s in optimizer.state.items()}
    specs = stage0_specs(module)
    return {"state": {name: _stage0_fields(fields, specs.get(name)) for name, fields in state.items()},
            "param_groups": groups}


@torch.no_grad()
def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """torch's ``optimizer.state_dict()`` format with full plain tensors and ``param_names``, on rank 0 (a
    collective; empty on the other ranks). With ZeRO-1 each parameter's state is gathered over ``data_parallel``
    one parameter at a time (in its stage-0 form, as :func:`sharded_optimizer_state` gives it)."""
    sharding = sharding_of(optimizer)
    sharded = (sharded_optimizer_state(module, optimizer) if sharding is None else
               {"state": {}, "param_groups": _named_param_groups(_param_names(module), optimizer)})
    order = [name for g in sharded["param_groups"] for name in g["params"]]
    specs = stage0_specs(module) if sharding is not None else {}
    state = {}
    for index, name in enumerate(order):
        if sharding is not None:
            fields = _stage0_fields(sharding.full_state(sharding.params[index]), specs.get(name)) or None
        else:
            fields = sharded["state"].get(name)
        if fields is not None:
            full = {k: (_full(v).cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
            state[index] = full
    if rank != 0:
        return {}
    groups, start = [], 0
    for g in sharded["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": list(range(start, start + n)), "param_names": list(g["params"])})
        start += n
    return {"state": state, "param_groups": groups}


# ---- writing -------------------------------------------------------------------------------------------------


def write_sharded(checkpoint: dict[str, Any], directory: Path, rank: int) -> None:
    """Every rank: its shards of the model and optimizer states into ``directory`` (DCP); rank 0 also the rest
    of ``checkpoint`` (``state_dict`` from ``state_dict(keep_vars=True)``, ``optimizer_states`` from
    :func:`sharded_optimizer_state`)."""
    state = checkpoint.pop("state_dict")
    optim_states = checkpoint.pop("optimizer_states", [])
    aliases = _aliases(state)
    payload = {MODEL + k: box_view(v, _is_qkv(k)) for k, v in state.items()
               if k not in aliases and isinstance(v, torch.Tensor)}
    groups = []
    for i, optim in enumerate(optim_states):
        for name, fields in optim["state"].items():
            for field, v in fields.items():
                if isinstance(v, torch.Tensor):
                    qkv = _is_qkv(name) and v.dim() > 0
                    payload[f"optimizer_{i}.{name}.{field}"] = box_view(v, qkv)
        groups.append(optim["param_groups"])
    with _single_process_quiet():
        _dcp_save(payload, checkpoint_id=str(directory), no_dist=not torch.distributed.is_initialized())
    if checkpoint.get("tp2d_partial"):  # pipeline stages: each rank holds part of the model; rank 0 writes them all
        aliases, groups = _merged_parts(aliases, groups)
    if rank == 0:
        meta = {**checkpoint, "tp2d_aliases": aliases, "tp2d_optimizer_param_groups": groups}
        torch.save(meta, directory / META)


def _merged_parts(aliases: dict[str, str], groups: list[list[dict]]) -> tuple[dict[str, str], list[list[dict]]]:
    """Every rank's tied-key aliases and each optimizer's parameter groups' names, merged (a collective; ``groups``
    per optimizer, per group): a pipeline stage holds
    only its own parameters, so rank 0's alone would not describe the model. Names keep their first rank's order
    (stage 0's first: the plain model's order)."""
    parts = gather_objects((aliases, groups))
    merged_aliases = {k: v for part_aliases, _ in parts for k, v in part_aliases.items()}
    merged = [[{**group, "params": list(dict.fromkeys(n for _, part in parts for n in part[o][g]["params"]))}
               for g, group in enumerate(optimizer_groups)] for o, optimizer_groups in enumerate(groups)]
    return merged_aliases, merged


def write_full(checkpoint: dict[str, Any], file: Path) -> None:
    torch.save(checkpoint, file)


def own_files(directory: Path, rank: int) -> list[Path]:
    """The shard files rank ``rank`` wrote into a sharded checkpoint (DCP names them ``__<rank>_<i>.distcp``)."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def _planned_bytes(checkpoint: dict[str, Any], sharded: bool, rank: int) -> int:
    """About the bytes this rank writes: its local shards (sharded), or every full tensor (rank 0 of a full save)."""
    if not sharded and rank != 0:
        return 0
    total, seen, todo = 0, set(), [checkpoint]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo += list(value.values())
        elif isinstance(value, (list, tuple)):
            todo += list(value)
        elif isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


def save(checkpoint: dict[str, Any], path: Path, *, rank: int, sharded: bool,
         barrier: Callable[[str], None] = lambda name: None,
         all_gather: Callable[[Any], list] = gather_objects) -> None:
    """Write ``checkpoint`` to ``path`` the crash-safe way (:func:`~lightning_tp2d.safe_files.save_staged`): every
    rank its shards into a staging directory (``sharded``), or rank 0 one full file. Every rank calls it;
    ``barrier`` and ``all_gather`` are the job's collectives. A failure on any rank leaves the previous checkpoint
    and raises :class:`CheckpointError` on every rank. What is not a tensor is written as plain data
    (:func:`~lightning_tp2d.trust.to_plain`), so the checkpoint loads with ``weights_only=True``; a value that would
    not (a user's own class) is named in a warning."""
    checkpoint = to_plain(checkpoint)  # new containers, the same tensors (tied ones stay tied)
    if rank == 0:
        warn_untrusted(checkpoint, path)  # tensors are passed over, the rest tried as data

    def write(staging: Path) -> dict[str, dict]:
        if sharded:
            write_sharded(checkpoint, staging, rank)
            return {f.name: file_digest(f) for f in own_files(staging, rank)}
        if rank == 0:
            write_full(checkpoint, staging)
        return {}

    save_staged(write, path, rank=rank, directory=sharded, checksummed=(".metadata", META), barrier=barrier,
                all_gather=all_gather, planned_bytes=_planned_bytes(checkpoint, sharded, rank))


# ---- reading -------------------------------------------------------------------------------------------------


def _cannot_read(path: Path, err: BaseException) -> CheckpointError:
    where = path / META if is_sharded(path) else path
    return CheckpointError(f"checkpoint {str(path)!r} cannot be read ({str(where)!r}: {describe_failure(err)}): it is "
                           "damaged, truncated or not one of this package's checkpoints")


def open_checkpoint(path: Path, *, trust_checkpoint: bool = False, verify: bool | str = True, rank: int = 0,
                    world_size: int = 1, all_gather: Callable[[list], list] | None = None) -> dict[str, Any]:
    """Check a checkpoint (resolved path) and read its non-tensor part as data: the checksums first
    (:func:`~lightning_tp2d.safe_files.verify`; ``verify="quick"``: sizes and small files only, ``False``: none),
    then for a sharded one DCP's ``.metadata`` through the restricted unpickler, and ``meta.pt`` (or the whole
    single file, memory-mapped) with ``weights_only=True`` (:mod:`lightning_tp2d.trust`). ``trust_checkpoint``:
    the pickles load the old way, with a warning. Raises :class:`CheckpointError` naming the damaged file, or
    :class:`~lightning_tp2d.trust.UntrustedCheckpointError` naming the global a file asked for."""
    if verify:
        safe_files.verify(path, rank, world_size, all_gather, quick=verify == "quick")
    sharded = is_sharded(path)
    if sharded and not trust_checkpoint:
        check_dcp_metadata(path)
    try:
        meta = load_data(path / META if sharded else path, trust=trust_checkpoint, mmap=not sharded)
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling fails in many ways on a damaged file
        raise _cannot_read(path, err) from None
    if not isinstance(meta, dict) or (not sharded and "state_dict" not in meta):
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
    return meta


def saved_step(path: str | os.PathLike, *, trust_checkpoint: bool = False, verify: bool | str = "quick") -> int:
    """The optimizer step a checkpoint (sharded directory or file) was saved at, read without loading its tensors
    (``meta.pt`` of a directory; a file memory-mapped), after a quick check (:func:`open_checkpoint`). Raises
    :class:`CheckpointError` naming a damaged, unreadable or untrusted one."""
    path = resolve(path)
    meta = open_checkpoint(path, trust_checkpoint=trust_checkpoint, verify=verify)
    try:
        return int(meta["global_step"])
    except (KeyError, TypeError, ValueError) as err:
        raise _cannot_read(path, err) from None


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def _stored_tensors(path: Path) -> dict[str, Any]:
    """DCP's record of a sharded checkpoint: ``{key: TensorStorageMetadata}`` (full shape and dtype)."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def check_compatible(model: dict[str, tuple], stored: dict[str, tuple], strict: bool, path) -> None:
    """Raise ValueError naming the keys that differ between a model and a checkpoint (full shapes)."""
    missing = [k for k in model if k not in stored]
    unexpected = [k for k in stored if k not in model]
    misshaped = [f"{k}: checkpoint {tuple(stored[k])}, model {tuple(model[k])}"
                 for k in model if k in stored and tuple(stored[k]) != tuple(model[k])]
    problems = ([f"missing in checkpoint: {missing}"] if missing and strict else []) + \
               ([f"not in model: {unexpected}"] if unexpected and strict else []) + \
               ([f"different shapes: {misshaped}"] if misshaped else [])
    if problems:
        raise ValueError(f"checkpoint {str(path)!r} does not fit this model:\n  " + "\n  ".join(problems))


def load_into(module: nn.Module, optimizers: list, path, strict: bool = True, *, trust_checkpoint: bool = False,
              verify: bool = True, partial: bool = False) -> dict[str, Any]:
    """Load a checkpoint of either format into a live (parallelized or plain) module and its optimizers, in
    place; return the rest of the checkpoint (loops, schedulers, ...) for Lightning. Every rank calls it. The files
    are checked first and their pickles read as data (:func:`open_checkpoint`). ``partial`` (sharded checkpoints;
    a pipeline stage, :mod:`lightning_tp2d.pipeline`): ``module`` is one part of the saved model, so the
    checkpoint's other keys are the other parts' (``strict`` then checks that every rank's parts together hold
    every stored key, a collective)."""
    path = resolve(path)
    if not (is_sharded(path) or path.is_file()):
        raise ValueError(f"{str(path)!r} is neither a sharded checkpoint directory (no .metadata) nor a file")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
    meta = open_checkpoint(path, trust_checkpoint=trust_checkpoint, verify=verify, rank=rank, world_size=world,
                           all_gather=gather_objects)
    if is_sharded(path):
        return _load_sharded(module, optimizers, path, strict, meta, partial)
    if partial:
        raise ValueError(f"{str(path)!r}: pipeline stages load sharded checkpoints (a directory); a full file "
                         f"loads into one stage count only through a sharded save")
    return _load_full(module, optimizers, path, strict, meta)


def _live_model(module: nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict(keep_vars=True)
    aliases = _aliases(state)
    return {k: v for k, v in state.items() if k not in aliases and isinstance(v, torch.Tensor)}


def _load_sharded(module, optimizers, path: Path, strict: bool, meta: dict[str, Any],
                  partial: bool = False) -> dict[str, Any]:
    stored = _stored_tensors(path)
    live = _live_model(module)
    shapes = {k[len(MODEL):]: _unview_shape(k, md.size) for k, md in stored.items() if k.startswith(MODEL)}
    shapes.update({alias: shapes[key] for alias, key in meta.get("tp2d_aliases", {}).items() if key in shapes})
    model_shapes = _model_shapes(module)
    if partial:  # this rank's keys must be stored with their shapes; together the ranks must hold every stored key
        check_compatible(model_shapes, {k: v for k, v in shapes.items() if k in model_shapes}, strict, path)
        held = set().union(*gather_objects(set(model_shapes)))
        if strict and set(shapes) - held:
            raise ValueError(f"checkpoint {str(path)!r} does not fit this model:\n  not in any pipeline stage: "
                             f"{sorted(set(shapes) - held)}")
    else:
        check_compatible(model_shapes, shapes, strict, path)
    specs = stage0_specs(module)  # FSDP's unboxed cuts: loaded in their stage-0 form, then cut
    stage0 = {k: specs[k].empty(v.dtype, v.device) for k, v in live.items() if k in specs and k in shapes}
    targets = {MODEL + k: box_view(stage0.get(k, v.detach()), _is_qkv(k)) for k, v in live.items() if k in shapes}
    params = {name: p for name, p in module.named_parameters()}
    optim_targets: list[dict[str, torch.Tensor]] = []
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}."
        fields = {}
        for key, md in stored.items():
            if not key.startswith(prefix):
                continue
            name, field = key[len(prefix):].rsplit(".", 1)
            if name not in params:
                if strict and not partial:  # (partial: another stage's parameter)
                    raise ValueError(f"checkpoint {str(path)!r} has optimizer state for {name!r}, not in this model")
                continue
            p = params[name]
            like_param = _unview_shape(key, md.size) == tuple(p.shape) and len(md.size) > 0
            if like_param and name in specs:
                value = specs[name].empty(md.properties.dtype, p.device)
            elif like_param:
                value = torch.zeros_like(p.detach(), dtype=md.properties.dtype)
            else:
                value = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
            fields[key] = (name, field, value)
            targets[key] = box_view(value, _is_qkv(name) and like_param)
        optim_targets.append(fields)
    with _single_process_quiet():
        dcp.load(targets, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    for k, v in live.items():
        if k in stage0:
            v.detach().to_local().copy_(specs[k].chunk(stage0[k]))
        elif MODEL + k in targets:
            _assign(v, targets[MODEL + k])
    for i, optimizer in enumerate(optimizers):
        sharding = sharding_of(optimizer)
        for key, (name, field, value) in optim_targets[i].items():
            p = params[name]
            if name in specs and isinstance(value, DTensor) and value.placements == specs[name].placements:
                value = DTensor.from_local(specs[name].chunk(value).clone(), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride())
            else:
                _assign(value, targets[key])
            if sharding is not None:  # ZeRO-1: this replica's slice, under its slice of the parameter (FSDP's
                optimizer.state[sharding.shard_of(p)][field] = sharding.owned_slice(p, value)  # as they are)
            else:
                optimizer.state[p][field] = value
        _load_param_groups(optimizer, meta["tp2d_optimizer_param_groups"][i], params, path, partial)
    return {k: v for k, v in meta.items() if not k.startswith("tp2d_")}


def _load_param_groups(optimizer, saved: list[dict], params: dict[str, torch.Tensor], path,
                       partial: bool = False) -> None:
    names = {id(p): n for n, p in params.items()}
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {str(path)!r}: optimizer has {len(optimizer.param_groups)} parameter groups, "
                         f"checkpoint {len(saved)}")
    for group, full, old in zip(optimizer.param_groups, full_param_groups(optimizer), saved):
        old_names = old.get("param_names", old["params"])
        new_names = [names[id(p)] for p in full]
        if partial:  # a pipeline stage's group: the saved group's names in their order, those this stage holds
            old_names = [n for n in old_names if n in set(new_names)]
        if all(isinstance(n, str) for n in old_names) and list(old_names) != new_names:
            raise ValueError(f"checkpoint {str(path)!r}: optimizer parameter groups differ: saved {old_names}, "
                             f"model {new_names}")
        group.update({k: v for k, v in old.items() if k not in ("params", "param_names")})


def _load_full(module, optimizers, path: Path, strict: bool, checkpoint: dict[str, Any]) -> dict[str, Any]:
    state = checkpoint.pop("state_dict")
    live = _live_model(module)
    check_compatible(_model_shapes(module), {k: tuple(v.shape) for k, v in state.items()}, strict, path)
    specs = stage0_specs(module)
    for k, v in live.items():
        if k in state and k in specs:  # FSDP's unboxed cut: the stage-0 shard, then this rank's dp chunk
            v.detach().to_local().copy_(specs[k].chunk(_stage0_of(state[k], specs[k], v.dtype)))
        elif k in state:
            _assign(v, state[k])
    params = {name: p for name, p in module.named_parameters()}
    names = {id(p): n for n, p in params.items()}
    for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
        order = [p for g in full_param_groups(optimizer) for p in g]
        sharding = sharding_of(optimizer)
        saved_order = [i for g in saved["param_groups"] for i in g["params"]]
        if len(order) != len(saved_order):
            raise ValueError(f"checkpoint {str(path)!r}: optimizer holds {len(saved_order)} parameters, "
                             f"this one {len(order)}")
        _load_param_groups(optimizer, saved["param_groups"], params, path)
        for param, index in zip(order, saved_order):
            if index not in saved["state"]:
                continue
            fields = {}
            for field, v in saved["state"][index].items():
                spec = specs.get(names.get(id(param)))
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape) and v.dim() > 0 and spec:
                    fields[field] = DTensor.from_local(spec.chunk(_stage0_of(v, spec, v.dtype)).clone(),
                                                       param.device_mesh, param.placements, shape=param.shape,
                                                       stride=param.stride())
                elif isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape) and v.dim() > 0:
                    fields[field] = torch.zeros_like(param.detach(), dtype=v.dtype)
                    _assign(fields[field], v)
                else:
                    fields[field] = v.clone() if isinstance(v, torch.Tensor) else v
            if sharding is not None:  # ZeRO-1: this replica's slices, under its slice of the parameter (FSDP's:
                fields = {k: sharding.owned_slice(param, v) for k, v in fields.items()}  # its own, as they are)
                param = sharding.shard_of(param)
            optimizer.state[param] = fields
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _stage0_of(full: torch.Tensor, spec, dtype: torch.dtype) -> DTensor:
    """This rank's stage-0 shard of a full plain tensor (``spec``: :class:`~lightning_tp2d.fsdp.Stage0`)."""
    like = spec.empty(dtype, "cpu")
    local = _local_shard(full.reshape(spec.shape).to(dtype), like)
    return DTensor.from_local(local, spec.mesh, spec.placements, shape=torch.Size(spec.shape), stride=spec.stride)


def _model_shapes(module: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


# ---- plain use: one process, no mesh ------------------------------------------------------------------------


def read_state_dict(path, *, trust_checkpoint: bool = False, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint of either format, as plain tensors under the LightningModule's
    keys (tied keys included), after the checks of :func:`open_checkpoint`. Needs no process group."""
    path = resolve(path)
    meta = open_checkpoint(path, trust_checkpoint=trust_checkpoint, verify=verify)
    if not is_sharded(path):
        return meta["state_dict"]
    targets = {k: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
               for k, md in _stored_tensors(path).items() if k.startswith(MODEL)}
    with _single_process_quiet():
        dcp.load(targets, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    out = {k[len(MODEL):]: v.reshape(_unview_shape(k, v.shape)) for k, v in targets.items()}
    out.update({alias: out[key] for alias, key in meta.get("tp2d_aliases", {}).items()})
    return out
