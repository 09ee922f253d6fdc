"""The capture bench's accounting (`bench/capture.py`): what it reports as capture's cost per forward."""

from bench.capture import paired_overhead, profile_diff


def test_profile_diff_counts_the_kernel_capture_replaces_and_leaves_shared_kernel_noise_out():
    # per-forward profiles of 48 MoE layers: capture swaps the no-record quantize kernel for the record kernel and
    # adds a route copy per layer; the GEMM runs in both, 4 ms faster in the captured profile (clock noise)
    plain = {"nvjet_gemm": [48, 40000.0], "_quantize_record16_kernel": [48, 900.0], "add": [48, 500.0]}
    captured = {
        "nvjet_gemm": [48, 36000.0],
        "_quantize_record_kernel": [48, 1300.0],
        "direct_copy": [48, 120.0],
        "add": [48, 500.4],
    }
    d = profile_diff(plain, captured)
    assert d["added_by_capture"]["_quantize_record16_kernel"] == [-48, -900.0]  # a plain-only name shows
    assert d["added_by_capture"]["_quantize_record_kernel"] == [48, 1300.0]
    assert "add" not in d["added_by_capture"]  # same calls, under 1 µs apart
    assert d["capture_kernel_us"] == 1300.0 + 120.0 - 900.0
    assert d["shared_kernel_delta_us"] == -4000.0 + 0.4
    assert d["capture_kernel_pct"] == 100 * 520.0 / 41400.0
    assert (d["kernels_forward"], d["kernels_captured"]) == (144, 192)


def test_profile_diff_without_profiles_reports_why():
    d = profile_diff("not profiled (RuntimeError: x)", None)
    assert d == {"kernels_forward": "not profiled (RuntimeError: x)", "kernels_captured": None}


def test_paired_overhead_alternates_the_order_and_reports_the_spread():
    calls: list[str] = []
    times = {"plain": iter([1.0, 1.0, 1.0, 1.0]), "captured": iter([1.02, 1.04, 1.01, 1.03])}

    def timed(fn) -> float:
        calls.append(fn)
        return next(times[fn])

    r = paired_overhead("plain", "captured", 4, timed)
    assert calls == ["plain", "captured", "captured", "plain", "plain", "captured", "captured", "plain"]
    assert r["pairs"] == 4
    assert abs(r["overhead_pct"] - 2.5) < 1e-9  # median of 2, 4, 1, 3 %
    assert [round(x, 9) for x in r["overhead_pct_range"]] == [1.0, 4.0]
    lo, hi = r["overhead_pct_quartiles"]
    assert 1.0 <= lo < 2.5 < hi <= 4.0
