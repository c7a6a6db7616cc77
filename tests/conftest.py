"""Session set-up shared by every test module.

torch.compile's inductor caches compiled graphs on disk keyed by the traced graph, not by the Python behind a
registered op's fake (shape) kernel: a graph compiled before an op of ``lightning_tp2d.ops`` changed its outputs is
found again and fails (``assert_size_stride``). Each test session compiles into its own cache directory, and keeps
the planner's on-disk answers in its own folder."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="tp2d-inductor-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)  # (forked ranks leave through os._exit: not theirs)
# the planner's on-disk answers (lightning_tp2d.planning.cache) live in the session's own folder, never the user's
os.environ["TP2D_PLAN_CACHE"] = _PLANS = tempfile.mkdtemp(prefix="tp2d-plans-")
atexit.register(shutil.rmtree, _PLANS, ignore_errors=True)
