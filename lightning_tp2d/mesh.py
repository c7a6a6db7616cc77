"""Parallel sizes, their validation, and the named device mesh.

A TP2D job runs ``world = dp * p`` ranks. For the 2-D layouts the ``p = q * q`` ranks of one model replica
form a ``q x q`` grid; the mesh has axes ``("data_parallel", "row", "col")`` and global rank
``d * p + r * q + c`` sits at grid position ``(r, c)`` of replica ``d`` (tensor-parallel groups are
contiguous, so a grid stays inside one node whenever ``p`` divides the GPUs per node). The METP ring layout
uses axes ``("data_parallel", "ring")``.

Everything here validates *before* any process-group work, so a bad configuration raises a ``ValueError``
naming the numbers instead of hanging in a collective.

The process groups of the meshes :func:`init_mesh` builds end before the interpreter does
(:func:`release_process_groups`, run at exit): a gloo group left to interpreter shutdown can abort a process whose
work finished.
"""

from __future__ import annotations

import atexit
import gc
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_tp2d.layouts import DEFAULT_LAYOUT, Layout, get_layout
from lightning_tp2d.ops import register_mesh
from lightning_tp2d.train_plan import TrainPlan


ParallelDims = TrainPlan  # the sizes of one run (lightning_tp2d.train_plan.ParallelDims), at its older import path


def device_type_for_backend(backend: str) -> str:
    return "cuda" if "nccl" in backend else "cpu"


def as_timeout(timeout: timedelta | float | int | None) -> timedelta | None:
    """``timeout`` as a ``timedelta`` (numbers are seconds); ``None`` stays ``None``. Refuses non-positive values."""
    if timeout is None or isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=timeout)
    else:
        raise ValueError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if value is not None and value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds()} s")
    return value


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group``'s backend was created with (the default group when ``None``), if torch tells it."""
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    try:
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _timeout_override(names: tuple[str, ...], timeout: timedelta | None) -> dict | None:
    """``init_device_mesh``'s ``backend_override`` giving every axis group ``timeout`` (torch otherwise creates
    them with its 30-minute default, whatever the default group was given)."""
    if timeout is None:
        return None
    backend = str(dist.get_backend())
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return {name: options for name in names}


def init_mesh(layout: str | Layout = DEFAULT_LAYOUT, tensor_parallel_size: int = 4, data_parallel_size: int = 1,
              device_type: str | None = None, timeout: timedelta | float | None = None, *,
              pipeline_parallel_size: int = 1) -> DeviceMesh:
    """Build the layout's :class:`DeviceMesh` over the already-initialised default process group.

    ``pipeline_parallel_size`` > 1 adds the outermost ``"pipeline"`` axis: ``pp`` stages, each a ``dp x p`` mesh of
    its own (:mod:`lightning_tp2d.pipeline` slices it per stage).

    ``device_type`` defaults from the backend (``cuda`` for NCCL, ``cpu`` otherwise). ``timeout`` (a ``timedelta``
    or seconds) bounds every collective of every axis group; by default the axis groups get the default group's
    timeout (the one given to ``init_process_group``). Raises ``ValueError`` before creating any group when the
    sizes do not fit the world.
    """
    timeout = as_timeout(timeout)
    dims = TrainPlan(layout, tensor_parallel_size, data_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_mesh needs an initialised process group: call torch.distributed.init_process_group first")
    dims.check_world_size(dist.get_world_size())
    if device_type is None:
        device_type = device_type_for_backend(str(dist.get_backend()))
    override = _timeout_override(dims.mesh_dim_names, timeout if timeout is not None else group_timeout())
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names,
                            **({"backend_override": override} if override else {}))
    register_mesh(mesh)
    _end_with_process(mesh)
    return mesh


# ---- the end of a process --------------------------------------------------------------------------------------

