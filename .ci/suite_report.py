"""The suite's size and time beside the last recorded run (issue 37: a faster suite must not check less).

``python .ci/suite_report.py LOG SECONDS`` reads pytest's output ``LOG`` (the line ``tests passed: N; assertions
executed ...: M`` that tests/conftest.py prints) and counts, in ``tests/``, the test functions and the ``assert``
statements (``ast``); it prints these beside ``.ci/suite_counts.json`` (the run recorded last) and says which went
down. ``--record`` writes the new figures to that file (run it on an idle machine, with the machine in ``--note``).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / ".ci" / "suite_counts.json"
SUMMARY = re.compile(r"tests passed: (\d+); assertions executed "
                     r"\((?:this|every test) process and its forked ranks\): (\d+)")


def static_counts(tests: Path = ROOT / "tests") -> dict[str, int]:
    """Test functions (``def test_*``) and ``assert`` statements in the test files, read with ``ast``."""
    functions = asserts = 0
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            functions += isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
            asserts += isinstance(node, ast.Assert)
    return {"test_functions": functions, "assert_statements": asserts}


def run_counts(log: str) -> dict[str, int]:
    found = SUMMARY.findall(log)
    if not found:
        raise SystemExit("suite_report: the log has no 'tests passed: N; assertions executed ...' line "
                         "(tests/conftest.py prints it at the end of a pytest run)")
    passed, executed = map(int, found[-1])
    return {"tests_passed": passed, "assertions_executed": executed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--record", action="store_true", help="write the figures to .ci/suite_counts.json")
    parser.add_argument("--note", default="", help="the machine and its load, kept with a recorded run")
    args = parser.parse_args(argv)
    now = {"seconds": round(args.seconds), **run_counts(args.log.read_text(errors="replace")), **static_counts()}
    last = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    print(f"{'suite':<22}{'this run':>12}{'last recorded':>16}")
    for key, value in now.items():
        print(f"{key:<22}{value:>12}{last.get(key, '-'):>16}")
    if last.get("note"):
        print(f"(last recorded: {last['note']})")
    fewer = [k for k in now if k != "seconds" and isinstance(last.get(k), int) and now[k] < last[k]]
    if fewer:
        print(f"suite_report: fewer than the last recorded run: {', '.join(fewer)}", file=sys.stderr)
    if args.record:
        RECORD.write_text(json.dumps({**now, "note": args.note}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
