"""An emulated ``tpu`` device in host memory, for tests on machines without a TPU.

``enable()`` renames PyTorch's PrivateUse1 backend to ``tpu`` and loads a small
C++ extension (``tessera/csrc/emulated_tpu.cpp``) that registers, for
PrivateUse1, a host-memory allocator, a one-device DeviceGuard, the few kernels
that must not copy (factories, copies, views, ``resize_``/``set_``) and a boxed
CPU fallback for every other op. Afterwards ``torch.randn(3, device="tpu")``
is a tensor whose ``device.type`` is ``"tpu"``, ops registered for the
``PrivateUse1`` key run for it, and all other ops run on the CPU.

Memory contract: a tensor on the emulated device lives in ordinary host memory
(64-byte aligned), so ``t.data_ptr()`` is a plain host pointer that Rust code
or ctypes may read and write while ``t`` is alive. Everything is synchronous.

Requirements: ``g++`` and ``ninja`` (the ``ninja`` PyPI package is enough) for
the one-time build; TorchTPU must not be loaded (run with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, since the real and the emulated backend
would both claim PrivateUse1).

Behaviour to know about (all process-wide, and enable() cannot be undone):

* ``torch.accelerator`` now reports ``tpu``, and ``torch.tpu`` is a small module
  (availability, one device, RNG state, allocator statistics as ``torch.cuda`` names them:
  ``memory_stats()``, ``memory_allocated()``, ``max_memory_allocated()``,
  ``reset_peak_memory_stats()``, and ``transfer_stats()`` / ``reset_transfer_stats()``
  counting the host <-> device copies a program asks for) marked
  ``torch.tpu.tessera_emulated``.
* DeferAndFuse's placeholders (``tessera._fusion_device``) are tensors whose storage has
  no memory until a flush materialises them (``torch.ops.tessera_emulated_tpu``'s
  ``empty_unallocated`` / ``materialize`` / ``is_allocated``); reading one that was never
  materialised (only reachable through a raw storage alias) is an error.
* Random ops draw from the CPU default generator: same seed, same numbers as on
  the CPU. ``torch.Generator(device="tpu")`` is not supported.
* Ops with a CompositeExplicitAutograd decomposition run decomposed (e.g.
  ``native_layer_norm``), so results match the CPU to rounding, not bitwise.
* Backward passes run on the thread that started them (see enable()).
* No autocast for ``tpu``; sparse/nested views are rejected by the fallback.
* ``module.to("tpu")`` gives each parameter a new ``Parameter`` (torch does so for a
  device whose tensors cannot take a CPU tensor's data in place, as for XLA), so weights
  tied before the move are two parameters after it: tie them again
  (``model.tie_weights()`` in transformers), as on torch_xla.

The compiled library is cached in ``$TESSERA_CACHE_DIR``, else
``$XDG_CACHE_HOME/tessera``, else ``~/.cache/tessera``, in a directory keyed by
a hash of the source, the build flags and the torch/Python versions; later
processes only ``dlopen`` it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

__all__ = ["enable", "is_enabled", "EmulatedTpuError"]

_DEVICE_NAME = "tpu"
_LIB_NAME = "tessera_emulated_tpu"
# -O0: the extension only forwards to libtorch, so optimising it buys nothing
# and costs build time. -g0: no debug info to write.
_CFLAGS = ["-O0", "-g0"]
# Cold build time for the progress note (measured 8-9 s with g++ 12 on 2 cores).
_BUILD_SECONDS_HINT = 10

_lock = threading.Lock()


class EmulatedTpuError(RuntimeError):
    """The emulated tpu device cannot be enabled in this process."""


class _DeviceModule:
    """``torch.tpu`` while the emulated device is enabled: torch imports the
    backend's module on first use of the device and looks up these functions
    (availability, seeding, ``torch.tpu.device`` for storage moves)."""

    tessera_emulated = True  # marks the emulation; TorchTPU's module lacks it

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    class device:
        """``with torch.tpu.device(d):`` (used by storage moves); there is
        only tpu:0, so selecting it changes nothing."""

        def __init__(self, device) -> None:
            self.device = device

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> None:
            return None

    @staticmethod
    def synchronize(device=None) -> None:
        """Every op is synchronous on the emulated device."""

    # Allocator statistics, named as torch.cuda's: bytes of tpu tensors' storage now and
    # at peak (since the start or the last reset), in total, and allocation counts.
    @staticmethod
    def memory_stats(device=None) -> dict:
        current, peak, total, allocs, frees = torch.ops.tessera_emulated_tpu.memory_stats()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "allocated_bytes.all.allocated": total,
            "allocation.all.allocated": allocs,
            "allocation.all.freed": frees,
            "allocation.all.current": allocs - frees,
        }

    @staticmethod
    def memory_allocated(device=None) -> int:
        return torch.ops.tessera_emulated_tpu.memory_stats()[0]

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return torch.ops.tessera_emulated_tpu.memory_stats()[1]

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        torch.ops.tessera_emulated_tpu.reset_peak_memory_stats()

    # Host <-> device copies the program asked for (`.cpu()`, `.to()`, `.item()`, printing;
    # not the CPU fallback's internal staging, which a real device would not make), so a
    # test can show that an op reads nothing back to the host.
    @staticmethod
    def transfer_stats(device=None) -> dict:
        d2h, d2h_bytes, h2d, h2d_bytes = torch.ops.tessera_emulated_tpu.transfer_stats()
        return {"device_to_host.count": d2h, "device_to_host.bytes": d2h_bytes, "host_to_device.count": h2d, "host_to_device.bytes": h2d_bytes}

    @staticmethod
    def reset_transfer_stats(device=None) -> None:
        torch.ops.tessera_emulated_tpu.reset_transfer_stats()

    # RNG: random ops run on the CPU through the fallback and draw from the CPU
    # default generator, so the tpu RNG *is* that generator. fork_rng, activation
    # checkpointing and AOTAutograd save and restore it through these.
    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    @staticmethod
    def initial_seed() -> int:
        return torch.default_generator.initial_seed()

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.default_generator.get_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device=None) -> None:
        torch.default_generator.set_state(new_state)


def is_enabled() -> bool:
    """Whether this process has the emulated ``tpu`` device enabled."""
    return (
        torch._C._get_privateuse1_backend_name() == _DEVICE_NAME
        and getattr(getattr(torch, _DEVICE_NAME, None), "tessera_emulated", False)
    )


def enable() -> torch.device:
    """Enable the emulated ``tpu`` device (idempotent) and return ``torch.device("tpu")``.

    Also makes backward passes started on the calling thread run on that thread only
    (see _autograd_on_this_thread); call enable() on every thread that runs backward
    through tpu tensors, it is cheap once the device is enabled.

    Raises EmulatedTpuError if TorchTPU or another PrivateUse1 backend is loaded,
    or if the extension cannot be built.
    """
    with _lock:
        if not is_enabled():
            _refuse_if_taken()
            _load_extension()
            torch.utils.rename_privateuse1_backend(_DEVICE_NAME)
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module(_DEVICE_NAME, _DeviceModule())
        _autograd_on_this_thread()
        return torch.device(_DEVICE_NAME)


def _refuse_if_taken() -> None:
    if any(m == "torch_tpu" or m.startswith("torch_tpu.") for m in sys.modules):
        raise EmulatedTpuError(
            "TorchTPU (torch_tpu) is loaded in this process, so the real `tpu` "
            "backend owns PrivateUse1 and the emulated one cannot be enabled. Set "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 before importing torch (it stops "
            "torch from autoloading torch_tpu) and do not import torch_tpu."
        )
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        raise EmulatedTpuError(
            f"PrivateUse1 is already named {name!r} by another backend in this "
            "process; the emulated tpu device needs it unclaimed."
        )
    if hasattr(torch, _DEVICE_NAME):
        raise EmulatedTpuError(
            f"torch.{_DEVICE_NAME} is already registered by another backend; "
            "the emulated tpu device cannot be enabled."
        )
    if torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::empty.memory_format", "PrivateUse1"
    ):
        raise EmulatedTpuError(
            "another library already registered PrivateUse1 kernels "
            "(aten::empty.memory_format); the emulated tpu device cannot be enabled."
        )


def _autograd_on_this_thread() -> None:
    """Run backward passes started on this thread entirely on this thread.

    By default PyTorch's autograd engine hands the work of each accelerator device
    to a per-device worker thread. For the emulated tpu that buys nothing (every op is
    synchronous host code) and costs two failures, both measured with torch 2.15:

    * the engine sizes its worker queues once, at the first backward of the process,
      from the device guards registered then; if that backward ran before enable(),
      any later backward through tpu tensors fails with an INTERNAL ASSERT
      (device_ready_queues_);
    * a worker can still hold the last reference to a finished backward's state (the
      contextvars context torch stashes for it) when the interpreter exits; releasing
      it needs the GIL and the process aborts with "terminate called without an
      active exception" (seen in 1 of 10 runs of a script that ends right after a
      backward).

    With autograd multithreading disabled for the calling thread (the setting behind
    torch.autograd.set_multithreading_enabled), the engine runs every device's work on
    that thread, which avoids both. It changes nothing for CPU-only graphs.
    """
    torch._C._set_multithreading_enabled(False)


def _source() -> Path:
    # Package data: the wheel ships tessera/csrc/ next to this file.
    source = Path(__file__).resolve().parent / "csrc" / "emulated_tpu.cpp"
    if not source.is_file():
        raise EmulatedTpuError(f"{source} is missing: reinstall tessera (pip install ./interop/torch)")
    return source


def _cache_root() -> Path:
    if os.environ.get("TESSERA_CACHE_DIR"):
        return Path(os.environ["TESSERA_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tessera"
    return Path.home() / ".cache" / "tessera"


def _load_extension() -> None:
    src = _source()
    key = hashlib.sha256()
    key.update(src.read_bytes())
    key.update(repr((_CFLAGS, torch.__version__, sys.version_info[:2])).encode())
    build_dir = _cache_root() / f"emulated_tpu-{key.hexdigest()[:16]}"
    lib = build_dir / f"{_LIB_NAME}.so"
    done = build_dir / "built"  # written only after a build loaded successfully

    if done.is_file() and lib.is_file():
        torch.ops.load_library(str(lib))
        return

    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    print(
        f"tessera: building the emulated tpu device (once, ~{_BUILD_SECONDS_HINT} s)",
        file=sys.stderr,
        flush=True,
    )
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=_LIB_NAME,
            sources=[str(src)],
            extra_cflags=_CFLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
            with_cuda=False,
            verbose=False,
        )
    except Exception as e:  # compiler output is in the message
        raise EmulatedTpuError(
            f"building the emulated tpu device in {build_dir} failed: {e}"
        ) from e
    done.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {src}\n")


def _ensure_ninja_on_path() -> None:
    # torch's cpp_extension runs `ninja` from PATH; the venv's bin directory
    # (where `pip install ninja` puts it) is not on PATH unless activated.
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        raise EmulatedTpuError(
            "building the emulated tpu device needs ninja: `pip install ninja`"
        ) from None
