"""The emulated host-memory `tpu` device (interop/torch/python/tessera/emulated_tpu.py).

Checks that tensors on device "tpu" behave like CPU tensors through the CPU fallback
(arithmetic, matmul, reductions, indexing, bf16, views, autograd), that dispatch really
goes through the PrivateUse1 key (a throwaway op with different CPU and PrivateUse1
kernels), that `data_ptr()` on the device is readable host memory, and that enable()
refuses to share the process with TorchTPU or another PrivateUse1 backend.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_emulated_tpu.py

The first run compiles the extension (~10 s) into $TESSERA_CACHE_DIR (else
$XDG_CACHE_HOME/tessera, else ~/.cache/tessera); later runs only load it. Needs g++ and
ninja. The module under test is this checkout's, not the installed tessera package's.
"""
import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import pytest
import torch

from tessera import emulated_tpu  # noqa: E402  (the installed package: scripts/test.sh installs it first)



@pytest.fixture(scope="module")
def tpu():
    # Not a skip: if TorchTPU was autoloaded, the EmulatedTpuError says how to run this.
    # The device stays enabled for the rest of the session (it cannot be disabled).
    return emulated_tpu.enable()


def _run(code, **env):
    """Run `code` in a fresh interpreter; returns the CompletedProcess."""
    full_env = {**os.environ, **env}
    prelude = "import sys\nfrom tessera import emulated_tpu as e\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=600,
    )


# ------------------------------------------------------------------ the device


def test_enable_returns_the_tpu_device_and_is_idempotent(tpu):
    assert tpu == torch.device("tpu")
    assert emulated_tpu.is_enabled()
    assert emulated_tpu.enable() == tpu
    assert torch._C._get_privateuse1_backend_name() == "tpu"


def test_tensors_live_on_tpu_and_round_trip(tpu):
    x = torch.randn(3, 4, device="tpu")
    assert x.device.type == "tpu" and x.device.index == 0
    assert x.is_tpu and not x.is_cpu
    assert "PrivateUse1" in str(torch._C._dispatch_keys(x))

    c = torch.randn(5, 7, dtype=torch.float64)
    t = c.to("tpu")
    assert t.device.type == "tpu" and t.dtype == torch.float64
    back = t.cpu()
    assert back.device.type == "cpu"
    assert torch.equal(back, c)
    assert back.data_ptr() != t.data_ptr()  # .cpu() copies, it does not alias
    assert torch.equal(c.tpu().cpu(), c)
    assert torch.equal(t.to("tpu").cpu(), c)  # tpu -> tpu


def test_only_device_zero_exists(tpu):
    with pytest.raises(RuntimeError, match="one device"):
        torch.empty(2, device="tpu:1")


def test_random_ops_use_the_cpu_generator(tpu):
    """Random ops run on the CPU through the fallback: same seed, same numbers as on CPU."""
    torch.manual_seed(1234)
    on_tpu = torch.randn(16, device="tpu")
    torch.manual_seed(1234)
    on_cpu = torch.randn(16)
    assert torch.equal(on_tpu.cpu(), on_cpu)


# ------------------------------------------------------------- ops vs the CPU

BINARY_OPS = {
    "add": lambda a, b: a + b,
    "sub_scalar": lambda a, b: a - 2.5,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 1),
    "pow": lambda a, b: a.abs() ** 1.5,
    "where": lambda a, b: torch.where(a > b, a, b),
    "matmul": lambda a, b: a @ b.T,
    "bmm": lambda a, b: torch.bmm(a.reshape(2, 3, 8), b.reshape(2, 8, 3)),
    "einsum": lambda a, b: torch.einsum("ij,kj->ik", a, b),
    "sum": lambda a, b: a.sum(),
    "sum_dim": lambda a, b: a.sum(dim=1, keepdim=True),
    "mean": lambda a, b: a.mean(0),
    "amax": lambda a, b: a.amax(-1),
    "argmax": lambda a, b: a.argmax(1),
    "max_dim": lambda a, b: torch.stack(list(a.max(dim=0))),
    "var": lambda a, b: a.var(1),
    "cumsum": lambda a, b: a.cumsum(0),
    "logsumexp": lambda a, b: a.logsumexp(1),
    "softmax": lambda a, b: a.softmax(-1),
    "layer_norm": lambda a, b: torch.nn.functional.layer_norm(a, (8,)),
    "gelu": lambda a, b: torch.nn.functional.gelu(a),
    "sort": lambda a, b: a.sort(dim=1).values,
    "topk": lambda a, b: a.topk(3).indices,
    "cat": lambda a, b: torch.cat([a, b], dim=0),
    "transpose_contiguous": lambda a, b: a.t().contiguous(),
    "reshape": lambda a, b: a.reshape(4, 3, 4),
    "slice_step": lambda a, b: a[::2, 1::3],
    "index_int": lambda a, b: a[2],
    "index_tensor": lambda a, b: a[torch.tensor([5, 0, 2], device=a.device)],
    "index_mask": lambda a, b: a[a > 0],
    "gather": lambda a, b: a.gather(1, torch.tensor([[0, 7]] * 6, device=a.device)),
    "nonzero": lambda a, b: (a > 0).nonzero(),
    "to_int": lambda a, b: (a * 10).to(torch.int64),
    "bf16_matmul": lambda a, b: a.bfloat16() @ b.bfloat16().T,
    "bf16_sum": lambda a, b: (a.bfloat16() * b.bfloat16()).sum(1),
    "bf16_to_f32": lambda a, b: a.bfloat16().float() + b,
    "f16_add": lambda a, b: a.half() + b.half(),
    "complex_conj": lambda a, b: torch.complex(a, b).conj() * 2,
}


