"""The results driver (trace_rl.experiments.results) end to end on CPU with the tiny preset, and the report
(trace_rl.experiments.results_report) on what it collects: raw/ holds every run's per-step metrics, the analysis and
the warm-up; the tables' numbers are the raw data's."""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import subprocess
import sys
import time

import pytest

from trace_rl.experiments import results, results_report
from trace_rl.experiments.analysis import BITS, LAYER_SETS
from trace_rl.rundir import load_latest
from trace_rl.warmup import PRESETS

STEPS = 2
TIMING_STEPS = 3
LAYER_IDS = range(PRESETS["tiny"].layers)
KINDS = ("moe_in", "k", "v")
POLICY_METRICS = [
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_diff_max",
    "train_rollout_logprob_diff_min",
    "train_rollout_k3_kl",
    "train_rollout_extreme_token_frac_tau2",
]
PER_STEP = [*POLICY_METRICS, "reward/mean", "time/step_s", "time/train_s"]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "out"
    results.main(
        ["run", str(out), "--preset", "tiny", "--digits", "1", "--device", "cpu", "--steps", f"{STEPS}"]
        + ["--warmup-steps", "10", "--warmup-lr", "3e-3", "--analysis-batches", "1"]
        + ["--timing-steps", f"{TIMING_STEPS}", "--parallel", "2"]
    )
    # a tagged repeat of the default run with one more override (one that leaves the numerics alone)
    results.main(
        ["run", str(out), "--model", str(out / "model"), "--runs", "trace_all", "--tag", "rerun", "--device", "cpu"]
        + ["--digits", "1", "--steps", f"{STEPS}", "--analysis-batches", "0", "--timing-steps", "0"]
        + ["--set", "keep_record_steps=1"]
    )
    return out


@pytest.fixture(scope="module")
def raw(out):
    return out / "raw"


