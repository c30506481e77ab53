"""A user's own #[tpu_kernel] as a torch op: the example crate interop/torch/example.

The crate writes `scaled_silu_kernel` with #[tpu_kernel], declares one OpDef and fills its
Python module `tessera_example` with tessera_torch::init_module; here it is registered with
`tessera.register_ops` (the library's own path) and checked as `torch.ops.tpu.scaled_silu`:
against stock PyTorch in float32 and bfloat16, with torch.library.opcheck, through its plan's
StableHLO module (the TorchTPU path), and on the emulated `tpu` device when available.

Installs nothing; build both packages first:

    pip install --no-build-isolation ./interop/torch ./interop/torch/example
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m pytest tests/python/test_user_kernel.py

Skipped when `tessera` or `tessera_example` is not importable.
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here

import pytest
import torch
import torch.nn.functional as F

tessera = pytest.importorskip("tessera", reason="the tessera package is not installed (pip install ./interop/torch)")
tessera_example = pytest.importorskip(
    "tessera_example",
    reason="the example crate is not installed (pip install --no-build-isolation ./interop/torch/example)",
)
from tessera import _tpu  # noqa: E402

if not hasattr(tessera, "register_ops"):
    pytest.skip("this tessera build has no register_ops", allow_module_level=True)


def scaled_silu_fake(x, scale, beta=1.0, block_rows=None, block_cols=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def scaled_silu_setup(ctx, inputs, output):
    x, scale, beta = inputs[:3]  # then the block statics
    ctx.save_for_backward(x, scale)
    ctx.beta = beta


def scaled_silu_backward(ctx, dy):
    """d/dx [x sigmoid(bx) s] = s sigmoid(bx) (1 + bx (1 - sigmoid(bx))), in stock PyTorch ops."""
    x, scale = ctx.saved_tensors
    xf, sf, g = x.float(), scale.float(), dy.float()
    sig = torch.sigmoid(ctx.beta * xf)
    dx = g * sf * sig * (1 + ctx.beta * xf * (1 - sig))
    dscale = (g * xf * sig).reshape(-1, xf.shape[-1]).sum(0)
    return dx.to(x.dtype), dscale.reshape(scale.shape).to(scale.dtype), None, None, None


OP = None  # torch.ops.tpu.scaled_silu, once registered


@pytest.fixture(scope="module", autouse=True)
def _register():
    """What a user writes, as in interop/torch/example/README.md (once per process: a second
    registration of the name is an error). Done when this module's tests start rather than at
    import, so test files that list `tessera.ops()` do not see the op during collection."""
    global OP
    if not hasattr(torch.ops.tpu, "scaled_silu"):
        tessera.register_ops(tessera_example, fakes={"scaled_silu": scaled_silu_fake})
        torch.library.register_autograd("tpu::scaled_silu", scaled_silu_backward, setup_context=scaled_silu_setup)
    OP = torch.ops.tpu.scaled_silu


def reference(x, scale, beta=1.0):
    """Stock PyTorch, in float32 like the kernel, rounded to x's dtype."""
    xf, sf = x.float(), scale.float()
    y = F.silu(xf) * sf if beta == 1.0 else xf * torch.sigmoid(beta * xf) * sf
    return y.to(x.dtype)


# [..., n] shapes: leading dims folded into rows; a lane-unaligned n and an odd row count
# (whole-array blocks); 512 x 2048 takes 4 grid steps of 128 rows.
SHAPES = [(2, 8, 256), (5, 96), (512, 2048)]
DTYPES = [torch.float32, torch.bfloat16]


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    scale = torch.randn(shape[-1], generator=g).to(dtype)
    return x, scale


def test_registered_in_tpu_namespace():
    assert isinstance(OP, torch._ops.OpOverloadPacket)
    assert OP.default.name() == "tpu::scaled_silu"
    assert OP.default._schema == torch._C.parse_schema("tpu::scaled_silu(Tensor x, Tensor scale, float beta=1.0, int? block_rows=None, int? block_cols=None) -> Tensor")
    assert [o["name"] for o in tessera_example.op_table()] == ["scaled_silu"]
    with pytest.raises(ValueError, match="already registered"):
        tessera.register_ops(tessera_example, fakes={"scaled_silu": scaled_silu_fake})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_pytorch(shape, dtype):
    x, scale = inputs(shape, dtype)
    y = OP(x, scale)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, reference(x, scale))
    # A non-default static, positionally and by keyword.
    torch.testing.assert_close(OP(x, scale, 1.702), reference(x, scale, 1.702))
    torch.testing.assert_close(OP(x, scale, beta=0.5), reference(x, scale, 0.5))


