import dataclasses

import pytest

from trace_core.numerics.formats import (
    KV_FP4,
    MXFP4,
    MXFP4_OCP,
    NVFP4,
    E8M0Rule,
    Rounding,
    ScaleKind,
    format_names,
    get_format,
)


def test_registry_returns_the_named_formats():
    assert get_format("nvfp4") is NVFP4
    assert get_format("mxfp4") is MXFP4
    assert get_format("mxfp4_ocp") is MXFP4_OCP
    assert get_format("kv_fp4") is KV_FP4
    assert get_format(KV_FP4) is KV_FP4


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown FP4 format 'fp4'.*nvfp4"):
        get_format("fp4")


def test_formats_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        NVFP4.block = 32


def test_format_parameters_follow_the_contract():
    assert (NVFP4.block, NVFP4.scale, NVFP4.rounding, NVFP4.has_global_scale) == (
        16,
        ScaleKind.E4M3,
        Rounding.NEAREST_EVEN,
        True,
    )
    assert (MXFP4.block, MXFP4.scale, MXFP4.e8m0_rule) == (32, ScaleKind.E8M0, E8M0Rule.CEIL)
    assert MXFP4_OCP.e8m0_rule is E8M0Rule.FLOOR
    assert (KV_FP4.block, KV_FP4.rounding, KV_FP4.negative_zero) == (16, Rounding.TIES_UP, False)


def test_every_format_has_its_own_kernel_id():
    """The Triton kernels branch on `kernel_id` (read from these definitions): two formats sharing one would run
    one format's rounding for the other."""
    ids = [get_format(name).kernel_id for name in format_names()]
    assert len(set(ids)) == len(ids)
