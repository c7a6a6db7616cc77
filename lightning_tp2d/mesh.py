"""Parallel sizes, their validation, and the named device mesh.

A TP2D job runs ``world = dp * p`` ranks. For the 2-D layouts the ``p = q * q`` ranks of one model replica
form a ``q x q`` grid; the mesh has axes ``("data_parallel", "row", "col")`` and global rank
``d * p + r * q + c`` sits at grid position ``(r, c)`` of replica ``d`` (tensor-parallel groups are
contiguous, so a grid stays inside one node whenever ``p`` divides the GPUs per node). The METP ring layout
uses axes ``("data_parallel", "ring")``.

Everything here validates *before* any process-group work, so a bad configuration raises a ``ValueError``
naming the numbers instead of hanging in a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

LAYOUTS = ("2d", "metp", "2d-metp")
GRID_LAYOUTS = ("2d", "2d-metp")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one run: ``layout``, tensor-parallel size ``p`` and data-parallel size ``dp``."""

    layout: str
    tensor_parallel_size: int  # p: ranks that share one model replica (q*q for the grid layouts)
    data_parallel_size: int = 1  # dp: model replicas, each fed its own batches

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {list(LAYOUTS)}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.layout in GRID_LAYOUTS:
            q = math.isqrt(self.tensor_parallel_size)
            if q * q != self.tensor_parallel_size:
                near = sorted({math.isqrt(self.tensor_parallel_size) ** 2, (math.isqrt(self.tensor_parallel_size) + 1) ** 2})
                raise ValueError(
                    f"layout {self.layout!r} needs a square tensor_parallel_size (q x q grid); "
                    f"{self.tensor_parallel_size} is not a perfect square (nearest: {near})"
                )

    @property
    def q(self) -> int:
        """Side of the grid (``p = q*q``); for the ring layout, the ring size ``p``."""
        return math.isqrt(self.tensor_parallel_size) if self.layout in GRID_LAYOUTS else self.tensor_parallel_size

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("data_parallel", "row", "col") if self.layout in GRID_LAYOUTS else ("data_parallel", "ring")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.layout in GRID_LAYOUTS:
            return (self.data_parallel_size, self.q, self.q)
        return (self.data_parallel_size, self.tensor_parallel_size)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != data_parallel_size {self.data_parallel_size} x "
                f"tensor_parallel_size {self.tensor_parallel_size} = {self.world_size}"
            )

    def check_model(self, n_head: int, n_embd: int) -> None:
        """Heads and hidden size must split evenly over the ``col`` axis (or the ring)."""
        q = self.q
        bad = [f"{name}={value} is not divisible by q={q}" for name, value in (("n_head", n_head), ("n_embd", n_embd))
               if value % q]
        if bad:
            fits = _divisors(math.gcd(n_head, n_embd))
            raise ValueError(f"layout {self.layout!r}: " + "; ".join(bad) + f"; use q in {fits}")


def device_type_for_backend(backend: str) -> str:
    return "cuda" if "nccl" in backend else "cpu"


def init_mesh(layout: str = "2d", tensor_parallel_size: int = 4, data_parallel_size: int = 1,
              device_type: str | None = None) -> DeviceMesh:
    """Build the layout's :class:`DeviceMesh` over the already-initialised default process group.

    ``device_type`` defaults from the backend (``cuda`` for NCCL, ``cpu`` otherwise). Raises ``ValueError``
    before creating any group when the sizes do not fit the world.
    """
    dims = ParallelDims(layout, tensor_parallel_size, data_parallel_size)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_mesh needs an initialised process group: call torch.distributed.init_process_group first")
    dims.check_world_size(dist.get_world_size())
    if device_type is None:
        device_type = device_type_for_backend(str(dist.get_backend()))
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)


def parallel_dims_of(mesh: DeviceMesh, layout: str) -> ParallelDims:
    """Recover the :class:`ParallelDims` a mesh was built for, checking its axis names."""
    names = tuple(mesh.mesh_dim_names or ())
    expected = ParallelDims(layout, 1).mesh_dim_names
    if names != expected:
        raise ValueError(f"layout {layout!r} needs a mesh with axes {expected}, got {names}")
    shape = tuple(mesh.shape)
    if layout in GRID_LAYOUTS:
        if shape[1] != shape[2]:
            raise ValueError(f"grid mesh must be square, got row={shape[1]} x col={shape[2]}")
        return ParallelDims(layout, shape[1] * shape[2], shape[0])
    return ParallelDims(layout, shape[1], shape[0])


def grid_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's ``(row, col)`` position on the grid."""
    return mesh.get_local_rank("row"), mesh.get_local_rank("col")


def transpose_peer(mesh: DeviceMesh) -> int:
    """Global rank of this rank's mirror ``(col, row)`` in the same data-parallel replica (itself on the diagonal)."""
    r, c = grid_coords(mesh)
    return int(mesh.mesh[mesh.get_local_rank("data_parallel"), c, r])
