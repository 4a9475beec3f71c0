"""Which kernel formats run on the GPUs rooms get (kvlab.kernels.available / why_not / formats_available).

Nothing here has a T4: the capability logic is checked with planted capabilities; that the kernels
compile and run correctly on an sm_75 GPU is not checked (the README says so)."""

import pytest

from kvlab import kernels
from kvlab.formats import ELEMENT_FORMATS

T4, A100, L4, H100 = (7, 5), (8, 0), (8, 9), (9, 0)


@pytest.mark.skipif(not kernels.available(), reason=kernels.WHY_NO_TRITON)
def test_each_format_runs_or_is_refused_in_one_line_naming_the_capability():
    on_t4 = kernels.formats_available(T4)
    assert set(on_t4) == set(ELEMENT_FORMATS)
    for fmt in ("fp32", "fp16", "int8", "int4"):
        assert kernels.available(fmt, T4) and on_t4[fmt].startswith("runs, without tensor cores"), fmt
    assert not kernels.available("bf16", T4)
    assert on_t4["bf16"].startswith("bf16 pages need compute capability 8.0 (sm_80)") and "sm_75" in on_t4["bf16"]
    assert "\n" not in on_t4["bf16"]
    assert kernels.available("bf16", A100) and kernels.formats_available(H100)["bf16"] == "runs"
    # FP8 is the PyTorch path's on every device: the kernels say so rather than fail later
    for cap in (T4, L4, H100):
        assert not kernels.available("fp8", cap) and "attn_backend='torch'" in kernels.why_not("fp8", cap)


@pytest.mark.skipif(not kernels.available(), reason=kernels.WHY_NO_TRITON)
def test_on_this_machine():
    here = kernels.formats_available()
    if kernels.gpu_capability() is None:  # the interpreter runs every kernel format
        assert {f for f, s in here.items() if s.startswith("runs")} == {f for f, e in ELEMENT_FORMATS.items() if e.kernel}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        kernels.why_not("fp4")
    with pytest.raises(ValueError, match="capability needs fmt"):
        kernels.available(capability=T4)


def test_without_triton_every_format_says_why(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_imports", lambda: False)
    assert not kernels.available() and kernels.why_not("int8", H100) == kernels.WHY_NO_TRITON


@pytest.mark.skipif(not kernels.available(), reason=kernels.WHY_NO_TRITON)
def test_a_pool_in_a_format_the_gpu_lacks_is_refused_where_it_is_built(monkeypatch):
    from kvlab.kernels.pool import check_kernel_format
    from kvlab.quant import TensorFormat

    monkeypatch.setattr(kernels, "gpu_capability", lambda: T4)
    monkeypatch.setattr(kernels, "triton_mode", lambda: "compiled")  # a T4 compiling, not the interpreter
    with pytest.raises(ValueError, match=r"layer 0's K: bf16 pages need compute capability 8.0 \(sm_80\)"):
        check_kernel_format(TensorFormat("bf16"), "layer 0's K")
    check_kernel_format(TensorFormat("int8"), "layer 0's K")  # runs on a T4
