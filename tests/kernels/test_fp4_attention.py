"""FP4-KV decode and extend attention (`trace_core.kernels.fp4_attention`, `fp4_extend_attention`) and their
pure-torch twins (`trace_core.numerics.kv_attention`).

On CPU the kernels run under the Triton interpreter (in a subprocess: the flag is read when triton builds a
launcher) against SGLang's own triton decode and extend kernels on the dequantized cache, bit for bit, and against
the twins. On the GPU (`-m gpu`) the same checks run in BF16, the dtype SGLang's FP4 pool dequantizes to (decode:
GQA equal to SGLang bit for bit; MHA against the twin only: SGLang's MHA kernel sums q . k in BF16, ours in FP32.
Extend: within one BF16 rounding of SGLang, as of the twin: the FP4 kernel's prefix K and V reach the tensor-core
dot from registers, SGLang's from memory, and the compiled dots need not sum in the same order; the fraction of
outputs that differ is measured by bench/fp4_attention.py). Both pool formats: `kv_fp4` (E8M0 scale bytes) and
NVFP4 KV (E4M3 scale bytes under the static unit global scale), at the same tolerances.

Tolerance of kernel vs twin: the twin replays the kernels' splits, blocks, online softmax and casts, so what differs
is the order of FP32 sums inside the two dot products and `exp` (`ex2.approx` on the GPU): a few FP32 ulps of the
logits and weights, 1e-4 absolute / relative on outputs of magnitude up to ~30 in FP32; in BF16 those ulps can
move an output across one BF16 rounding boundary (relative 2^-8) or a probability's BF16 cast before P V
(relative 2^-8 of one term), hence 2^-7 relative plus 2^-7 absolute.
"""

from functools import partial

import pytest
import torch

from tests import fp4_attention_checks as checks
from tests import fp4_attention_interpret
from tests.interpret import Interpreted, interpret
from trace_core.kernels import fp4_attention
from trace_core.kernels.fp4_attention import check_fp4_cache, fp4_words
from trace_core.numerics.formats import KV_FP4, MXFP4, NVFP4
from trace_core.numerics.kv_attention import decode_attention_reference, dequantize_kv, extend_attention_reference

KV_FMTS = [KV_FP4, NVFP4]


@pytest.mark.parametrize("kv_fmt", KV_FMTS, ids=lambda f: f.name)
def test_twin_is_softmax_attention_over_the_dequantized_cache(kv_fmt):
    heads, group, d, lens = 2, 4, 64, [70, 9]
    q, kc, ks, vc, vs, indptr, indices, nsplit = checks.make_case(heads, group, d, lens, [3, 1], torch.float32, "cpu",
                                                                  kv_fmt=kv_fmt)  # fmt: skip
    out = decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, nsplit, 0.125, kv_dtype=torch.float32,
                                     kv_fmt=kv_fmt)  # fmt: skip
    for b in range(len(lens)):
        slots = indices[indptr[b] : indptr[b + 1]]
        k = dequantize_kv(kc[slots], ks[slots], torch.float32, fmt=kv_fmt).repeat_interleave(group, 1)
        v = dequantize_kv(vc[slots], vs[slots], torch.float32, fmt=kv_fmt).repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * 0.125, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("hn,nhd->hd", w, v), rtol=1e-5, atol=1e-5)


def test_dequantize_kv_is_the_kv_fp4_value():
    codes = torch.tensor([[[0x21, 0xF8, 0, 0, 0, 0, 0, 0]]], dtype=torch.uint8)  # codes 1, 2, 8, 15: low nibble first
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    out = dequantize_kv(codes, scales, torch.float32)
    assert out[0, 0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]


def test_dequantize_kv_is_the_nvfp4_value_under_the_static_unit_scale():
    codes = torch.tensor([[[0x21, 0xF8, 0, 0, 0, 0, 0, 0]]], dtype=torch.uint8)  # codes 1, 2, 8, 15: low nibble first
    for byte, sf in ((0x3A, 1.25), (0x01, 2.0**-9), (0x7E, 448.0)):  # E4M3 1.25, the least subnormal, the largest
        out = dequantize_kv(codes, torch.tensor([[byte]], dtype=torch.uint8), torch.float32, fmt=NVFP4)
        assert out[0, 0, :4].tolist() == [0.5 * sf, 1.0 * sf, -0.0, -6.0 * sf]
    assert torch.equal(dequantize_kv(codes, torch.tensor([[0x3A]], dtype=torch.uint8), fmt=NVFP4)[0, 0, :4],
                       torch.tensor([0.625, 1.25, -0.0, -7.5], dtype=torch.bfloat16))  # fmt: skip