@pytest.mark.parametrize("name", BINARY_OPS)
def test_op_matches_cpu(tpu, name):
    op = BINARY_OPS[name]
    torch.manual_seed(0)
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    want = op(a, b)
    got = op(a.to("tpu"), b.to("tpu"))
    assert got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape
    # Not always bitwise: an op with a CompositeExplicitAutograd decomposition (e.g.
    # native_layer_norm) runs decomposed on tpu instead of through the CPU kernel.
    torch.testing.assert_close(got.cpu(), want)


def test_in_place_and_setitem_match_cpu(tpu):
    torch.manual_seed(0)
    c = torch.randn(4, 5)
    t = c.to("tpu")
    for x in (c, t):
        x.add_(1).mul_(2)
        x[1] = 7.0
        x[:, 2] = torch.arange(4.0, device=x.device)
        x.index_put_((torch.tensor([0, 3], device=x.device),), torch.tensor(-1.0, device=x.device))
        x.clamp_(min=-0.5)
        x.fill_diagonal_(9.0)
        x[3, 1:].zero_()
    assert torch.equal(t.cpu(), c)
    assert t.sum().item() == c.sum().item()


def test_views_alias_device_memory(tpu):
    t = torch.zeros(4, 6, device="tpu")
    t[1:3].fill_(1.0)  # slice is a view: writes land in t
    t.t()[0].fill_(2.0)  # column 0 through a transposed view
    t.view(24)[23] = 5.0
    t.unfold(1, 2, 2)[0, 1].fill_(3.0)
    want = torch.zeros(4, 6)
    want[1:3] = 1.0
    want[:, 0] = 2.0
    want.view(24)[23] = 5.0
    want.unfold(1, 2, 2)[0, 1].fill_(3.0)
    assert torch.equal(t.cpu(), want)
    assert t[1:3]._base is t and t[1:3].data_ptr() == t.data_ptr() + 6 * 4


def test_lazy_conj_and_neg_views_copy_across_devices(tpu):
    """Regression: copying a conj()/neg view to or from tpu used to recurse forever."""
    z = torch.complex(torch.randn(5), torch.randn(5))
    t = z.to("tpu")
    assert t.conj().is_conj()
    assert torch.equal(t.conj().cpu(), z.conj().resolve_conj())
    assert torch.equal(z.conj().to("tpu").cpu(), z.conj().resolve_conj())  # cpu conj -> tpu
    assert t.conj().imag.is_neg()
    assert torch.equal(t.conj().imag.cpu(), -z.imag)
    assert torch.equal(t.conj().clone().cpu(), z.conj().resolve_conj())  # tpu -> tpu


def test_out_variants_resize_on_device(tpu):
    a = torch.randn(3, 4, device="tpu")
    out = torch.empty(0, device="tpu")
    torch.add(a, a, out=out)
    assert out.device.type == "tpu" and out.shape == (3, 4)
    assert torch.equal(out.cpu(), a.cpu() * 2)


def test_item_and_empty(tpu):
    assert torch.tensor(3.5, device="tpu").item() == 3.5
    assert torch.zeros(0, 3, device="tpu").cpu().shape == (0, 3)
    assert torch.full((2,), 7, device="tpu").tolist() == [7, 7]


