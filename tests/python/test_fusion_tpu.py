"""DeferAndFuse on the `tpu` device (tessera/_fusion_device.py): on the emulated device,
placeholders in device memory allocated only when a flush materialises them, kernels run on
the device's execution path, results equal to CPU eager; the allocator's peak for the 8-op
chain is inputs + output; on TorchTPU (a stand-in in its own process, since TorchTPU and the
emulated device cannot share one) each fused kernel registers once and is called, no JAX.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest -q tests/python/test_fusion_tpu.py
"""
import gc
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import tessera
from tessera import _fusion_device, emulated_tpu, fusion
from fusion_workloads import chain, rmsnorm

DEFER = tessera.EagerMode.DEFER_AND_FUSE
HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def tpu():
    return emulated_tpu.enable()


@pytest.fixture(autouse=True)
def _fresh_stats():
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT
    fusion.reset_stats()
    yield
    assert tessera.get_eager_mode() is tessera.EagerMode.STRICT


def is_allocated(t):
    return torch.ops.tessera_emulated_tpu.is_allocated(t)


def deferred(fn, *args):
    """fn(*args) under the mode, flushed; with the flush's stats."""
    with tessera.set_eager_mode(DEFER):
        out = fn(*args)
        fusion.flush()
    return out, fusion.stats()


# ---- results equal CPU eager ------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chain_on_tpu_matches_cpu_eager(dtype, tol):
    x = torch.randn(67, 384).to(dtype)
    want = chain(x)
    got, s = deferred(chain, x.to("tpu"))
    assert got.device.type == "tpu" and got.dtype == dtype
    assert s["kernels_launched"] == 1 and s["ops_deferred"] >= 8 and not s["fallbacks"], s
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


def test_rmsnorm_and_softmax_on_tpu_are_one_kernel_each():
    x, w = torch.randn(64, 512), torch.rand(512) + 0.5
    want = rmsnorm(x, w)
    got, s = deferred(rmsnorm, x.to("tpu"), w.to("tpu"))
    assert s["kernels_launched"] == 1 and not s["fallbacks"], s
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)

    fusion.reset_stats()
    want = torch.softmax(x * 0.5, -1)
    got, s = deferred(lambda t: torch.softmax(t * 0.5, -1), x.to("tpu"))
    assert s["kernels_launched"] == 1 and not s["fallbacks"], s
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


def test_backward_on_tpu_matches_cpu_eager():
    torch.manual_seed(1)
    x0, w0 = torch.randn(32, 256), torch.rand(256) + 0.5

    def loss_and_grads(x, w):
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        h = torch.nn.functional.silu(rmsnorm(x, w))
        loss = (torch.softmax(h, -1) * h).sum()
        loss.backward()
        return loss.detach(), x.grad, w.grad

    want = loss_and_grads(x0, w0)
    with tessera.set_eager_mode(DEFER):
        got = loss_and_grads(x0.to("tpu"), w0.to("tpu"))
    s = fusion.stats()
    assert s["kernels_launched"] >= 2 and s["flush_causes"].get("backward", 0) >= 1, s
    assert not s["fallbacks"], s
    for g, w in zip(got, want):
        assert g.device.type == "tpu"
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)


def test_temporary_between_kernels_lives_on_the_device_and_is_freed():
    # A column sum and its reader: two kernels, the sum stored in a device temporary.
    x = torch.randn(256, 128)
    want = x * torch.tanh(x).sum(0, keepdim=True)
    xt = x.to("tpu")
    gc.collect()
    base = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    got, s = deferred(lambda t: t * torch.tanh(t).sum(0, keepdim=True), xt)
    assert s["kernels_launched"] == 2 and s["temporaries"] == 1, s
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    out_bytes, temp_bytes = got.numel() * 4, 128 * 4
    assert torch.tpu.max_memory_allocated() - base == out_bytes + temp_bytes
    assert torch.tpu.memory_allocated() - base == out_bytes  # the temporary is gone


def test_views_in_place_and_held_intermediates():
    x = torch.randn(8, 3, 128)
    a_want = x * 2.0
    b_want = (a_want.reshape(24, 128) + 1.0).relu_()
    with tessera.set_eager_mode(DEFER):
        a = x.to("tpu") * 2.0  # held: written too
        b = (a.reshape(24, 128) + 1.0).relu_()  # a view's result, then in place
        v = b[:, :5]  # a strided view of a pending tensor: flushes
    assert fusion.stats()["flushes"] >= 1
    torch.testing.assert_close(a.cpu(), a_want)
    torch.testing.assert_close(b.cpu(), b_want)
    torch.testing.assert_close(v.cpu(), b_want[:, :5])