def test_other_kv_formats_are_refused_by_name():
    from trace_core.kernels.fp4_extend_attention import fp4_extend_attention

    q, kc, ks, vc, vs, indptr, indices, nsplit = checks.make_case(1, 2, 64, [5], [1], torch.float32, "cpu")
    with pytest.raises(ValueError, match="reads \\['kv_fp4', 'nvfp4'\\] pools, not mxfp4"):
        dequantize_kv(kc, ks, fmt=MXFP4)
    with pytest.raises(ValueError, match="not mxfp4"):
        decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, nsplit, 0.125, kv_fmt=MXFP4)
    logits, lse = torch.empty(1, 2, 1, 64), torch.empty(1, 2, 1)
    with pytest.raises(ValueError, match="not mxfp4"):
        fp4_attention.fp4_decode_attention(q, kc, ks, vc, vs, torch.empty_like(q), indptr, indices, logits, lse, nsplit,
                                           1, 0.125, kv_fmt=MXFP4)  # fmt: skip
    q, k, v, kc, ks, vc, vs, qo, kvp, idx, n = checks.make_extend_case(checks.EXTEND_CASES[0], torch.float32, "cpu")
    with pytest.raises(ValueError, match="not mxfp4"):
        extend_attention_reference(q, k, v, kc, ks, vc, vs, qo, kvp, idx, 0.125, kv_fmt=MXFP4)
    with pytest.raises(ValueError, match="not mxfp4"):
        fp4_extend_attention(q, k, v, torch.empty_like(q), kc, ks, vc, vs, qo, kvp, idx, None, True, None, n, 1.0, 1.0,
                             kv_fmt=MXFP4)  # fmt: skip


def test_grouped_launch_is_restored_in_place():
    default = dict(fp4_attention.GROUPED_LAUNCH)
    with pytest.raises(RuntimeError, match="inside"):
        with fp4_attention.grouped_launch({"num_warps": 4, "num_stages": 2}):
            assert fp4_attention.GROUPED_LAUNCH == {"num_warps": 4, "num_stages": 2}
            raise RuntimeError("inside")
    assert fp4_attention.GROUPED_LAUNCH == default


def test_bad_cache_is_named():
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    kc = torch.zeros(10, 2, 32, dtype=torch.uint8)
    ks = torch.zeros(10, 8, dtype=torch.uint8)
    assert check_fp4_cache(q, kc, ks, kc, ks) == (2, 64)
    with pytest.raises(ValueError, match="power-of-two head dim >= 16, got 48"):
        check_fp4_cache(q, kc[..., :24], ks, kc[..., :24], ks)
    assert check_fp4_cache(q[..., :16], kc[..., :8], ks[:, :2], kc[..., :8], ks[:, :2]) == (2, 16)
    with pytest.raises(ValueError, match="power-of-two head dim >= 16, got 8"):
        check_fp4_cache(q[..., :8], kc[..., :4], ks[:, :1], kc[..., :4], ks[:, :1])
    with pytest.raises(ValueError, match="k_scales must be uint8 \\(10, 8\\)"):
        check_fp4_cache(q, kc, ks[:, :4], kc, ks)
    with pytest.raises(ValueError, match="q must be"):
        check_fp4_cache(q[:, :3], kc, ks, kc, ks)
    with pytest.raises(ValueError, match="FP4 KV codes must be uint8"):
        check_fp4_cache(q, kc.float(), ks, kc, ks)
    assert fp4_words(kc, ks)[0].shape == (10, 2, 8)
    with pytest.raises(ValueError, match="readable as 4-byte words"):
        fp4_words(torch.zeros(10, 2, 33, dtype=torch.uint8)[..., 1:], ks)


