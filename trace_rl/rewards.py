"""Reward functions and the pool that runs them off the trainer's critical path.

A reward function is `fn(response: str, answer: str | None, metadata: dict) -> float`, named in the config by
`reward`: a built-in (`math`, `exact_match`) or a Python path `package.module:function` (importable) or
`path/to/file.py:function`. `RewardPool` scores a rollout batch in a thread or process pool as soon as the batch is
generated, so rewards of a slow function overlap the trainer (`async_lag > 0`) and each other; the controller waits
for them only when it trains on that batch.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import cache
from pathlib import Path

RewardFn = Callable[[str, "str | None", dict], float]
POOLS = ("thread", "process")


def exact_match(response: str, answer: str | None, metadata: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is the answer."""
    return float(answer is not None and response.strip() == answer.strip())


def math(response: str, answer: str | None, metadata: dict) -> float:
    """1.0 when the response's first `\\boxed{...}` is mathematically equivalent to the answer (Math-Verify:
    LaTeX / SymPy parsing and comparison), else 0.0. A response without a boxed answer scores 0.

    Math-Verify bounds parsing and comparison with `signal.alarm` timeouts, which exist only in a process's main
    thread: off the main thread (a thread pool) it runs without them, so `reward_pool = "process"` is the
    setting for untrusted responses.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    if answer is None or "\\boxed" not in response:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=timeout)
    pred = parse(
        response,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        extraction_mode="first_match",
        parsing_timeout=timeout,
    )
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout))


BUILTINS: dict[str, RewardFn] = {"math": math, "exact_match": exact_match}


@cache
def load_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name, `module:function` or `file.py:function`."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"reward={spec!r}: use one of {sorted(BUILTINS)}, 'module:function' or 'file.py:function'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise ValueError(f"reward={spec!r}: file {path} does not exist (relative to the working directory)")
        module_spec = importlib.util.spec_from_file_location(f"trace_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses and pickling look the module up there
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # the user's file: say which and why, in one line
            raise ValueError(f"reward={spec!r}: loading {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is not None and where.startswith(e.name):
                raise ValueError(
                    f"reward={spec!r}: no module named {e.name!r}: install it, add its directory to PYTHONPATH, or "
                    f"name a file: reward='path/to/file.py:{name}'"
                ) from None
            missing = f"no module named {e.name!r} (install it)"
            raise ValueError(f"reward={spec!r}: importing {where} failed: {missing}") from e
        except Exception as e:
            raise ValueError(f"reward={spec!r}: importing {where} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward={spec!r}: {where} has no function {name}")
    return fn


def ignore_sigint() -> None:
    """A reward process ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the controller
    finishes its step (scoring included) before it stops (`Controller.run`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sigint_ignored() -> bool:
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _score(spec: str, response: str, answer: str | None, metadata: dict) -> float:
    return float(load_reward(spec)(response, answer, metadata))


class RewardPool:
    """Scores (response, answer, metadata) samples with the reward `spec` on `workers` threads or processes
    (`workers = 0`: in the calling thread, at submit)."""

    def __init__(self, spec: str, workers: int, kind: str = "thread"):
        if kind not in POOLS:
            raise ValueError(f"reward_pool={kind!r} is not one of {POOLS}")
        load_reward(spec)  # fail at start, by name, not at the first batch
        self.spec = spec
        self.executor: Executor | None = None
        if workers > 0 and kind == "thread":
            self.executor = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        elif workers > 0:
            self.executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=ignore_sigint
            )

    def submit(self, samples: Sequence[tuple[str, str | None, dict]]) -> list[Future]:
        if self.executor is not None:
            return [self.executor.submit(_score, self.spec, *s) for s in samples]
        done = []
        for s in samples:
            f: Future = Future()
            try:
                f.set_result(_score(self.spec, *s))
            except Exception as e:  # as a pool's future holds it: raised, with its prompt named, at result()
                f.set_exception(e)
            done.append(f)
        return done

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)
