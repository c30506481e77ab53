// Emulated `tpu` device: PyTorch's PrivateUse1 backend backed by host memory.
//
// Purpose: tests on machines without a TPU can still exercise dispatch to the
// PrivateUse1 key (which tessera/emulated_tpu.py renames to `tpu`) end to end:
// tensors report `device.type == "tpu"`, ops registered for PrivateUse1 run,
// and every other op runs on the CPU through a boxed fallback.
//
// Built and loaded by tessera/emulated_tpu.py (torch.utils.cpp_extension.load,
// is_python_module=False). No pybind11: registration is static
// (TORCH_LIBRARY_IMPL, C10_REGISTER_GUARD_IMPL, REGISTER_ALLOCATOR) and happens
// when the shared library is dlopen'ed.
//
// Memory contract: a `tpu` tensor's storage is ordinary host memory from
// c10::alloc_cpu (64-byte aligned). `tensor.data_ptr()` on this device is
// therefore a plain host pointer that Rust (or ctypes) may read and write for
// the tensor's lifetime, exactly as for a CPU tensor. Nothing is asynchronous:
// there are no streams and every op has completed when it returns.
//
// Must not be loaded into a process where another PrivateUse1 backend
// (TorchTPU) is loaded: both would register the same keys. The Python side
// refuses to load it in that case.

// Headers: only what is used. <torch/extension.h> (pybind11 and all of ATen)
// triples the build time; ATen/native/Resize.h and ATen/ops/<op>.h pull in
// much of ATen as well, so their few uses are replaced below by Tensor methods
// and a local resize.
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;
const c10::Device kTpu0(kTpu, 0);

// ---------------------------------------------------------------- allocator

// Allocator statistics, as torch.cuda.memory_stats reports them: bytes allocated now and
// at peak, and counts. Sizes are kept per pointer so a free knows what it returns.
struct Stats {
  std::mutex lock;
  std::unordered_map<void*, size_t> sizes;
  int64_t current = 0, peak = 0, allocated_total = 0, allocations = 0, frees = 0;
};
Stats& stats() {
  static Stats* s = new Stats();  // never destroyed: frees can run during exit
  return *s;
}

void host_free(void* ptr) {
  if (ptr != nullptr) {
    Stats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    auto it = s.sizes.find(ptr);
    if (it != s.sizes.end()) {
      s.current -= static_cast<int64_t>(it->second);
      s.frees += 1;
      s.sizes.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

// Host memory labelled as device tpu:0. c10::alloc_cpu aligns to
// c10::gAlignment (64 bytes on x86-64 and aarch64), like the CPU allocator.
struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    if (ptr != nullptr) {
      Stats& s = stats();
      std::lock_guard<std::mutex> g(s.lock);
      s.sizes[ptr] = nbytes;
      s.current += static_cast<int64_t>(nbytes);
      s.allocated_total += static_cast<int64_t>(nbytes);
      s.allocations += 1;
      s.peak = std::max(s.peak, s.current);
    }
    return {ptr, ptr, &host_free, kTpu0};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dst, const void* src, size_t n) const override {
    default_copy_data(dst, src, n);
  }
};

// [current bytes, peak bytes, bytes allocated in total, allocations, frees]
std::vector<int64_t> memory_stats() {
  Stats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  return {s.current, s.peak, s.allocated_total, s.allocations, s.frees};
}

void reset_peak_memory_stats() {
  Stats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  s.peak = s.current;
}

// ---------------------------------------------------------------- transfers

// Copies between the host and the device that a program asks for (.cpu(), .to(),
// .item(), printing), as a real device would make them: what the tests count to show an
// op reads nothing back. The fallback's own staging copies are not counted: on a real
// device those ops run there.
struct Transfers {
  std::atomic<int64_t> d2h{0}, d2h_bytes{0}, h2d{0}, h2d_bytes{0};
};
Transfers& transfers() {
  static Transfers* t = new Transfers();
  return *t;
}
thread_local int g_in_fallback = 0;

void count_transfer(const at::Tensor& src, const at::Tensor& dst) {
  if (g_in_fallback > 0) return;
  const bool from_tpu = src.device().type() == kTpu, to_tpu = dst.device().type() == kTpu;
  if (from_tpu == to_tpu) return;
  Transfers& t = transfers();
  const int64_t bytes = static_cast<int64_t>(src.numel()) * static_cast<int64_t>(src.element_size());
  (from_tpu ? t.d2h : t.h2d) += 1;
  (from_tpu ? t.d2h_bytes : t.h2d_bytes) += bytes;
}

// [device-to-host copies, their bytes, host-to-device copies, their bytes]
std::vector<int64_t> transfer_stats() {
  Transfers& t = transfers();
  return {t.d2h.load(), t.d2h_bytes.load(), t.h2d.load(), t.h2d_bytes.load()};
}

void reset_transfer_stats() {
  Transfers& t = transfers();
  t.d2h = 0;
  t.d2h_bytes = 0;
  t.h2d = 0;
  t.h2d_bytes = 0;
}

HostAllocator g_allocator;
// Makes c10::GetAllocator(PrivateUse1) return it (storage resize, Storage()).
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// ------------------------------------------------------------- device guard

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index == -1 || index == 0,
              "the emulated tpu has one device (tpu:0); got tpu:",
              static_cast<int>(index));
}

