"""Runnable rivals with torch's (or their authors') own code: 1-D TP (+ SP), context parallelism, Ulysses + ALST.
Used by :mod:`lightning_tp2d.bench` and the tests, never by the runtime; their costs as arithmetic on the config
live in :mod:`lightning_tp2d.planning.rivals`."""
