"""The one definition of sites and of the last-token route rule (`trace_core.sites`), and the trainer's sides that
follow it: `pack_microbatch` marks the unrouted rows, `source_from_store` serves no route there."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.rows import pack_microbatch
from megatron_trace.source import source_from_store
from trace_core.records.reader import MicroBatchRecords
from trace_core.records.store import parse_site, site_key
from trace_core.sites import check_site, routed


@pytest.mark.parametrize("site", [(0, "moe_in"), (3, "k"), (12, "v")])
def test_a_valid_site_round_trips_through_its_store_key(site):
    assert check_site(site) == site
    assert parse_site(site_key(site)) == site


@pytest.mark.parametrize("site", [(-1, "k"), (True, "k"), (0, "fc2_in"), (1.0, "v"), (0,), "0.k", (0, "k", 1)])
def test_a_malformed_site_is_refused_by_name(site):
    with pytest.raises(ValueError, match="site must be"):
        check_site(site)
    if isinstance(site, tuple) and len(site) == 2:
        with pytest.raises(ValueError, match="site must be"):
            site_key(site)


def test_every_position_but_the_last_is_routed():
    lengths = torch.tensor([[1], [3], [5]])
    got = routed(torch.arange(5), lengths)
    assert got.tolist() == [[False] * 5, [True, True, False, False, False], [True] * 4 + [False]]


def test_the_packed_microbatch_marks_exactly_the_unrouted_rows():
    mb = pack_microbatch([(0, torch.arange(3)), (1, torch.arange(5))], seq_len=6)
    last = mb.rows.last.reshape(6, 2).t()  # rows are [s, b]-major
    assert last.tolist() == [[False, False, True, False, False, False], [False] * 4 + [True, False]]


def test_store_routes_are_served_on_routed_positions_only():
    """Routes the store holds at a final token (what an embedded rollout that fed every token back writes) are not
    served; routes it lacks before the final token stay missing (R3 then refuses the step)."""
    b, t, layers, topk = 2, 6, 2, 2
    routes = torch.arange(b * t * layers * topk, dtype=torch.int32).reshape(b, t, layers, topk)
    has = torch.zeros(b, t, dtype=torch.bool)
    has[0, :4] = True  # trajectory 0: 4 tokens, routes stored for every one
    has[1, :2] = True  # trajectory 1: 5 tokens, routes stored for positions 0 and 1 only
    loaded = MicroBatchRecords(records={}, has_record={}, routes=routes, has_routes=has)
    source = source_from_store(loaded, moe_layers=(1, 3), lengths=[4, 5])
    rows = pack_microbatch([(0, torch.arange(4)), (1, torch.arange(5))], seq_len=t).rows
    for j, layer in enumerate((1, 3)):
        idx, served = source.routes(layer, rows)
        expect = torch.tensor([[True, True, True, False, False, False], [True, True, False, False, False, False]])
        assert torch.equal(served.reshape(t, b).t(), expect)
        got = idx.reshape(t, b, topk).transpose(0, 1)
        assert torch.equal(got[expect], routes[:, :, j][expect].long())
    with pytest.raises(ValueError, match="lengths names 1"):
        source_from_store(loaded, moe_layers=(1, 3), lengths=[4])