def test_cpu_of_a_pending_tensor_flushes():
    x = torch.randn(16, 128)
    with tessera.set_eager_mode(DEFER):
        y = torch.exp(x.to("tpu") - 1.0)
        assert not is_allocated(y)
        c = y.cpu()
    s = fusion.stats()
    assert s["flush_causes"] == {"eager-op:_to_copy": 1} and s["kernels_launched"] == 1, s
    torch.testing.assert_close(c, torch.exp(x - 1.0))


# ---- memory: placeholders, intermediates, the 8-op chain's peak --------------------------------


def test_placeholders_have_no_memory_until_the_flush():
    x = torch.randn(64, 256, device="tpu")
    gc.collect()
    base = torch.tpu.memory_stats()
    with tessera.set_eager_mode(DEFER):
        a = x * 3.0  # dropped below: never allocated
        b = torch.tanh(a)
        del a
        view = b.view(-1)
        assert not is_allocated(b) and not is_allocated(view)
        assert torch.tpu.memory_stats()["allocation.all.allocated"] == base["allocation.all.allocated"]
        fusion.flush()
    after = torch.tpu.memory_stats()
    assert is_allocated(b) and view.data_ptr() == b.data_ptr()
    assert after["allocation.all.allocated"] - base["allocation.all.allocated"] == 1  # b only
    assert after["allocated_bytes.all.current"] - base["allocated_bytes.all.current"] == b.numel() * 4
    torch.testing.assert_close(view.cpu(), torch.tanh(x.cpu() * 3.0).view(-1))


def chain_peaks(n=1024):
    """Peak allocated bytes above the inputs' for the 8-op chain on `n`x`n` f32, strict and
    deferred (torch.tpu.max_memory_allocated after a reset, each from the same start)."""
    x = torch.randn(n, n, device="tpu")
    peaks = {}
    for mode in (tessera.EagerMode.STRICT, DEFER):
        gc.collect()  # earlier tests' garbage must not be freed during the measurement
        torch.tpu.reset_peak_memory_stats()
        base = torch.tpu.memory_allocated()  # the input's bytes are in it
        with tessera.set_eager_mode(mode):
            y = chain(x)
        peaks[mode.value] = torch.tpu.max_memory_allocated() - base
        del y
    return x.numel() * 4, peaks


def test_eight_op_chain_peak_is_inputs_plus_output():
    _fusion_device.hbm_bytes(reset=True)
    in_bytes, peaks = chain_peaks(1024)
    out_bytes = 1024 * 1024 * 4
    # Deferred: the output is the only allocation; the input was there already.
    assert peaks["defer_and_fuse"] == out_bytes, peaks
    # And the one kernel's cost estimate moves exactly the input and the output once.
    assert _fusion_device.hbm_bytes() == {"bytes": in_bytes + out_bytes, "kernels": 1}
    assert peaks["strict"] > out_bytes, peaks
    print(f"\n8-op chain 1024x1024 f32 on the emulated tpu: peak allocated = inputs {in_bytes / MiB:.0f} MiB + "
          f"{peaks['defer_and_fuse'] / MiB:.0f} MiB deferred, + {peaks['strict'] / MiB:.0f} MiB strict")


# ---- fallbacks --------------------------------------------------------------------------------


def test_unsupported_inputs_fall_back_with_the_reason():
    x = torch.randn(16, 128, device="tpu")
    i = torch.arange(16 * 128, device="tpu").reshape(16, 128)
    c = torch.tensor(2.0)  # a CPU 0-dim tensor with tpu ones: torch allows it, a recording does not
    with tessera.set_eager_mode(DEFER):
        y = torch.exp(x) * c
        z = i * 3  # int64
    s = fusion.stats()
    assert s["eager_reasons"].get("fusion-device-mix") == 1 and s["eager_reasons"].get("fusion-dtype") == 1, s
    torch.testing.assert_close(y.cpu(), torch.exp(x.cpu()) * 2.0)
    assert torch.equal(z.cpu(), i.cpu() * 3)


def test_a_failing_launch_replays_eagerly_and_says_why():
    def broken(program, i, inputs, outputs):
        raise RuntimeError(f"launch {program.kernel_name(i)} refused by the device")

    x = torch.randn(16, 128)
    with _fusion_device.route("tpu", broken):
        got, s = deferred(chain, x.to("tpu"))
    assert len(s["fallbacks"]) == 1 and "refused by the device" in s["fallbacks"][0], s
    torch.testing.assert_close(got.cpu(), chain(x), rtol=1e-5, atol=1e-5)


