"""Kernel checks under the Triton interpreter, one subprocess per module, every case reported by its id.

`TRITON_INTERPRET=1` is read when triton builds a kernel's launcher, so the checks run in a child process
(`python -m <module>`). The child calls `run_cases` with its cases by id: each runs whatever the others do, and
prints one result line. The parent (a pytest module fixture) calls `interpret` once and a parametrized test asserts
each case's result, so a failure names its case and hides none of the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

MARK = "TRACE-INTERPRET-CASE "


def run_cases(cases: Mapping[str, Callable[[], object]]) -> None:
    """Run every case (in the interpreter child), printing `MARK {"case", "ok", "error"}` for each."""
    for case, fn in cases.items():
        try:
            fn()
            result = {"case": case, "ok": True}
        except Exception:  # every case runs and reports, whatever an earlier one raised
            result = {"case": case, "ok": False, "error": traceback.format_exc()}
        print(MARK + json.dumps(result), flush=True)


@dataclass(frozen=True)
class Interpreted:
    """The results of one interpreter child: case id -> error text (None when the case passed)."""

    results: dict[str, str | None]
    output: str

    def check(self, case: str) -> None:
        """Raise AssertionError unless `case` ran and passed."""
        if case not in self.results:
            raise AssertionError(f"case {case} did not report (the child stopped early):\n{self.output[-4000:]}")
        error = self.results[case]
        if error is not None:
            raise AssertionError(f"case {case} failed under the interpreter:\n{error}")


def interpret(module: str, timeout: float = 900, **env_vars: str) -> Interpreted:
    """Run `python -m module` with `TRITON_INTERPRET=1` (and `env_vars`) from the repository root and collect its
    case results."""
    # The interpreter runs `tl.dot` as numpy's matmul, i.e. OpenBLAS's sgemm, whose kernel OpenBLAS picks by CPU. On
    # AVX-512 machines the kernel it picks sums a transposed operand in another order than a plain one, so two kernels
    # that load the same tile differently (SGLang's K^T view, the FP4 kernel's tile built in registers) differ in
    # the last bit there. Pinning the Haswell (AVX2) kernel makes the dot's order independent of the layout.
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_CORETYPE="Haswell", **env_vars)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK) :])
            results[r["case"]] = None if r["ok"] else r["error"]
    return Interpreted(results, f"exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