RELEASE_TIMEOUT_S = 5.0  # how long the exit waits for the groups' worker threads (milliseconds when they are idle)
_BUILT: weakref.WeakSet = weakref.WeakSet()  # the meshes init_mesh built, while anything holds them
_AT_EXIT = threading.Lock()  # taken once, when release_process_groups is registered with atexit


def _end_with_process(mesh: DeviceMesh) -> None:
    _BUILT.add(mesh)
    if _AT_EXIT.acquire(blocking=False):
        atexit.register(release_process_groups)


def release_process_groups(timeout: float = RELEASE_TIMEOUT_S) -> bool:
    """End the process groups of the meshes :func:`init_mesh` built, now, while the interpreter is whole (run at
    exit; callable earlier). Returns whether they ended within ``timeout`` seconds.

    Why: a gloo worker thread frees each collective's work after completing it, and the work may hold the last
    reference to a tensor that has a Python object (an intermediate of ``DTensor.full_tensor()``, a gathered
    panel); freeing it takes the GIL. A thread that asks for the GIL after the interpreter began to finalise is
    ended mid-destructor, and the process aborts ("terminate called without an active exception", SIGABRT) after its
    script has finished: the README's own-loop example did so in about half of its runs with ``gpt2`` on 4 CPU
    processes (gdb: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``take_gil`` ->
    ``pthread_exit`` during ``Py_FinalizeEx``). ``dist.destroy_process_group()`` does not prevent it: a
    ``DeviceMesh`` keeps its groups (``_pg_registry``), and a model's DTensors keep the mesh, so the groups and their
    worker threads lived on to interpreter shutdown.

    What it does, in a thread of its own (so a worker stuck in a collective with a dead peer delays the exit by
    ``timeout`` at most, never hangs it): destroys the default process group when its backend is gloo (local: no
    collective) and torch's groups are not destroyed yet, then drops the meshes' references to their destroyed
    groups. Each group's destructor then joins its worker threads with the GIL released, so a worker that still has
    a tensor to free gets the GIL and finishes. NCCL groups are left to their owner (``destroy_process_group``
    aborts NCCL communicators and is the user's call)."""
    meshes = list(_BUILT)
    if not meshes:
        return True

    def release() -> None:
        if dist.is_available() and dist.is_initialized() and str(dist.get_backend()) == "gloo":
            dist.destroy_process_group()
        if dist.is_available() and dist.is_initialized():
            return  # a backend this does not end (NCCL): the groups stay theirs
        for mesh in meshes:
            groups = getattr(mesh, "_pg_registry", None)  # torch 2.13; older meshes hold names only
            if isinstance(groups, dict):
                groups.clear()
        gc.collect()

    worker = threading.Thread(target=release, name="tp2d-release-process-groups", daemon=True)
    worker.start()
    worker.join(timeout)
    return not worker.is_alive()


def parallel_dims_of(mesh: DeviceMesh, layout: str | Layout) -> TrainPlan:
    """Recover the sizes (a :class:`~lightning_tp2d.train_plan.TrainPlan`) a mesh was built for, checking its axis
    names."""
    spec = get_layout(layout)
    p, dp = spec.sizes_of_mesh(mesh)
    return TrainPlan(spec, p, dp)


def grid_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's ``(row, col)`` position on the grid."""
    return mesh.get_local_rank("row"), mesh.get_local_rank("col")


def transpose_peer(mesh: DeviceMesh) -> int:
    """Global rank of this rank's mirror ``(col, row)`` in the same data-parallel replica (itself on the diagonal)."""
    r, c = grid_coords(mesh)
    # the col group of this rank's row holds (r, 0..q-1); its member at col r is (r, r); the mirror (c, r) is in
    # the row group (same col) of (r, r)... a two-hop lookup. With init_mesh's row-major layout it is arithmetic
    # (global rank d*p + r*q + c), and needs no tensor indexing (so it also runs under a fake-tensor trace).
    q = mesh.size(mesh.mesh_dim_names.index("col"))
    return dist.get_rank() + (c - r) * q + (r - c)