def test_scale_as_row_and_float32_scale_for_bf16():
    x, scale = inputs((4, 256), torch.bfloat16)
    torch.testing.assert_close(OP(x, scale.reshape(1, -1)), reference(x, scale))
    y = OP(x, scale.float())  # the result keeps x's dtype
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference(x, scale.float()))


def test_errors_reach_python():
    x, scale = inputs((4, 256), torch.float32)
    with pytest.raises(ValueError, match="scale"):
        OP(x, scale[:128])
    with pytest.raises(ValueError, match="float32, bfloat16, float8_e4m3fn or float8_e5m2"):
        OP(x.to(torch.int32), scale)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_tensors_cross_the_ffi(dtype):
    """fp8 in, fp8 out: the kernel reads the tensor's bytes in place, computes in f32 and
    converts back as torch's `.to(dtype)` does (nearest-even; e4m3fn saturating)."""
    x, scale = inputs((16, 256), torch.float32)
    x8, s8 = x.to(dtype), scale.to(dtype)
    y = OP(x8, s8)
    assert y.dtype == dtype and y.shape == x.shape
    want = reference(x8.float(), s8.float()).to(dtype)
    # The kernel's sigmoid and torch's may differ in the last f32 bit, which can move a
    # value across an fp8 rounding edge: at most one fp8 step apart, almost always equal.
    step = 2.0 ** -3 if dtype == torch.float8_e4m3fn else 2.0 ** -2
    torch.testing.assert_close(y.float(), want.float(), rtol=step, atol=2.0 ** -9)
    assert (y.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.99
    # A float32 scale, and the result still x's dtype; a huge scale saturates (e4m3fn) or
    # overflows to inf (e5m2), as torch's conversion does.
    big = OP(x8, torch.full_like(scale, 1e6))
    assert big.dtype == dtype
    top = big.float().abs().max().item()
    assert top == (448.0 if dtype == torch.float8_e4m3fn else float("inf"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    x, scale = inputs((2, 8, 256), dtype)
    torch.library.opcheck(OP.default, (x, scale))
    torch.library.opcheck(OP.default, (x, scale), {"beta": 1.702})
    torch.library.opcheck(OP.default, (x.requires_grad_(), scale.requires_grad_()), {"beta": 1.702})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_match_pytorch(dtype):
    x, scale = inputs((2, 8, 256), dtype)
    dy = inputs((2, 8, 256), dtype, seed=1)[0]
    xs = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
    OP(*xs, beta=1.702).backward(dy)
    refs = [x.float().requires_grad_(), scale.float().requires_grad_()]
    (refs[0] * torch.sigmoid(1.702 * refs[0]) * refs[1]).backward(dy.float())
    for got, want in zip(xs, refs):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad, want.grad.to(dtype))


def test_compiles_with_fake_shapes():
    x, scale = inputs((3, 16, 256), torch.float32)
    fn = torch.compile(lambda x, s: OP(x, s) + 1.0, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x, scale), reference(x, scale) + 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_lowers_to_tpu_custom_call(dtype):
    x, scale = inputs((512, 2048), dtype)
    plan = _tpu.plan_for(tessera_example, "scaled_silu", (1.0,), [x, scale], "v6e")
    assert len(plan) == 1
    assert plan.kernel_name(0) == "tessera.scaled_silu.scaled_silu_kernel"
    dt = str(dtype).removeprefix("torch.")
    assert plan.args(0) == [("input", 0, 0, None, [512, 2048], dt), ("input", 1, 0, None, [1, 2048], dt)]
    assert plan.outputs(0) == [([512, 2048], dt)]
    module = plan.module(0)
    assert "stablehlo.custom_call @tpu_custom_call" in module
    assert "module @scaled_silu_kernel" in module
    elem = "f32" if dtype == torch.float32 else "bf16"
    assert f"tensor<512x2048x{elem}>" in module


def test_tpu_path_walks_the_plan():
    """The PrivateUse1 kernel's body (tessera._tpu.run_plan) with the interpreter as runner."""
    x, scale = inputs((512, 2048), torch.bfloat16)
    runner = _tpu.EmulatorRunner()
    (y,) = _tpu.run_plan(tessera_example, "scaled_silu", (1.702,), [x, scale], "v6e", run=runner)
    torch.testing.assert_close(y, reference(x, scale, 1.702))
    ((name, _key),) = runner.registered
    assert name == "tessera.scaled_silu.scaled_silu_kernel"
    assert "tpu_custom_call" in next(iter(runner.registered.values()))


def test_on_emulated_tpu_device():
    """The PrivateUse1 kernel: the plan walked launch by launch, as on TorchTPU."""
    emulated_tpu = pytest.importorskip("tessera.emulated_tpu", reason="this tessera build has no emulated tpu device")
    try:
        device = emulated_tpu.enable()
    except emulated_tpu.EmulatedTpuError as e:
        pytest.skip(f"emulated tpu device unavailable: {e}")
    for dtype in DTYPES:
        x, scale = inputs((512, 2048), dtype)
        y = OP(x.to(device), scale.to(device), beta=1.702)
        assert y.device.type == "tpu"
        torch.testing.assert_close(y.cpu(), reference(x, scale, 1.702))


def test_module_cache_never_serves_another_plans_module():
    """Plans are keyed by the native plan's address: a plan the plan cache dropped must not
    lend its address (and so its cached module) to the next plan. With a one-entry plan
    cache every call below drops the previous plan; each must still get its own module."""
    import subprocess
    import sys

    code = """
import torch, tessera
from tessera import _tpu
cache = _tpu.ModuleCache()
for n in range(128, 128 + 40 * 8, 8):
    plan = _tpu.plan_for(tessera._native, "rmsnorm", (1e-6,), [torch.empty(8, n), torch.empty(n)], "v6e")
    text = cache.get(plan, 0).text
    assert f"tensor<8x{n}xf32>" in text, f"n={n}: got another plan's module"
    del plan
print("ok")
"""
    env = dict(__import__("os").environ, TESSERA_PLAN_CACHE="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-2000:]


def _x_blocks(plan):
    """`[rows,cols]` of x's block in launch 0 (`@0 x: input bf16[..] vmem block [256,1024] at ..`)."""
    line = next(l for l in plan.kernel_ir(0).splitlines() if "@0 x:" in l)
    return line.split("block ")[1].split(" ")[0]


def test_shipped_tuning_table_sets_the_blocks():
    """The crate's tuned.json (written by `tessera-example tune --save`, added by its module
    at import) gives the op its best blocks at the shapes it holds; given blocks still win,
    and a shape it does not hold keeps the row rule."""
    import json

    table = json.loads(open(os.path.join(os.path.dirname(__file__), "../../interop/torch/example/tuned.json")).read())
    changed = 0
    for e in table["entries"]:
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[e["dtype"]]
        x, scale = torch.empty(e["shapes"]["x"], dtype=dtype), torch.empty(e["shapes"]["scale"], dtype=dtype)
        rows, cols = (int(kv.split("=")[1]) for kv in e["best"].split(", "))
        statics = dict(kv.split("=") for kv in e["statics"].split(", "))
        assert statics["block_rows"] == statics["block_cols"] == "None"
        beta = float(statics["beta"])  # the key is exact: the tuned call's beta
        plan = _tpu.plan_for(tessera_example, "scaled_silu", (beta,), [x, scale], e["target"])
        assert _x_blocks(plan) == f"[{rows},{cols}]", (e["target"], e["best"])
        assert _x_blocks(_tpu.plan_for(tessera_example, "scaled_silu", (beta, 8, 128), [x, scale], e["target"])) == "[8,128]"
        rule = _x_blocks(_tpu.plan_for(tessera_example, "scaled_silu", (beta,), [torch.empty(x.shape[0] + 8, x.shape[1], dtype=dtype), scale], e["target"]))
        changed += rule != f"[{rows},{cols}]"
    assert changed, "some entry must choose other blocks than the row rule, or this test proves nothing"


def test_load_tuning_table_changes_the_blocks_and_keeps_the_numbers(tmp_path):
    """`tessera.load_tuning_table` (a table `tessera-example tune --save` wrote; here one
    entry in that format) reaches the user module's op: cached plans are dropped, the next
    call plans with the table's blocks, and its result still matches PyTorch."""
    import json

    x, scale = inputs((96, 384), torch.float32, seed=3)
    before = _x_blocks(_tpu.plan_for(tessera_example, "scaled_silu", (0.5,), [x, scale], tessera.get_target()))
    OP(x, scale, beta=0.5)  # cache the plan under the old blocks
    entry = {"op": "scaled_silu", "case": "default", "target": tessera.get_target(), "dtype": "f32", "shapes": {"x": [96, 384], "scale": [384]},
             "statics": "beta=0.5, block_rows=None, block_cols=None", "best": "block_rows=32, block_cols=128", "candidates": []}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"format": 1, "libtpu": "test", "entries": [entry]}))
    assert tessera.load_tuning_table(path) == 1
    after = _x_blocks(_tpu.plan_for(tessera_example, "scaled_silu", (0.5,), [x, scale], tessera.get_target()))
    assert (before, after) == ("[96,384]", "[32,128]")
    torch.testing.assert_close(OP(x, scale, beta=0.5), reference(x, scale, 0.5))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(Exception, match=r"bad\.json.*not a tuning table"):
        tessera.load_tuning_table(bad)
