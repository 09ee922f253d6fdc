"""What the current pages (README.md and docs/*.md) say that the repository determines, checked against it:
docs/rl.md's configuration table (every `RLConfig` field with its default, nothing else), docs/records.md's
capture-memory example, that every test, measurement file and repository file the pages name exists and every file
under docs/measurements/ is cited by a page, that every link between the pages resolves, and the record-store sizing
rule of docs/deploy.md. CHANGELOG.md is history: the files it names are not checked."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from trace_core.numerics.formats import get_format
from trace_core.numerics.quant import quantize
from trace_core.records.capture import RecordCapturer
from trace_core.records.layout import TrajectoryRecords, site_layout
from trace_core.records.spec import ModelShape, Record, RecordSpec, bytes_per_token
from trace_core.records.store import StepWriter, read_header
from trace_rl.config import RLConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
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
    """24 captured MoE layers of width 2048 at b = 1 and routes of 48 layers x top-8 of 128 experts (uint8 ids): the
    row size docs/records.md quotes (records, routes, the written byte, rounded up to 8)."""
    spec = RecordSpec.default(moe_layers=tuple(range(24, 48)), attn_layers=())
    shape = ModelShape(hidden=2048, num_kv_heads=4, head_dim=128)
    row_bytes = RecordCapturer(spec, shape, max_tokens=1, num_slots=1, routes=(48, 8), num_experts=128).row.row_bytes
    assert row_bytes == 9_704
    assert f"is {row_bytes:,} bytes per token" in (DOCS / "records.md").read_text()


def _expand(path: str) -> list[str]:
    """`a.{txt,json}` -> `a.txt`, `a.json` (one brace group at most, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")]


ROOT = DOCS.parent
MEASUREMENTS = DOCS / "measurements"


def _doc_pages() -> list[Path]:
    """The current pages: README.md and docs/*.md. CHANGELOG.md is history: its file names are not checked."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def missing_tests(pages: list[Path]) -> list[str]:
    """`test_file.py::test_name` on the pages that names no test function of that file in tests/."""
    missing = []
    for page in pages:
        for file, name in sorted(set(re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text()))):
            sources = list((ROOT / "tests").rglob(file))  # tests/<area>/ (the live-server tests: tests/)
            if not any(re.search(rf"def {name}\(", source.read_text()) for source in sources):
                missing.append(f"{page.name}: {file}::{name}")
    return missing


def cited_data_paths(page: Path) -> set[str]:
    """Paths under docs/measurements/ and docs/results/ quoted on a page (brace groups expanded)."""
    found = re.findall(r"docs/(?:measurements|results)/[\w./{},-]*[\w}/]", page.read_text())
    return {p for path in found for p in _expand(path)}


def missing_data_files(pages: list[Path], root: Path = ROOT) -> list[str]:
    """Measurement and result paths quoted on the pages that do not exist under `root`."""
    return [f"{page.name}: {p}" for page in pages for p in sorted(cited_data_paths(page)) if not (root / p).exists()]


def missing_repository_files(pages: list[Path], root: Path = ROOT) -> list[str]:
    """Files of the repository (a path with a suffix under one of its top-level directories) named on the pages that
    do not exist: scripts, benches, configs, tests, modules, patches."""
    tops = "tests|bench|scripts|configs|trace_core|trace_rl|megatron_trace|sglang_trace|patches|docker"
    suffixes = "py|sh|toml|yaml|json|jsonl|md|txt|patch|png|csv"
    missing = []
    for page in pages:
        for path in sorted(
            set(re.findall(rf"(?<![\w/.])(?:{tops})/[\w./{{}},-]*\.(?:{suffixes})\b", page.read_text()))
        ):
            missing += [f"{page.name}: {p}" for p in _expand(path) if not (root / p).exists()]
    return missing


def uncited_measurements(pages: list[Path], measurements: Path = MEASUREMENTS) -> list[str]:
    """Files under docs/measurements/ that no page cites. A file directly in it must be quoted by its path; a file
    in a subfolder (one run's outputs) is cited with its folder, or with a file of that folder."""
    root = measurements.parents[1]
    cited = {p.rstrip("/") for page in pages for p in cited_data_paths(page)}
    uncited = []
    for f in sorted(x for x in measurements.rglob("*") if x.is_file()):
        rel = f.relative_to(root).as_posix()
        folders = {parent.relative_to(root).as_posix() for parent in f.parents if measurements in parent.parents}
        siblings = {s.relative_to(root).as_posix() for s in f.parent.iterdir()} if folders else set()
        if rel not in cited and not folders & cited and not siblings & cited:
            uncited.append(rel)
    return uncited


def test_every_test_the_docs_name_exists():
    """`test_file.py::test_name` in README.md and docs/*.md names a test function of that file in tests/."""
    assert missing_tests(_doc_pages()) == []


def test_every_measurement_and_result_file_the_docs_name_exists():
    """Paths under docs/measurements/ and docs/results/ quoted in README.md and docs/*.md exist."""
    assert missing_data_files(_doc_pages()) == []


def test_every_repository_file_the_docs_name_exists():
    """Files of the repository named in README.md and docs/*.md exist."""
    assert missing_repository_files(_doc_pages()) == []


def test_every_measurement_file_is_cited_by_a_page():
    """docs/measurements/ holds what the current pages cite, not every file ever cited: a raw file no page names is
    deleted (its history is in CHANGELOG.md and git)."""
    assert uncited_measurements(_doc_pages()) == []


def test_the_checks_report_a_missing_file_a_missing_test_and_an_uncited_file(tmp_path):
    """The checks above fail on a page that cites a file or a test that does not exist, and on a raw file no page
    cites."""
    (tmp_path / "docs" / "measurements" / "run").mkdir(parents=True)
    for name in ("kept.txt", "stray.txt", "run/a.json", "run/b.json"):
        (tmp_path / "docs" / "measurements" / name).write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "raw `docs/measurements/kept.txt`, `docs/measurements/gone.{json,txt}` and `docs/measurements/run/a.json`; "
        "`bench/no_such_bench.py`; `test_docs_claims.py::test_no_such_test`, "
        "`test_docs_claims.py::test_every_test_the_docs_name_exists`"
    )
    assert missing_data_files([page], tmp_path) == [
        "page.md: docs/measurements/gone.json",
        "page.md: docs/measurements/gone.txt",
    ]
    assert missing_repository_files([page], tmp_path) == ["page.md: bench/no_such_bench.py"]
    assert missing_tests([page]) == ["page.md: test_docs_claims.py::test_no_such_test"]
    assert uncited_measurements([page], tmp_path / "docs" / "measurements") == ["docs/measurements/stray.txt"]


def test_a_shard_holds_bytes_per_token_of_records_plus_the_routes(tmp_path):
    """docs/deploy.md sizes the record volume as `bytes_per_token(shape, spec).total` plus 4 bytes per routed expert
    per token: the raw (uncompressed) bytes of a shard written by the store are exactly that, for the default spec
    and the latter half, NVFP4 per-token MoE inputs and kv_fp4 K / V."""
    shape = ModelShape(hidden=64, num_kv_heads=2, head_dim=16)
    layers, topk, tokens = 4, 2, 7
    gen = torch.Generator().manual_seed(0)
    for make in (RecordSpec.default, RecordSpec.latter_half):
        spec = make(moe_layers=tuple(range(layers)), attn_layers=tuple(range(layers)), bits=1)
        records = {}
        for site, (fmt, bits, n) in site_layout(spec, shape).items():
            per_token = {"per_token": True} if get_format(fmt).has_global_scale else {}
            q = quantize(torch.randn(tokens, n, generator=gen), fmt, **per_token)
            records[site] = Record.from_quantized(q, bits)
        routes = torch.randint(0, 8, (tokens, layers, topk), generator=gen, dtype=torch.int32)
        path = StepWriter(tmp_path / make.__name__, 0).write({"t": TrajectoryRecords(tokens, records, routes)})
        entry = read_header(path)["trajectories"]["t"]
        raw = sum(f["raw"] for site in entry["sites"].values() for f in site["fields"].values())
        raw += entry["routes"]["raw"]
        assert raw == tokens * (bytes_per_token(shape, spec).total + 4 * layers * topk)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_resolves():
    """`[text](page.md)` and `[text](page.md#anchor)` links in README.md and docs/*.md name an existing page
    (CHANGELOG.md included) and, with an anchor, one of its headings (code blocks excluded)."""
    headings = {}
    for page in [*_doc_pages(), ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        headings[page.resolve()] = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    broken = []
    for page in _doc_pages():
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", page.read_text()):
            resolved = (page.parent / target).resolve() if target else page.resolve()
            if resolved not in headings or (anchor and anchor not in headings[resolved]):
                broken.append(f"{page.name} -> {target}#{anchor}")
    assert broken == []


def test_the_live_server_table_is_the_one_the_committed_runs_give():
    """docs/performance.md's current live-server table is `bench/serve_table.py` over the committed runs, each GPU's
    oldest first: a run added without regenerating it, or a cell edited by hand, fails."""
    from bench.serve_table import load_runs, markdown

    runs = [
        path
        for card in ("serve_h200", "serve_h100")
        for path in sorted((DOCS / "measurements" / card).glob("run*.json"), key=lambda p: int(p.stem[3:]))
    ]
    page = (DOCS / "performance.md").read_text()
    written = page.split("<!-- serve_table: begin -->\n", 1)[1].split("<!-- serve_table: end -->", 1)[0]
    assert written == markdown(load_runs(runs))
