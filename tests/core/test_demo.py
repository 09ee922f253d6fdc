"""The numerics demo computes what its table claims, on a small synthetic batch."""

from trace_core import demo


def test_demo_table_shows_trace_removing_the_amplification(capsys):
    rows = demo.run(tokens=128, hidden=256, noise_ulps=16.0, seed=0)
    assert [(r.fmt, r.method) for r in rows] == [(f, m) for f, _ in demo.FORMATS for m in demo.METHODS]
    by = {(r.fmt, r.method): r for r in rows}
    for fmt, _ in demo.FORMATS:
        rtn, full = by[(fmt, "RTN")], by[(fmt, "TRACE full")]
        assert rtn.flip_rate > 0 and rtn.relative_excess > 0
        assert full.flip_rate < rtn.flip_rate and full.discrepancy < rtn.discrepancy
        # More guidance bits never hurt on this data: b=1 >= b=2 >= full information in discrepancy.
        assert by[(fmt, "TRACE b=1")].discrepancy >= by[(fmt, "TRACE b=2")].discrepancy >= full.discrepancy
    demo.main(["--tokens", "64", "--hidden", "128"])
    out = capsys.readouterr().out
    assert "TRACE b=1" in out and "code-flip rate" in out and "kv_fp4" in out
