"""Numbers and tables in docs/ that the code determines, checked against it: docs/rl.md's configuration table
(every `RLConfig` field with its default, nothing else) and docs/records.md's capture-memory example."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from trace_core.capture import RecordCapturer
from trace_core.records import ModelShape, RecordSpec
from trace_rl.config import RLConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
RL_DOC = DOCS / "rl.md"


def documented_defaults() -> dict[str, str]:
    """Field -> default as written in the table under "## Configuration" (a row may name several fields, with one
    default for all or one each, separated by `,` or `/`)."""
    section = RL_DOC.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        fields = re.findall(r"`(\w+)`", cells[0])
        defaults = [d.strip() for d in re.split(r",|\s/\s", cells[1])]
        if len(defaults) == 1:
            defaults *= len(fields)
        assert len(defaults) == len(fields), f"row {line!r}: {len(fields)} fields, {len(defaults)} defaults"
        out.update(zip(fields, defaults, strict=True))
    return out


def as_written(value: object) -> str:
    """A default as the table writes it: strings in backticks (`""` for empty), booleans lower case."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return str(value)


def test_the_config_table_gives_every_field_and_its_default():
    documented = documented_defaults()
    fields = {f.name: f.default for f in dataclasses.fields(RLConfig)}
    assert sorted(set(fields) - set(documented)) == [], "fields missing from docs/rl.md"
    assert sorted(set(documented) - set(fields)) == [], "docs/rl.md names fields RLConfig does not have"
    for name, default in fields.items():
        written = documented[name]
        if isinstance(default, float) and not isinstance(default, bool):
            assert float(written) == default, (name, written, default)
        else:
            assert written == as_written(default), (name, written, default)


def test_the_capture_memory_example_of_the_records_page():
    """24 captured MoE layers of width 2048 at b = 1 and routes of 48 layers x top-8: the row size docs/records.md
    quotes (records, routes, the written byte, rounded up to 4)."""
    spec = RecordSpec.default(moe_layers=tuple(range(24, 48)), attn_layers=())
    shape = ModelShape(hidden=2048, num_kv_heads=4, head_dim=128)
    row_bytes = RecordCapturer(spec, shape, max_tokens=1, num_slots=1, routes=(48, 8)).row.row_bytes
    assert row_bytes == 10_852
    assert f"is {row_bytes:,} bytes per token" in (DOCS / "records.md").read_text()