def test_transfer_stats_count_what_the_program_reads_back(tpu):
    """`.cpu()`, `.item()`, `bool()` and printing are device-to-host copies; `.to("tpu")`
    a host-to-device one; ops that run through the CPU fallback make none."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.tpu.reset_transfer_stats()
    t = x.to(tpu)
    stats = torch.tpu.transfer_stats()
    assert (stats["host_to_device.count"], stats["host_to_device.bytes"]) == (1, 48)
    assert stats["device_to_host.count"] == 0
    y = torch.sort(t.flip(0), dim=0).values.cumsum(1) * 2  # fallback ops: no transfer
    assert torch.tpu.transfer_stats()["device_to_host.count"] == 0
    assert torch.equal(y.cpu(), torch.sort(x.flip(0), dim=0).values.cumsum(1) * 2)
    assert torch.tpu.transfer_stats()["device_to_host.bytes"] == 48
    float(y[0, 0])
    bool((y > 3).any())
    stats = torch.tpu.transfer_stats()
    assert stats["device_to_host.count"] == 3
    torch.tpu.reset_transfer_stats()
    assert set(torch.tpu.transfer_stats().values()) == {0}


def test_save_and_load_keep_the_device(tpu, tmp_path):
    t = torch.randn(3, device="tpu")
    torch.save({"t": t}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt")["t"]
    assert loaded.device.type == "tpu" and torch.equal(loaded.cpu(), t.cpu())


# ------------------------------------------------------------------- autograd


def test_mlp_backward_matches_cpu(tpu):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    dev = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    dev.load_state_dict(ref.state_dict())
    dev.tpu()
    x, target = torch.randn(5, 8), torch.randint(0, 4, (5,))

    loss_ref = torch.nn.functional.cross_entropy(ref(x), target)
    loss_ref.backward()
    loss_dev = torch.nn.functional.cross_entropy(dev(x.to("tpu")), target.to("tpu"))
    assert loss_dev.device.type == "tpu" and loss_dev.grad_fn is not None
    loss_dev.backward()

    # Close, not bitwise: LayerNorm runs ATen's decomposition on tpu (see test_op_matches_cpu).
    torch.testing.assert_close(loss_dev.cpu(), loss_ref)
    for (name, p_ref), p_dev in zip(ref.named_parameters(), dev.parameters()):
        assert p_dev.grad.device.type == "tpu", name
        torch.testing.assert_close(p_dev.grad.cpu(), p_ref.grad, msg=name)

    torch.optim.SGD(dev.parameters(), lr=0.1).step()  # in-place updates on the device
    assert next(dev.parameters()).device.type == "tpu"


def test_grad_of_a_leaf_created_on_tpu(tpu):
    w = torch.randn(3, 3, device="tpu", requires_grad=True)
    (w @ w).sum().backward()
    wc = w.detach().cpu().requires_grad_()
    (wc @ wc).sum().backward()
    assert w.grad.device.type == "tpu"
    torch.testing.assert_close(w.grad.cpu(), wc.grad, rtol=0, atol=0)


# --------------------------------------------- dispatch reaches PrivateUse1


@pytest.fixture(scope="module")
def probe_op(tpu):
    """tessera_test::probe, with CPU and PrivateUse1 kernels that leave different marks.

    The PrivateUse1 kernel also reads its input through data_ptr() with ctypes, as a
    Rust kernel would, and records what it saw.
    """
    seen = []

    def cpu_kernel(x):
        return x + 1

    def tpu_kernel(x):
        assert x.device.type == "tpu"
        raw = ctypes.string_at(x.data_ptr(), x.numel() * x.element_size())
        seen.append({"raw": raw, "ptr": x.data_ptr(), "contiguous": x.is_contiguous()})
        return x + 100  # through the CPU fallback, still on tpu

    lib = torch.library.Library("tessera_test", "DEF")
    lib.define("probe(Tensor x) -> Tensor")
    lib.impl("probe", cpu_kernel, "CPU")
    lib.impl("probe", tpu_kernel, "PrivateUse1")
    yield torch.ops.tessera_test.probe, seen
    lib._destroy()


def test_tpu_tensor_hits_the_privateuse1_kernel(probe_op):
    probe, seen = probe_op
    seen.clear()
    c = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    out_cpu = probe(c)
    assert seen == []  # the CPU kernel ran
    assert torch.equal(out_cpu, c + 1)

    t = c.to("tpu")
    out_tpu = probe(t)
    assert len(seen) == 1  # the PrivateUse1 kernel ran
    assert out_tpu.device.type == "tpu"
    assert torch.equal(out_tpu.cpu(), c + 100)
    # data_ptr() inside the kernel is host memory holding exactly the CPU copy's bytes.
    assert seen[0]["ptr"] == t.data_ptr()
    assert seen[0]["raw"] == c.numpy().tobytes()


def test_data_ptr_is_aligned_writable_host_memory(tpu):
    t = torch.zeros(16, dtype=torch.float32, device="tpu")
    assert t.data_ptr() % 64 == 0
    floats = (ctypes.c_float * 16).from_address(t.data_ptr())
    floats[3] = 2.5  # a host write is what the device holds
    assert t[3].item() == 2.5
    # A view's data_ptr() includes its storage offset.
    view = t[3:]
    assert ctypes.c_float.from_address(view.data_ptr()).value == 2.5


def test_strided_view_reaches_the_kernel_with_its_offset(probe_op):
    probe, seen = probe_op
    seen.clear()
    c = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    t = c.to("tpu")
    row = t[2]  # contiguous view at offset 10 elements
    probe(row)
    assert seen[0]["ptr"] == t.data_ptr() + 10 * 4
    assert seen[0]["raw"] == c[2].numpy().tobytes()


# ------------------------------------------------------- cache and conflicts


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert emulated_tpu._cache_root() == tmp_path / "a"
    monkeypatch.delenv("TESSERA_CACHE_DIR")
    assert emulated_tpu._cache_root() == tmp_path / "b" / "tessera"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert emulated_tpu._cache_root() == tmp_path / "home" / ".cache" / "tessera"


def test_second_process_loads_from_the_cache(tpu):
    result = _run(
        """
        import time, torch
        t0 = time.perf_counter(); d = e.enable(); dt = time.perf_counter() - t0
        assert torch.ones(2, device=d).sum().item() == 2.0
        print(f"enable {dt:.3f} s")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "building" not in result.stderr  # the fixture's build was reused