// One device, index 0, one (default) stream: enough for DeviceGuard, the
// autograd engine's per-device worker thread and stream queries.
struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    check_index(d.index());
    return kTpu0;
  }
  c10::Device getDevice() const override { return kTpu0; }
  void setDevice(c10::Device d) const override { check_index(d.index()); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override {
    return c10::Stream(c10::Stream::DEFAULT, kTpu0);
  }
  c10::Stream exchangeStream(c10::Stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, kTpu0);
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, kTpu0);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  // Everything is synchronous, so events and streams are always complete.
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// -------------------------------------------------------------------- hooks

// at::globalContext() asks these before touching an accelerator (the autograd
// engine calls lazyInitDevice/hasPrimaryContext for tpu tensors).
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::Device getDeviceFromPtr(void*) const override { return kTpu0; }
  // UntypedStorage.resize_ on a tpu storage: reallocate and keep the prefix.
  void resizePrivateUse1Bytes(const c10::Storage& storage,
                              size_t nbytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "trying to resize a storage that is not resizable");
    c10::DataPtr fresh = g_allocator.allocate(nbytes);
    size_t keep = std::min(nbytes, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  }
};

const bool g_hooks_registered = [] {
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}();

// ------------------------------------------------------------------ kernels

// A CPU tensor aliasing t's host bytes (same storage bytes, sizes, strides,
// offset, dtype and lazy conj/neg bits), valid while t's storage is: lets the
// CPU kernels copy and fill tpu tensors in place, with no staging copy.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  TORCH_CHECK(t.device().type() == kTpu, "expected a cpu or tpu tensor, got ",
              t.device());
  const c10::Storage& s = t.storage();
  // A DeferAndFuse placeholder that no flush materialised (see empty_unallocated): only
  // reachable through an alias the mode cannot see (`.data` of a placeholder since dropped).
  TORCH_CHECK(s.data() != nullptr || s.nbytes() == 0,
              "this tpu tensor has no memory: it aliases a DeferAndFuse placeholder that was "
              "dropped before a flush gave it memory (take such aliases after "
              "tessera.fusion.flush(), or keep the placeholder alive)");
  c10::Storage host(c10::Storage::use_byte_size_t(), s.nbytes(),
                    c10::DataPtr(s.mutable_data(), c10::Device(c10::kCPU)),
                    /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor a = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  a.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                 t.storage_offset());
  if (t.is_conj()) a = a._conj();
  if (t.is_neg()) a = a._neg_view();
  return a;
}

at::Tensor empty_memory_format(c10::IntArrayRef size,
                               std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == c10::kStrided,
              "the emulated tpu only supports strided tensors");
  if (device) check_index(device->index());
  return at::detail::empty_generic(
      size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!layout || *layout == c10::kStrided,
              "the emulated tpu only supports strided tensors");
  if (device) check_index(device->index());
  return at::detail::empty_strided_generic(
      size, stride, &g_allocator,
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// Every copy that involves a tpu tensor (cpu->tpu, tpu->cpu, tpu->tpu) lands
// here: Tensor.copy_ re-dispatches to _copy_from for non-builtin devices.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst,
                     bool /*non_blocking: everything is synchronous*/) {
  count_transfer(self, dst);
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (g_in_fallback == 0) {
    transfers().d2h += 1;
    transfers().d2h_bytes += static_cast<int64_t>(self.element_size());
  }
  return host_alias(self).item();
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  host_alias(self).fill_(value);
  return self;
}

