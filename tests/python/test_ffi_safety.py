"""Every `unsafe` read or write of tensor memory in the native bridge
(`interop/torch/src/tensor.rs`), fed the wrong thing (issue 9: "every unsafe block has a
SAFETY comment naming what it relies on and a test that feeds it the wrong thing").

| unsafe site (tensor.rs)                  | relies on                              | wrong inputs below                          |
|------------------------------------------|----------------------------------------|---------------------------------------------|
| `Described::borrow`, int64 narrowing     | contiguous, aligned, host, n elements  | non-host, non-contiguous, out-of-int32, 0-d |
| `Described::borrow`, bool bytes          | n host bytes                           | a bool view holding byte 2                  |
| `TensorRef::host` (f32/bf16/i32/i8)      | contiguous, aligned, host, alive       | meta/other device, misaligned, strided,     |
|                                          |                                        | negated views, zero-size, huge stride-0     |
| `TensorRef::host_mut` (outputs)          | exclusive (no alias), own memory       | output aliasing an input or another output, |
|                                          |                                        | a bool output                               |

The Rust side's other unsafe code (the interpreter's GEMM call, the JIT's block copies,
GEMMs and compiled code) is fed wrong operands and lying IR in
`tests/tests/conformance.rs` (`wrong_operands_are_errors_not_ub`,
`edited_ir_is_an_error_not_ub`) on every backend.
"""

import pytest
import torch

import tessera  # noqa: F401
from tessera import _native, _tpu

tpu = torch.ops.tpu


def _raises(fn, *words):
    with pytest.raises((ValueError, RuntimeError)) as e:
        fn()
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


# ---- host(): float data -------------------------------------------------------------------

def test_non_host_devices_are_refused_never_read():
    x = torch.randn(8, 128)
    _raises(lambda: tpu.matmul(x, torch.randn(128, 8, device="meta")), "operand-device", "matmul", "`y`")
    # Every tensor on meta: the fake kernel, shapes only, nothing read.
    out = tpu.matmul(x.to("meta"), torch.randn(128, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (8, 8)
    # Straight to the native CPU entry (what the CPU kernel calls): refused by the bridge.
    _raises(lambda: _native.run("softmax", (), [torch.empty(8, 128, device="meta")], torch.device("cpu"), "v5e"), "operand-device", "softmax", "`x`", "meta")


def test_misaligned_memory_is_read_through_an_aligned_copy():
    # float32 values at a 2-byte offset into a byte buffer (frombuffer keeps the offset).
    want = torch.randn(8, 128)
    buf = bytearray(2) + bytearray(want.numpy().tobytes())
    x = torch.frombuffer(buf, dtype=torch.float32, count=8 * 128, offset=2).reshape(8, 128)
    assert x.data_ptr() % 4 != 0, "the test needs a misaligned tensor"
    torch.testing.assert_close(x, want)
    torch.testing.assert_close(tpu.softmax(x), torch.softmax(want, -1))


def test_strided_negated_and_broadcast_views_read_their_values():
    x = torch.randn(128, 16)
    torch.testing.assert_close(tpu.softmax(x.t()), torch.softmax(x.t(), -1))  # non-contiguous
    torch.testing.assert_close(tpu.softmax(x[::2]), torch.softmax(x[::2], -1))  # strided rows
    neg = torch._neg_view(x)  # lazily negated: the memory holds x, the values are -x
    assert neg.is_neg()
    torch.testing.assert_close(tpu.softmax(neg), torch.softmax(-x, -1))
    row = torch.randn(1, 128).expand(64, 128)  # stride 0
    torch.testing.assert_close(tpu.softmax(row), torch.softmax(row.contiguous(), -1))


def test_zero_size_tensors_are_errors_not_null_reads():
    _raises(lambda: tpu.softmax(torch.empty(0, 128)), "softmax")
    _raises(lambda: tpu.softmax(torch.empty(8, 0)), "softmax")


def test_huge_stride0_view_is_refused_before_any_copy():
    x = torch.zeros(1).expand(1 << 20, 1 << 20)  # 4 TiB if made contiguous
    msg = _raises(lambda: tpu.softmax(x), "softmax")
    assert "hbm" in msg or "host-memory" in msg or "shape" in msg, msg


# ---- borrow(): int64 narrowing -------------------------------------------------------------

def test_int64_indices_are_range_checked_not_wrapped():
    logits = torch.randn(4, 16)
    ok = torch.tensor([1, 2, 3, -100])
    loss, _ = tpu.cross_entropy(logits, ok)
    want = torch.nn.functional.cross_entropy(logits, ok, reduction="none")
    torch.testing.assert_close(loss, want)
    for bad in (2**32 + 1, -(2**31) - 1, 2**63 - 1):
        labels = torch.tensor([1, 2, bad, 0])
        _raises(lambda: tpu.cross_entropy(logits, labels), "cross_entropy", "`labels`")
    # Non-contiguous int64 (read through a copy, then narrowed).
    wide = torch.tensor([[1, 9], [2, 9], [3, 9], [0, 9]])[:, 0]
    assert not wide.is_contiguous()
    torch.testing.assert_close(tpu.cross_entropy(logits, wide)[0], torch.nn.functional.cross_entropy(logits, wide, reduction="none"))


# ---- borrow(): bool bytes, host_mut(): outputs (through the emulator entry, which takes
# caller tensors for inputs and outputs) -------------------------------------------------------

def _softmax_plan(x):
    return _tpu.plan_for(_native, "softmax", (), [x], "v5e")


def test_bool_tensor_holding_other_bytes_is_refused():
    x = torch.randn(8, 128)
    plan = _softmax_plan(x)
    bad = torch.tensor([0, 2] * 512, dtype=torch.uint8).view(torch.bool).reshape(8, 128)
    out = torch.empty(8, 128)
    _raises(lambda: plan.emulate(0, [bad], [out], None), "bytes other than 0 and 1")


def test_outputs_aliasing_inputs_or_each_other_are_refused():
    x = torch.randn(8, 128)
    plan = _softmax_plan(x)
    _raises(lambda: plan.emulate(0, [x], [x], None), "output-aliasing")
    _raises(lambda: plan.emulate(0, [x], [x[:4]], None), "softmax")  # overlapping and the wrong shape
    out = torch.empty(8, 128)
    plan.emulate(0, [x], [out], None)
    torch.testing.assert_close(out, torch.softmax(x, -1))
    _raises(lambda: plan.emulate(0, [x], [torch.empty(8, 128, dtype=torch.bool)], None), "softmax")