@pytest.fixture(scope="module")
def docs(raw, tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    results_report.main([str(raw), str(docs)])
    return docs


def _rows(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _col(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows]


def _md_table(md: str, heading: str) -> list[dict[str, str]]:
    """The first markdown table after the line `heading`, one dict per row keyed by the header."""
    lines = md.splitlines()
    start = lines.index(heading)
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            break
    header, _, *body = table
    return [dict(zip(header, row, strict=True)) for row in body]


@pytest.mark.slow
def test_raw_holds_every_run_the_analysis_and_the_warmup(raw):
    expected = {f"rl_{name}.csv" for name in results.DEFAULT_RUNS} | {"rl_trace_all@rerun.csv"}
    expected |= {f"timing_{mode}_r{r}.csv" for mode in results.TIMING for r in range(1, results.TIMING_ROUNDS + 1)}
    expected |= {"analysis.json", "warmup.json"}
    assert {p.name for p in raw.iterdir()} == expected
    warmup = json.loads((raw / "warmup.json").read_text())
    assert (warmup["preset"], warmup["digits"], warmup["steps"]) == ("tiny", 1, 10)


@pytest.mark.slow
def test_rl_runs_log_the_per_step_metrics(raw):
    for name in [*results.DEFAULT_RUNS, "trace_all@rerun"]:
        rows = _rows(raw / f"rl_{name}.csv")
        assert [int(float(r["step"])) for r in rows] == list(range(STEPS)), name
        for key in PER_STEP:
            assert all(r.get(key, "") != "" for r in rows), (name, key)
        assert all(v >= 0 for v in _col(rows, "train_rollout_logprob_abs_diff"))
        assert all(v > 0 for v in _col(rows, "time/step_s") + _col(rows, "time/train_s"))
        for r in rows:
            assert float(r["train_rollout_logprob_diff_min"]) <= float(r["train_rollout_logprob_diff_max"])
            assert 0 <= float(r["reward/mean"]) <= 1


@pytest.mark.slow
def test_measured_runs_report_code_flips_at_every_site(raw):
    """qat and trace run with measure_all_sites, so every site has a flip rate (the trace run guides only the
    latter half but is measured everywhere); bf16 has no FP4 sites."""
    sites = [f"trace/L{layer}.{kind}/code_flip_rate" for layer in LAYER_IDS for kind in KINDS]
    for name in ("qat", "trace"):
        for r in _rows(raw / f"rl_{name}.csv"):
            for key in sites:
                assert 0 <= float(r[key]) <= 1, (name, key)
    assert not any("code_flip_rate" in k for k in _rows(raw / "rl_bf16.csv")[0])


@pytest.mark.slow
def test_trace_run_never_falls_back_to_rtn_on_real_tokens(raw):
    for name in ("trace", "trace_full", "trace_all"):
        assert _col(_rows(raw / f"rl_{name}.csv"), "trace/rtn_fallback_real_tokens") == [0.0] * STEPS, name


@pytest.mark.slow
def test_timing_runs_alternate_modes_over_the_rounds(raw):
    for mode in results.TIMING:
        for r in range(1, results.TIMING_ROUNDS + 1):
            rows = _rows(raw / f"timing_{mode}_r{r}.csv")
            assert len(rows) == TIMING_STEPS
            assert {row["mode"] for row in rows} == {mode}
            assert all(v > 0 for v in _col(rows, "time/step_s"))


@pytest.mark.slow
def test_analysis_scores_every_configuration_on_one_batch(raw):
    payload = json.loads((raw / "analysis.json").read_text())
    configs = [r["config"] for r in payload["results"] if r["batch"] == 0]
    ablation = [f"b{b}/{which}" for which in LAYER_SETS for b in BITS]
    assert sorted(configs) == sorted(["bf16", "qat", *ablation])
    assert set(payload["relative_excess"]) == {"qat", *ablation}
    assert [r["config"] for r in payload["results"] if r["batch"] != 0] == ["qat"]  # the calibration batch (-1)
    for r in payload["results"]:
        assert set(POLICY_METRICS) <= set(r)
    assert set(payload["relative_excess"]["qat"]) == {f"L{layer}.{kind}" for layer in LAYER_IDS for kind in KINDS}


@pytest.mark.slow
def test_report_writes_the_tables_and_figures(docs):
    md = (docs / "tables.md").read_text()
    for name in results.DEFAULT_RUNS:
        assert f"| {results_report.RUN_LABELS[name]} |" in md
    ablation = _md_table(md, "### Same-batch ablation (bits x captured layers)")
    configs = [row["config"] for row in ablation]
    assert configs[:2] == ["bf16", "qat"]
    assert sorted(configs[2:]) == sorted(f"b{b}/{which}" for which in LAYER_SETS for b in BITS)
    assert all(row["batches"] == "1" for row in ablation)
    front = _md_table(md, "Pareto front (mean abs Δ logp against record bytes / token: no other configuration has "
                      "both fewer bytes and less mismatch):")  # fmt: skip
    rows = {row["config"]: row for row in ablation}
    for row in front:  # on the front: no configuration with fewer bytes has less mismatch
        bytes_, dlogp = float(row["record bytes / token"]), float(row["mean abs Δ logp"])
        assert rows[row["config"]]["mean abs Δ logp"] == row["mean abs Δ logp"]
        for other in rows.values():
            if other["config"] not in ("bf16", "qat") and float(other["record bytes / token"]) < bytes_:
                assert float(other["mean abs Δ logp"]) >= dlogp
    for png in ("rl_mismatch.png", "relative_excess.png", "flip_distance.png", "pareto.png"):
        data = (docs / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, png


@pytest.mark.slow
def test_rl_table_numbers_come_from_the_raw_csv(raw, docs):
    table = {row["run"]: row for row in _md_table((docs / "tables.md").read_text(), "### RL runs")}
    tagged = results_report.RUN_LABELS["trace_all"] + ", rerun"
    assert set(table) == {results_report.RUN_LABELS[name] for name in results.DEFAULT_RUNS} | {tagged}
    qat = _rows(raw / "rl_qat.csv")
    row = table["FP4 + QAT"]
    assert row["steps"] == f"{STEPS}"
    assert row["mean abs Δ logp"] == f"{statistics.fmean(_col(qat, 'train_rollout_logprob_abs_diff')):.5f}"
    assert row["Δ logp max"] == f"{max(_col(qat, 'train_rollout_logprob_diff_max')):.3f}"
    assert row["Δ logp min"] == f"{min(_col(qat, 'train_rollout_logprob_diff_min')):.3f}"
    moe_in = [statistics.fmean(float(r[f"trace/L{i}.moe_in/code_flip_rate"]) for i in LAYER_IDS) for r in qat]
    assert row["code flips moe_in"] == f"{statistics.fmean(moe_in):.4f}"
    assert table["BF16"]["code flips moe_in"] == "—"


@pytest.mark.slow
def test_step_time_overhead_is_the_ratio_of_the_medians(raw, docs):
    """Medians over both rounds of each mode, the first two (warm-up) steps of each file left out."""
    medians = {}
    for mode in ("qat", "trace"):
        rows = [row for r in range(1, results.TIMING_ROUNDS + 1) for row in _rows(raw / f"timing_{mode}_r{r}.csv")[2:]]
        assert len(rows) == results.TIMING_ROUNDS * (TIMING_STEPS - 2)
        medians[mode] = {k: statistics.median(_col(rows, k)) for k in ("time/step_s", "time/train_s")}
    table = {row["mode"]: row for row in _md_table((docs / "tables.md").read_text(), "### Step time")}
    for mode in ("qat", "trace"):
        assert table[mode]["steps timed"] == f"{results.TIMING_ROUNDS * (TIMING_STEPS - 2)}"
        assert table[mode]["step s (median)"] == f"{medians[mode]['time/step_s']:.3f}"
    step = 100 * (medians["trace"]["time/step_s"] / medians["qat"]["time/step_s"] - 1)
    train = 100 * (medians["trace"]["time/train_s"] / medians["qat"]["time/train_s"] - 1)
    overhead = table["TRACE over QAT"]
    assert overhead["step s (median)"] == f"{step:+.1f} %"
    assert overhead["train s (median)"] == f"{train:+.1f} %"


@pytest.mark.slow
def test_report_without_the_warmup_names_the_missing_file(raw, tmp_path):
    partial = tmp_path / "raw"
    shutil.copytree(raw, partial)
    (partial / "warmup.json").unlink()
    with pytest.raises(FileNotFoundError, match="warmup.json"):
        results_report.main([str(partial), str(tmp_path / "docs")])
    assert not (tmp_path / "docs").exists()  # refused before anything is written


@pytest.mark.slow
def test_a_tagged_run_gets_its_overrides_and_compares_with_its_untagged_run(out, raw, docs):
    """`--tag rerun --set keep_record_steps=1`: the run directory and raw file carry the tag, the run's config the
    override; on one CPU a repeat is deterministic, so the report finds the same step-0 batch and zero distance."""
    state = load_latest(out / "rl" / "trace_all@rerun" / "trace").state
    assert (state["config"]["keep_record_steps"], state["config"]["record_all_layers"]) == (1, True)
    # Wall times differ, and so may the record store's bytes on disk: the step's index.json names each shard by
    # its writer (host, pid), so a pid with one more digit adds a byte per shard. Everything else is equal.
    varies = ("time/", "trace/record_bytes_per_token")
    for a, b in zip(_rows(raw / "rl_trace_all@rerun.csv"), _rows(raw / "rl_trace_all.csv"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(varies)} == {
            k: v for k, v in b.items() if not k.startswith(varies)
        }
    heading = "### Trainer layouts and repeats (against the untagged run of the same seed)"
    ref, rerun = _md_table((docs / "tables.md").read_text(), heading)
    label = results_report.RUN_LABELS["trace_all"]
    assert (ref["run"], rerun["run"]) == (label, label + ", rerun")
    dist = "mean per-step distance of abs Δ logp to the first row"
    assert ref[dist] == rerun[dist] == "0.00e+00" and rerun["step 0: reward, length = first row's"] == "yes"
    dlogp = statistics.fmean(_col(_rows(raw / "rl_trace_all.csv"), "train_rollout_logprob_abs_diff"))
    assert rerun["mean abs Δ logp"] == ref["mean abs Δ logp"] == f"{dlogp:.5f}"
    assert (docs / "rl_layouts_trace_all.png").read_bytes().startswith(b"\x89PNG")


def test_run_names_per_recipe_and_seed():
    named = results.run_names(["bf16", "qat"], ["nvfp4-w4a4-kv4", "mxfp4-w4a8-kv4"], [0, 1], seed=0)
    assert list(named) == ["bf16", "qat", "bf16-s1", "qat-s1", "qat-mxfp4-w4a8-kv4", "qat-mxfp4-w4a8-kv4-s1"]
    assert named["qat-mxfp4-w4a8-kv4-s1"] == [*results.RUNS["qat"], "recipe=mxfp4-w4a8-kv4", "seed=1"]
    assert results_report.run_label("qat-mxfp4-w4a8-kv4-s1") == "FP4 + QAT, mxfp4-w4a8-kv4, seed 1"
    assert list(results.run_names(["qat"], ["nvfp4-w4a4-kv4"], [1, 2], seed=0)) == ["qat-s1", "qat-s2"]
    tagged = results.run_names(["trace_all"], ["nvfp4-w4a4-kv4"], [0, 1], seed=0, tag="ep2", extra=["ep=2", "dp=2"])
    assert tagged["trace_all-s1@ep2"] == [*results.RUNS["trace_all"], "recipe=nvfp4-w4a4-kv4", "seed=1", "ep=2", "dp=2"]
    assert results_report.run_label("trace_all-s1@ep2") == results_report.RUN_LABELS["trace_all"] + ", seed 1, ep2"
    with pytest.raises(ValueError, match="--tag 'EP 2'"):
        results.run_names(["qat"], ["nvfp4-w4a4-kv4"], [0], tag="EP 2")
    with pytest.raises(ValueError, match="not a run name"):
        results_report.run_label("sgd")


@pytest.mark.slow
def test_runs_over_seeds_get_a_mean_and_interval(raw, tmp_path):
    """Three seeds of one run (here: the same per-step file three times) -> one row, the mean of the per-run values
    and a zero-width interval."""
    seeds = tmp_path / "raw"
    seeds.mkdir()
    shutil.copy(raw / "warmup.json", seeds)
    for name in ("qat", "qat-s1", "qat-s2"):
        shutil.copy(raw / "rl_qat.csv", seeds / f"rl_{name}.csv")
    results_report.main([str(seeds), str(tmp_path / "docs")])
    md = (tmp_path / "docs" / "tables.md").read_text()
    (row,) = _md_table(md, "Over seeds (mean ± half-width of the 95 % t-interval over the runs):")
    dlogp = statistics.fmean(_col(_rows(raw / "rl_qat.csv"), "train_rollout_logprob_abs_diff"))
    assert (row["run"], row["seeds"]) == ("FP4 + QAT", "3")
    assert row["mean abs Δ logp"] == f"{dlogp:.4g} ± 0"
    reward = _col(_rows(raw / "rl_qat.csv"), "reward/mean")
    assert row["reward (second half)"] == f"{statistics.fmean(reward[len(reward) // 2 :]):.4g} ± 0"
    assert (tmp_path / "docs" / "rl_seeds.png").read_bytes().startswith(b"\x89PNG")


def test_rl_time_limit_stops_the_runs_still_running(tmp_path, capsys):
    """`--rl-time-limit`: at the deadline a run still running is stopped and named; one that ended before it is
    waited for as usual, and a failure is still an error."""
    logs = {name: tmp_path / f"{name}.log" for name in ("slow", "quick", "broken")}
    code = {"slow": "import time; time.sleep(120)", "quick": "pass", "broken": "raise SystemExit(3)"}
    procs = {
        name: (subprocess.Popen([sys.executable, "-c", code[name]], stdout=logs[name].open("w")), logs[name])
        for name in ("quick", "slow")
    }
    start = time.monotonic()
    results._wait(procs, deadline=start + 2)
    assert time.monotonic() - start < 60
    assert procs["slow"][0].returncode is not None and procs["quick"][0].returncode == 0
    assert "stopped runs ['slow'], still running" in capsys.readouterr().out
    broken = {
        "broken": (
            subprocess.Popen([sys.executable, "-c", code["broken"]], stdout=logs["broken"].open("w")),
            logs["broken"],
        )
    }
    with pytest.raises(RuntimeError, match=r"runs \['broken'\] failed"):
        results._wait(broken, deadline=time.monotonic() + 60)


@pytest.mark.slow
def test_reward_windows_pair_each_run_with_qat_by_seed(raw, tmp_path):
    """Two seeds each of QAT and TRACE (the same per-step file per run for both seeds): per window the mean reward
    of each, and TRACE − QAT paired by seed, the difference of the window means with a zero-width interval."""
    seeds = tmp_path / "raw"
    seeds.mkdir()
    shutil.copy(raw / "warmup.json", seeds)
    for run in ("qat", "trace_all"):
        for name in (run, f"{run}-s1"):
            shutil.copy(raw / f"rl_{run}.csv", seeds / f"rl_{name}.csv")
    results_report.main([str(seeds), str(tmp_path / "docs")])
    md = (tmp_path / "docs" / "tables.md").read_text()
    qat, trace, diff = _md_table(md, "Reward by window of steps (mean ± half-width of the 95 % t-interval over seeds):")
    reward = {run: _col(_rows(raw / f"rl_{run}.csv"), "reward/mean") for run in ("qat", "trace_all")}
    last = list(qat)[-1]  # "reward, steps a–b"
    a, b = map(int, last.removeprefix("reward, steps ").split("–"))
    assert b == min(map(len, reward.values())) - 1
    window = {run: statistics.fmean(r[a : b + 1]) for run, r in reward.items()}
    assert qat["run"] == "FP4 + QAT" and qat[last] == f"{window['qat']:.3f} ± 0.000"
    assert trace[last] == f"{window['trace_all']:.3f} ± 0.000"
    assert diff["run"] == results_report.RUN_LABELS["trace_all"] + " − FP4 + QAT, paired by seed"
    assert diff[last] == f"{window['trace_all'] - window['qat']:+.3f} ± 0.000"
