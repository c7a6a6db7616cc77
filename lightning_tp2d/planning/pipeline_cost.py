"""What pipeline stages cost: the schedule's bubble, the activations each stage keeps in flight, the point-to-point
bytes at its boundaries, and the step time they make of one stage's work (:mod:`lightning_tp2d.pipeline` runs them
with torch's schedules; the planner prices both sides with these, the 1-D baseline as torchtitan runs it).

The model of a step, stated once:

* A rank's stages do ``m x v`` micro-batch chunks of work (``m`` micro-batches, ``v`` virtual stages per rank), each
  a forward and a backward of ``1 / (m v)`` of its whole batch through its blocks: ``t_chunk = T_stage / (m v)``,
  ``T_stage`` the time of the rank's blocks for its whole batch (compute and the layout's own communication).
* The schedules (GPipe, 1F1B, interleaved 1F1B) all take ``m v + pp - 1`` chunk slots on the slowest rank: the
  step is ``(m v + pp - 1) x (t_chunk + t_boundary)``. The idle share, the bubble, is
  :func:`bubble_fraction` ``= (pp - 1) / (m v + pp - 1)`` of the step (interleaving divides the warm-up by ``v``).
* Each chunk sends its activation shard to the next stage in the forward and receives its gradient in the backward
  (``2`` transfers of ``micro-batch x seq x h / p`` elements per chunk and boundary; :func:`boundary_bytes`). torch's
  stages post them as ``isend`` / ``irecv`` but the receiving chunk waits for its input: priced **not overlapped**,
  ``t_boundary`` on the chunk's critical path (:func:`pipeline_step_time`).
* Memory (:func:`in_flight`): GPipe keeps all ``m`` micro-batches' activations; 1F1B at most ``pp - s`` on stage
  ``s`` (the first stage the most: ``min(pp, m)``); interleaved 1F1B torch's warm-up count
  (``(v - 1) pp + 2 (pp - 1 - r)`` chunk forwards on rank ``r``, each ``1 / v`` of the rank's blocks).

Stands on nothing but arithmetic (no torch): the planner and the schedule benchmark
(``recipes/benchmarks/pipeline_bubble.py``) read the same functions.
"""

from __future__ import annotations

from lightning_tp2d.train_plan import PP_SCHEDULES

__all__ = ["boundary_bytes", "bubble_fraction", "chunk_slots", "in_flight", "pipeline_step_time"]


def _check(pp: int, microbatches: int, virtual_stages: int, schedule: str) -> None:
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {list(PP_SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved_1f1b', got {schedule!r}")


def chunk_slots(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> int:
    """Chunk slots of a step on the slowest rank: ``m v + pp - 1`` (module docstring)."""
    _check(pp, microbatches, virtual_stages, schedule)
    return microbatches * virtual_stages + pp - 1


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """The share of a step each rank idles: ``(pp - 1) / (m v + pp - 1)``; 0 without stages."""
    return (pp - 1) / chunk_slots(pp, microbatches, virtual_stages, schedule)


def in_flight(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b", rank: int = 0) -> float:
    """How many micro-batches' activations of the rank's blocks (all ``v`` of its stages) ``rank`` keeps at its peak:
    GPipe ``m``; 1F1B ``min(pp - rank, m)``; interleaved 1F1B ``min(w + 1, m v) / v`` with torch's warm-up
    ``w = (v - 1) pp + 2 (pp - 1 - rank)`` chunk forwards (each chunk ``1 / v`` of the rank's blocks)."""
    _check(pp, microbatches, virtual_stages, schedule)
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} is not a pipeline rank of {pp}")
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(pp - rank, microbatches))
    warmup = (virtual_stages - 1) * pp + 2 * (pp - 1 - rank)
    return min(warmup + 1, microbatches * virtual_stages) / virtual_stages


def boundary_bytes(micro_batch: int, seq: int, hidden: int, p: int, elem: float, microbatches: int,
                   virtual_stages: int = 1) -> float:
    """Bytes a middle rank sends per step across its boundaries: each of its ``m v`` chunks sends its activation
    shard forward (``micro_batch x seq x hidden / p`` elements of ``elem`` bytes) and its input's gradient back
    (the same); it receives as much."""
    shard = micro_batch * seq * hidden / p * elem
    return 2.0 * shard * microbatches * virtual_stages


def pipeline_step_time(stage_seconds: float, boundary_seconds: float, pp: int, microbatches: int,
                       virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """One step of ``pp`` stages: ``(m v + pp - 1) x (stage_seconds / (m v) + boundary_seconds)``.
    ``stage_seconds``: the slowest rank's blocks for its whole batch; ``boundary_seconds``: one chunk's two
    transfers (forward activation, backward gradient), on its critical path. ``pp = 1``: ``stage_seconds``."""
    if pp == 1:
        return stage_seconds
    chunks = microbatches * virtual_stages
    return chunk_slots(pp, microbatches, virtual_stages, schedule) * (stage_seconds / chunks + boundary_seconds)
