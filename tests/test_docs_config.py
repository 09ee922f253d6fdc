"""docs/rl.md's configuration table names every `RLConfig` field with its default, and nothing else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from trace_rl.config import RLConfig

RL_DOC = Path(__file__).resolve().parents[1] / "docs" / "rl.md"


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
