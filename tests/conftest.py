"""Session set-up shared by every test module.

torch.compile's inductor caches compiled graphs on disk keyed by the traced graph, not by the Python behind a
registered op's fake (shape) kernel: a graph compiled before an op of ``lightning_tp2d.ops`` changed its outputs is
found again and fails (``assert_size_stride``). Each test session compiles into its own cache directory, and keeps
the planner's on-disk answers in its own folder."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="tp2d-inductor-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)  # (forked ranks leave through os._exit: not theirs)
# the planner's on-disk answers (lightning_tp2d.planning.cache) live in the session's own folder, never the user's
os.environ["TP2D_PLAN_CACHE"] = _PLANS = tempfile.mkdtemp(prefix="tp2d-plans-")
atexit.register(shutil.rmtree, _PLANS, ignore_errors=True)


# Counting the assertions the suite executes (issue 37: a faster suite must not check less). pytest calls
# ``pytest_assertion_pass`` for every rewritten ``assert`` that passes, in this process and in the ranks it forks
# (they share the rewritten test modules); each one written in tests/ appends one byte to this process's file in a folder named in the
# environment, which forked ranks and pytest-xdist's workers inherit, so the folder's size is the count. The summary
# line prints it beside the tests passed.
if "TP2D_ASSERT_COUNTS" not in os.environ:
    os.environ["TP2D_ASSERT_COUNTS"] = tempfile.mkdtemp(prefix="tp2d-asserts-")
    atexit.register(shutil.rmtree, os.environ["TP2D_ASSERT_COUNTS"], ignore_errors=True)
_COUNTS = os.environ["TP2D_ASSERT_COUNTS"]
_COUNT = os.path.join(_COUNTS, f"process-{os.getpid()}")  # (a forked rank keeps its parent's file)


_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_assertion_pass(item, lineno, orig, expl):
    # only the asserts of tests/: plugins (hydra-core registers one) have pytest rewrite their packages' asserts too
    frame = sys._getframe(1)
    while frame is not None and ("_pytest" in frame.f_code.co_filename or "pluggy" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(_TESTS):
        with open(_COUNT, "ab") as f:
            f.write(b".")


_PER_TEST: dict[str, int] = {}


def _executed(path: str = _COUNT) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def pytest_runtest_protocol(item, nextitem):
    _PER_TEST[item.nodeid] = -_executed()  # tests run one at a time: the file's growth during one is its count


def pytest_runtest_logfinish(nodeid, location):
    _PER_TEST[nodeid] = _PER_TEST.get(nodeid, 0) + _executed()


def pytest_sessionfinish(session):
    # no rank outlives the session: a survivor would hold the pipe pytest's output goes through (and
    # multiprocessing's exit handler would join it for ever)
    import multiprocessing

    if "tests.distributed" in sys.modules:
        sys.modules["tests.distributed"]._close_pools()
    leftover = multiprocessing.active_children()
    if leftover:  # (xdist's controller has none: it need not import torch for this)
        from lightning_tp2d.bench import procs

        procs.stop(leftover)
    report = os.environ.get("TP2D_ASSERT_REPORT")  # a JSON of the assertions each test executed, when asked
    if report:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{report}.{worker}" if worker else report, "w") as f:
            json.dump(_PER_TEST, f, indent=0)


def pytest_terminal_summary(terminalreporter):
    passed = len(terminalreporter.stats.get("passed", []))
    executed = sum(_executed(os.path.join(_COUNTS, name)) for name in os.listdir(_COUNTS))
    terminalreporter.write_line(f"tests passed: {passed}; "
                                f"assertions executed (every test process and its forked ranks): {executed}")


def pytest_runtest_setup(item):
    # a test that monkeypatches this process needs ranks forked after the patch (tests/distributed.py)
    import tests.distributed  # (imports torch and the package's process spawner: loaded once the first test runs)

    tests.distributed.FRESH_FOR_THIS_TEST = "monkeypatch" in item.fixturenames
    tests.distributed.new_module(item.module.__name__)  # pools are per test module: no state crosses modules


def pytest_runtest_teardown(item):
    # a Hydra job run in this process (the console script's main) leaves its state behind: its choices would name
    # the model in a later test's messages (train._model_label)
    if "hydra.core.hydra_config" in sys.modules:
        sys.modules["hydra.core.hydra_config"].HydraConfig.instance().cfg = None