@pytest.fixture(scope="module")
def interpreted() -> Interpreted:
    """Every case of `tests.fp4_attention_interpret`, run once in one interpreter subprocess."""
    pytest.importorskip("triton")
    return interpret("tests.fp4_attention_interpret")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(fp4_attention_interpret.cases()))
def test_kernel_under_the_interpreter(interpreted, case):
    interpreted.check(case)


def test_sglang_option_is_refused_by_name(monkeypatch):
    from sglang_trace import fp4_attention

    for bad in ("prefill", "decode,decode", "decode,", ""):
        monkeypatch.setenv(fp4_attention.ENV, bad)
        with pytest.raises(ValueError, match=f"TRACE_FP4_ATTENTION={bad!r} is not 'off' or a comma-separated set"):
            fp4_attention.phases()
    monkeypatch.setenv(fp4_attention.ENV, "extend,decode")
    assert fp4_attention.phases() == {"decode", "extend"}
    assert not fp4_attention.reads_fp4(object(), "extend")  # a pool without FP4 scale buffers keeps SGLang's path
    with pytest.raises(ValueError, match="phase 'prefill' is not one of"):
        fp4_attention.reads_fp4(object(), "prefill")
    monkeypatch.setenv(fp4_attention.ENV, "decode")
    assert fp4_attention.phases() == {"decode"}
    monkeypatch.setenv(fp4_attention.ENV, "off")
    assert fp4_attention.phases() == frozenset()
    monkeypatch.delenv(fp4_attention.ENV)
    assert fp4_attention.phases() == {"decode", "extend"}  # on by default (over an FP4 pool)


def test_the_triton_backend_reads_fp4_by_default_over_an_fp4_pool_and_refuses_what_the_kernels_skip(monkeypatch):
    """Patch 0004 asks `backend_phases(backend)` when SGLang's triton backend is built: over SGLang's real FP4 pool
    (and a hybrid pool holding one) both phases read FP4 unless `TRACE_FP4_ATTENTION` narrows them; a BF16 pool keeps
    SGLang's path; backend settings the kernels do not cover are refused by name. The backend is the fields
    `backend_phases` reads (the real one needs CUDA)."""
    from types import SimpleNamespace

    from tests.sglang_cpu import install_sgl_kernel_stand_in

    install_sgl_kernel_stand_in()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolFP4

    from sglang_trace import fp4_attention

    kw = dict(size=8, page_size=1, head_num=2, head_dim=32, layer_num=1, device="cpu", enable_memory_saver=False,
              enable_alt_stream=False)  # fmt: skip
    fp4, bf16 = MHATokenToKVPoolFP4(dtype=torch.float4_e2m1fn_x2, **kw), MHATokenToKVPool(dtype=torch.bfloat16, **kw)

    def backend(pool, **settings) -> SimpleNamespace:
        base = dict(token_to_kv_pool=pool, page_size=1, dcp_size=1, use_mla=False, enable_deterministic=False)
        return SimpleNamespace(**(base | settings))

    monkeypatch.delenv(fp4_attention.ENV, raising=False)
    assert fp4_attention.backend_phases(backend(fp4)) == {"decode", "extend"}
    assert fp4_attention.backend_phases(backend(SimpleNamespace(full_kv_pool=fp4))) == {"decode", "extend"}
    assert fp4_attention.backend_phases(backend(bf16)) == frozenset()
    assert fp4_attention.backend_phases(backend(bf16, page_size=16)) == frozenset()  # SGLang's path: nothing refused
    for settings, message in (
        (dict(page_size=16), "page size 16"),
        (dict(dcp_size=2), "decode context parallelism"),
        (dict(use_mla=True), "MLA"),
        (dict(enable_deterministic=True), "--enable-deterministic-inference"),
        (dict(use_verify_splitkv=True), "split-KV speculative verify"),
    ):
        with pytest.raises(ValueError, match=message):
            fp4_attention.backend_phases(backend(fp4, **settings))
    monkeypatch.setenv(fp4_attention.ENV, "decode")
    assert fp4_attention.backend_phases(backend(fp4, enable_deterministic=True)) == {"decode"}
    monkeypatch.setenv(fp4_attention.ENV, "off")
    assert fp4_attention.backend_phases(backend(fp4, page_size=16)) == frozenset()