def test_dump_has_the_mosaic_of_each_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DUMP_FUSION", str(tmp_path))
    deferred(rmsnorm, torch.randn(8, 128, device="tpu"), torch.ones(128, device="tpu"))
    (dump,) = list(tmp_path.iterdir())
    text = dump.read_text()
    assert "# kernel 0" in text and "# mosaic of tessera.fusion." in text and "func.func" in text, text[:2000]


# ---- TorchTPU (stand-in, its own process) -----------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="torch-tpu is not installed")
def test_torch_tpu_registers_each_kernel_once_and_calls_it_without_jax(tmp_path):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fusion_torch_tpu_path.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["jax_modules"] == [], f"the TorchTPU path imported {report['jax_modules']}"
    assert report["registered"] and set(report["registered"].values()) == {1}, report["registered"]
    assert set(report["calls"].values()) == {2}, report["calls"]  # each workload flushed twice
    assert set(report["calls"]) == set(report["registered"])
    for name, w in report["work"].items():
        first, second = w["runs"]
        assert first["registered"] - w["before"][0] == first["kernels"], (name, w)  # one module per kernel
        assert second["registered"] == first["registered"], (name, w)  # the repeat registers nothing
        assert second["calls"] - first["calls"] == second["kernels"], (name, w)
    assert len(report["modules"]) == len(report["registered"])
    assert report["work"]["colsum_then_scale"]["runs"][0]["kernels"] == 2


def test_bool_results_and_where_on_tpu():
    x, y = torch.randn(32, 128), torch.randn(32, 128)
    want_mask, want = x > y, torch.where(x > y, x, y * 0.5)
    with tessera.set_eager_mode(DEFER):
        xt, yt = x.to("tpu"), y.to("tpu")
        mask = xt > yt  # a bool result: int8 memory on the device
        out = torch.where(mask, xt, yt * 0.5)
        fusion.flush()
    assert fusion.stats()["kernels_launched"] == 1 and mask.dtype == torch.bool
    assert torch.equal(mask.cpu(), want_mask)
    torch.testing.assert_close(out.cpu(), want)


def test_an_alias_through_a_storage_object_reads_the_value():
    """A placeholder's storage taken as an object (no tensor the mode could track) and the
    placeholder dropped: `untyped_storage()` of a pending tensor flushes, and the storage's
    memory holds the value (the recording held it; whoever holds it at the flush gets it)."""
    x = torch.randn(8, 128, device="tpu")
    with tessera.set_eager_mode(DEFER):
        y = x * 2.0
        storage = y.untyped_storage()
        del y
        z = x * 3.0
        zs = z.untyped_storage()
        del z
        fusion.flush()
    alias = torch.empty(0, device="tpu").set_(storage, 0, (8, 128))
    torch.testing.assert_close(alias.cpu(), x.cpu() * 2.0)
    torch.testing.assert_close(torch.empty(0, device="tpu").set_(zs, 0, (8, 128)).cpu(), x.cpu() * 3.0)


def test_a_library_op_between_fused_ops_on_tpu():
    # torch.ops.tpu.rmsnorm is not recorded: its pending input flushes, it runs on the tpu
    # path (its PrivateUse1 kernel), and its result feeds the next recording.
    x, w = torch.randn(32, 128), torch.rand(128) + 0.5
    want = torch.tanh(rmsnorm(x * 2.0, w)) + 1.0
    with tessera.set_eager_mode(DEFER):
        h = torch.ops.tpu.rmsnorm(x.to("tpu") * 2.0, w.to("tpu"))
        y = torch.tanh(h) + 1.0
    s = fusion.stats()
    assert s["kernels_launched"] == 2 and s["flush_causes"] == {"eager-op:rmsnorm": 1, "exit": 1}, s
    assert y.device.type == "tpu"
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)


def test_a_held_result_read_by_a_later_kernel():
    x = torch.randn(64, 128)
    s_want = torch.tanh(x).sum(0, keepdim=True)
    with tessera.set_eager_mode(DEFER):
        xt = x.to("tpu")
        s = torch.tanh(xt).sum(0, keepdim=True)  # held, and read by the next kernel
        y = xt * s
    st = fusion.stats()
    assert st["kernels_launched"] == 2 and st["temporaries"] == 0, st
    torch.testing.assert_close(s.cpu(), s_want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.cpu(), x * s_want, rtol=1e-4, atol=1e-4)
