"""Shared test configuration and fixtures: GPU tests are skipped (with the reason) where no CUDA device is present;
`megatron_rank` sets up megatron-core for one CPU rank; `tiny_model` builds the tiny addition model once per
session for each warm-up length the tests ask for."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def megatron_rank() -> None:
    """megatron-core's process groups and seeds for one rank (TP = PP = EP = 1), set up for each module that uses
    it (`pytestmark = pytest.mark.usefixtures("megatron_rank")`)."""
    from megatron_trace.cpu import init_single_rank

    init_single_rank()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[int], Path]:
    """`tiny_model(steps)`: the directory of the tiny addition model (`trace_rl.warmup.make_tiny_model`, seed 0)
    warmed up for `steps` steps, built on first use and shared by the session's tests (which only read it)."""
    built: dict[int, Path] = {}

    def get(steps: int) -> Path:
        if steps not in built:
            from trace_rl.warmup import make_tiny_model

            out = tmp_path_factory.mktemp(f"tiny-{steps}")
            make_tiny_model(out, steps=steps)
            built[steps] = out
        return built[steps]

    return get
