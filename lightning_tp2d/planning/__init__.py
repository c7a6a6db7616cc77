"""The product that picks a configuration: the trace, cost and memory models, the rivals' costs as arithmetic on the
config, and the planner (``tp2d-plan``, :func:`~lightning_tp2d.planning.planner.plan`, ``layout="auto"``). Never
imports :mod:`lightning_tp2d.bench` or :mod:`lightning_tp2d.baselines`."""
