"""One capture policy (`trace_core.records.spec.CapturePolicy`): the RL config's `record_bits` / `record_all_layers` and
a server's `--trace-record-bits` / `--trace-layers` parse into it, and the record spec of both sides comes from it."""

from types import SimpleNamespace

import pytest

from sglang_trace.config import SERVER_ARGS_FIELDS, parse_trace_args
from trace_core.records.spec import CapturePolicy, RecordSpec
from trace_rl.config import RLConfig

LAYERS = (0, 1, 2, 3, 4)


def test_the_policy_selects_layers_once_for_every_spec():
    assert CapturePolicy(1, "all").select(LAYERS) == LAYERS
    assert CapturePolicy(1, "latter-half").select(LAYERS) == (2, 3, 4)
    assert CapturePolicy(4, (1, 3, 9)).select(LAYERS) == (1, 3)
    assert CapturePolicy(1, "latter-half").spec(LAYERS, LAYERS) == RecordSpec.latter_half(LAYERS, LAYERS)
    default = RecordSpec.default(LAYERS, (), 2, "nvfp4-w4a4-kv4")
    assert CapturePolicy(2, "all").spec(LAYERS, (), "nvfp4-w4a4-kv4") == default
    for bad in ("first-half", (1, 1), (-1,), (True,)):
        with pytest.raises(ValueError, match="capture layers"):
            CapturePolicy(1, bad)


@pytest.mark.parametrize(("all_layers", "flag"), [(True, "all"), (False, "latter-half")])
def test_the_rl_config_and_the_server_flags_parse_into_the_same_policy(all_layers, flag):
    cfg = RLConfig(record_bits=2, record_all_layers=all_layers)
    fields = SimpleNamespace(**(SERVER_ARGS_FIELDS | {"trace_record_bits": 2, "trace_layers": flag}))
    assert cfg.capture_policy() == parse_trace_args(fields).policy == CapturePolicy(2, flag)
