"""Every `tables.md` committed under docs/results/ is what `trace_rl.experiments.results_report` makes of the raw
files next to it (docs/results.md quotes these tables): regenerated here, byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_rl.experiments import results_report

DOCS = Path(__file__).resolve().parents[2] / "docs" / "results"
TABLES = sorted(p.parent for p in DOCS.rglob("tables.md") if (p.parent / "raw" / "warmup.json").exists())


def test_every_results_table_has_its_raw_files():
    found = {p.relative_to(DOCS).as_posix() for p in TABLES}
    assert found >= {
        "analyses_8_layers",
        "depth_32_layers",
        "recipes_and_seeds_20_steps",
        "seeds_45_steps",
        "trainer_ep2_and_seeds_29_steps",
        "long_horizon_152_steps",
    }


@pytest.mark.parametrize("root", TABLES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_committed_tables_are_regenerated_from_their_raw_files(root, tmp_path):
    results_report.main([str(root / "raw"), str(tmp_path)])
    assert (tmp_path / "tables.md").read_text() == (root / "tables.md").read_text()