def test_extend_refuses_what_it_does_not_replay():
    from trace_core.kernels.fp4_extend_attention import fp4_extend_attention

    q, k, v, kc, ks, vc, vs, qo, kvp, idx, n = checks.make_extend_case(checks.EXTEND_CASES[0], torch.float32, "cpu")
    args = (q, k, v, torch.empty_like(q), kc, ks, vc, vs, qo, kvp, idx)
    with pytest.raises(ValueError, match="custom mask"):
        fp4_extend_attention(*args, torch.ones(4, dtype=torch.bool), True, None, n, 1.0, 1.0)
    with pytest.raises(ValueError, match="sliding window"):
        fp4_extend_attention(*args, None, True, None, n, 1.0, 1.0, sliding_window_size=128)
    with pytest.raises(ValueError, match="xai_temperature_len"):
        fp4_extend_attention(*args, None, True, None, n, 1.0, 1.0, xai_temperature_len=8)
    with pytest.raises(ValueError, match="k_extend must be"):
        fp4_extend_attention(q, k[..., :32], *args[2:], None, True, None, n, 1.0, 1.0)


@pytest.mark.parametrize("kv_fmt", KV_FMTS, ids=lambda f: f.name)
def test_extend_twin_is_causal_softmax_attention_over_prefix_and_new_tokens(kv_fmt):
    case = checks.EXTEND_CASES[0]
    heads, group, d = case[:3]
    q, k, v, kc, ks, vc, vs, qo, kvp, idx, _ = checks.make_extend_case(case, torch.float32, "cpu", kv_fmt=kv_fmt)
    out = extend_attention_reference(q, k, v, kc, ks, vc, vs, qo, kvp, idx, 0.125, kv_dtype=torch.float32,
                                     kv_fmt=kv_fmt, tiles=(16, 32))  # fmt: skip
    for b in range(len(qo) - 1):
        slots = idx[kvp[b] : kvp[b + 1]]
        new = slice(int(qo[b]), int(qo[b + 1]))
        pre_k, pre_v = (dequantize_kv(c[slots], s[slots], torch.float32, fmt=kv_fmt) for c, s in ((kc, ks), (vc, vs)))
        keys = torch.cat([pre_k, k[new]]).repeat_interleave(group, 1)
        vals = torch.cat([pre_v, v[new]]).repeat_interleave(group, 1)
        n_pre, n_new = len(slots), new.stop - new.start
        allowed = torch.arange(n_pre + n_new)[None, :] <= n_pre + torch.arange(n_new)[:, None]
        w = torch.einsum("mhd,nhd->hmn", q[new], keys) * 0.125
        w = torch.softmax(w.masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(out[new], torch.einsum("hmn,nhd->mhd", w, vals), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt", KV_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("case", checks.CASES, ids=str)
def test_bf16_kernels_on_the_gpu(case, kv_fmt):
    checks.check_decode(case, torch.bfloat16, torch.bfloat16, "cuda", 2**-7, 2**-7, kv_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt", KV_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("case", checks.EXTEND_CASES, ids=str)
def test_bf16_extend_on_the_gpu(case, kv_fmt):
    checks.check_extend(case, torch.bfloat16, torch.bfloat16, "cuda", 2**-7, 2**-7, kv_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt", KV_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_bf16_tile_on_the_gpu(d, kv_fmt):
    checks.check_tile(d, torch.bfloat16, "cuda", kv_fmt)


@pytest.mark.gpu
def test_e4m3_decode_on_the_gpu():
    checks.check_e4m3_decode("cuda")


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph():
    from trace_core.kernels.fp4_attention import fp4_decode_attention

    q, kc, ks, vc, vs, indptr, indices, nsplit = checks.make_case(1, 8, 128, [300, 17], [4, 1], torch.bfloat16, "cuda")
    logits = torch.empty(2, 8, 4, 128, device="cuda")
    lse = torch.empty(2, 8, 4, device="cuda")
    o = torch.empty_like(q)
    run = partial(fp4_decode_attention, q, kc, ks, vc, vs, o, indptr, indices, logits, lse, nsplit, 4, 128**-0.5)
    run()
    eager = o.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    o.zero_()
    graph.replay()
    assert torch.equal(o, eager)