at::Tensor& zero(at::Tensor& self) {
  host_alias(self).zero_();
  return self;
}

// Tensor.set_() with no source: point at a fresh empty tpu storage (the CPU
// kernel would give the tensor a CPU storage).
at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, &g_allocator,
                     /*resizable=*/true);
  return self.set_(std::move(empty), 0, {0}, {});
}

// DeferAndFuse's placeholders: a contiguous tensor whose storage has its full size but
// no memory yet. Its views are real views (their bounds checks see the size); nothing
// reads or writes it before `materialize` gives it memory from the allocator, so a
// placeholder that is never materialised never appears in the statistics.
at::Tensor empty_unallocated(c10::IntArrayRef size, c10::ScalarType dtype) {
  size_t nbytes = c10::elementSize(dtype);
  for (int64_t d : size) {
    TORCH_CHECK(d >= 0, "empty_unallocated: negative dimension ", d);
    nbytes *= static_cast<size_t>(d);
  }
  c10::Storage s(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, kTpu0),
                 &g_allocator, /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(s), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  return t;
}

// Gives an unallocated storage (see empty_unallocated) its memory; every tensor sharing
// the storage (views) sees it. Returns whether it allocated.
bool materialize(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->data() != nullptr || impl->nbytes() == 0) return false;
  impl->set_data_ptr_noswap(g_allocator.allocate(impl->nbytes()));
  return true;
}

// Whether t's storage has memory (false only for an unmaterialised placeholder).
bool is_allocated(const at::Tensor& t) {
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  return impl->data() != nullptr || impl->nbytes() == 0;
}

// There are no streams to synchronise with.
void record_stream(at::Tensor&, c10::Stream) {}

// Everything without a kernel above: copy tpu arguments to the CPU, run the
// CPU kernel, copy results (and mutated arguments) back. error_on_views=true
// makes an unregistered *view* op fail loudly instead of silently returning a
// copy that does not alias its input.
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  struct Depth {
    Depth() { ++g_in_fallback; }
    ~Depth() { --g_in_fallback; }
  } depth;
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // Factories: allocate host memory labelled tpu:0.
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  // Copies between devices (the fallback itself moves data through these).
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  // Tensor.item(); cheaper than the fallback's round trip.
  m.impl("_local_scalar_dense", local_scalar_dense);
  // zeros/ones/full and zeroing of gradients, in place without a round trip.
  m.impl("fill_.Scalar", fill_scalar);
  m.impl("zero_", zero);
  // Views must alias their input, which the copying fallback cannot do; the
  // CPU implementations only touch metadata, so they are device-agnostic.
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  // out= results: resizes in place, growing the storage with its allocator.
  m.impl("resize_", at::native::resize_);
  // Tensor.set_ (torch.load, FSDP): the tensor must share the source storage,
  // not receive a copy of it; the CPU versions are storage-generic.
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
  m.impl("set_.source_Tensor", at::native::set_tensor_);
  m.impl("set_", set_empty);
  // Identity query: the fallback would compare fresh CPU copies (never set).
  m.impl("is_set_to", at::native::is_set_to);
  // Called by DDP/FSDP on accelerator tensors; a no-op without streams.
  m.impl("record_stream", record_stream);
}

// A conj()/neg view copied to or from tpu reaches _copy_from with its lazy bit
// set. ATen's Conjugate/Negative fallbacks would materialise it with clone(),
// which copies via _copy_from again: endless recursion. Let _copy_from fall
// through to the kernel above, whose host_alias() keeps the bits. (_copy_from
// is only used by out-of-tree devices, and enable() refuses to share the
// process with another PrivateUse1 backend.)
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY(tessera_emulated_tpu, m) {
  m.def("memory_stats() -> int[]", &memory_stats);
  m.def("reset_peak_memory_stats() -> ()", &reset_peak_memory_stats);
  m.def("transfer_stats() -> int[]", &transfer_stats);
  m.def("reset_transfer_stats() -> ()", &reset_transfer_stats);
  m.def("empty_unallocated(int[] size, ScalarType dtype) -> Tensor", &empty_unallocated);
  m.def("materialize(Tensor t) -> bool", &materialize);
  m.def("is_allocated(Tensor t) -> bool", &is_allocated);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}