def test_backward_after_a_late_enable_and_on_other_threads(tpu):
    """enable() after autograd already ran (the engine then has no tpu worker), and
    backward on a second thread that called enable() itself."""
    result = _run(
        """
        import threading, torch
        a = torch.ones(2, requires_grad=True)
        a.sum().backward()  # the engine starts before the tpu device exists
        e.enable()
        w = torch.ones(3, device="tpu", requires_grad=True)
        (w * w).sum().backward()
        print("main:", w.grad.device.type, w.grad.cpu().tolist())

        def worker():
            e.enable()  # per thread: backward stays on this thread
            v = torch.ones(2, device="tpu", requires_grad=True)
            (v * 3).sum().backward()
            print("thread:", v.grad.cpu().tolist())

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        """
    )
    assert result.returncode == 0, result.stderr
    assert "main: tpu [2.0, 2.0, 2.0]" in result.stdout
    assert "thread: [3.0, 3.0]" in result.stdout


def test_refuses_a_renamed_privateuse1(tpu):
    result = _run(
        """
        import torch
        torch.utils.rename_privateuse1_backend("foo")
        try:
            e.enable()
        except e.EmulatedTpuError as err:
            print("refused:", err)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "refused: PrivateUse1 is already named 'foo'" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="torch_tpu not installed")
def test_refuses_when_torch_tpu_is_loaded(tpu):
    result = _run(
        """
        import torch  # autoloads torch_tpu
        assert "torch_tpu" in sys.modules
        try:
            e.enable()
        except e.EmulatedTpuError as err:
            print("refused:", err)
        """,
        TORCH_DEVICE_BACKEND_AUTOLOAD="1",
    )
    assert result.returncode == 0, result.stderr
    assert "refused: TorchTPU (torch_tpu) is loaded" in result.stdout
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in result.stdout


def test_allocator_statistics(tpu):
    # torch.cuda-style counters of the emulated device's host allocator.
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    x = torch.empty(1024, 1024, device="tpu")  # 4 MiB
    assert torch.tpu.memory_allocated() == base + (4 << 20)
    y = x * 2  # another 4 MiB
    assert torch.tpu.memory_allocated() == base + (8 << 20)
    del x, y
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() >= base + (8 << 20)
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base and stats["allocation.all.freed"] >= 2
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    z = torch.ones(10, device="cpu").to("tpu")
    assert torch.tpu.memory_allocated() == base + 40 and z.device.type == "tpu"
