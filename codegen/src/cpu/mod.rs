//! The CPU backends over one contract: run a verified [`Kernel`] on caller-owned memory
//! exactly as [`tessera_dsl::interp::run_into`] does (its module docs are the spec),
//! through [`tessera_dsl::Executor`].
//!
//! - [`Backend::Interp`]: the reference interpreter.
//! - [`Backend::Jit`]: the grid-step body compiled to native code with Cranelift
//!   ([`cranelift`]): fused, vectorised loop nests, `dot` through a multi-threaded GEMM
//!   ([`gemm`]: AVX-512 f32 and bf16 kernels where the CPU has them; `acc[..] += dot(..)`
//!   accumulates straight into `acc`).
//! - [`Backend::Llvm`]: the same lowering through LLVM (`inkwell`, feature `llvm`).
//!
//! Both compiled backends share the driver ([`runtime`]): operand checks, the grid walk
//! with every operand's block index per step ([`schedule`]), windows (or in-place access
//! to the caller's arrays where the result cannot differ), poisoned outputs and scratch,
//! simulated DMA, and grid parallelism: the grid is cut into units, one per index of its
//! leading `parallel` dims, and units run on [`runtime::threads`] threads
//! (`TESSERA_THREADS`); `arbitrary` dims stay in order inside a unit. Each thread has its
//! own scratch and windows (as each TensorCore has), so kernels that are race-free on a
//! chip give identical results on 1 and N threads. An output block written by steps that
//! differ in a `parallel` dim is `parallel-revisit`, in every backend.
//!
//! # Compilation cache
//!
//! A kernel is compiled once per (kernel, memory modes, exactness) and kept in a process-wide
//! LRU cache of [`cache_capacity`] entries (default 256, `TESSERA_JIT_CACHE=<n>` or
//! [`set_cache_capacity`]); [`cache_stats`] reports its size, hits, misses and the total
//! compile time. Entries are matched by a structural fingerprint and then by equality, so
//! two different kernels never share code. Evicting an entry frees its code once no run
//! uses it.
//!
//! # Fallback
//!
//! A kernel the compiler cannot lower (IR the builder would not produce, such as stores
//! into inputs, loads from ANY operands or non-positive loop steps; or a compiler failure)
//! runs on the interpreter instead, with identical results and errors; the reason is kept in
//! the cache and counted in [`CacheStats::fallbacks`] ([`fallback_reason`] names it;
//! `TESSERA_JIT_VERBOSE=1` prints it). No
//! input makes a backend panic.

pub mod cranelift;
pub mod gemm;
pub mod layout;
#[cfg(feature = "llvm")]
pub mod llvm;
pub mod runtime;
pub mod schedule;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_dsl::interp::{HostMut, HostRef, RunStats};
use tessera_dsl::{Executor, Interpreter, Kernel, KernelError, Result};

use layout::{default_modes, MemMode};

/// A CPU backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Interp,
    /// Cranelift.
    Jit,
    /// LLVM through inkwell (feature `llvm`).
    Llvm,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Interp, Backend::Jit, Backend::Llvm];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Interp => "interp",
            Backend::Jit => "jit",
            Backend::Llvm => "llvm",
        }
    }

    /// `interp`, `jit` (or `cranelift`), `llvm`.
    pub fn parse(s: &str) -> Option<Backend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interp" | "interpreter" => Some(Backend::Interp),
            "jit" | "cranelift" => Some(Backend::Jit),
            "llvm" => Some(Backend::Llvm),
            _ => None,
        }
    }

    /// `TESSERA_BACKEND` if set and valid, else the JIT.
    pub fn from_env() -> Backend {
        std::env::var("TESSERA_BACKEND").ok().and_then(|s| Backend::parse(&s)).unwrap_or(Backend::Jit)
    }

    /// Whether this build has the backend (LLVM needs the `llvm` feature).
    pub fn available(self) -> bool {
        self != Backend::Llvm || cfg!(feature = "llvm")
    }

    /// The backend as an [`Executor`].
    pub fn executor(self) -> &'static dyn Executor {
        match self {
            Backend::Interp => &Interpreter,
            Backend::Jit => &JIT,
            Backend::Llvm => &LLVM,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A compiled backend as an [`Executor`], with its options.
#[derive(Clone, Copy, Debug)]
pub struct Compiled {
    pub backend: Backend,
    /// Transcendentals and dots computed exactly as the interpreter does (per element in
    /// f64, `matrixmultiply`), so results are bit-identical: a checking mode for fuzzing.
    pub exact: bool,
    /// Threads for the grid and GEMMs; `None` = [`runtime::threads`].
    pub threads: Option<usize>,
}

static JIT: Compiled = Compiled { backend: Backend::Jit, exact: false, threads: None };
static LLVM: Compiled = Compiled { backend: Backend::Llvm, exact: false, threads: None };

impl Compiled {
    pub fn new(backend: Backend) -> Compiled {
        Compiled { backend, exact: false, threads: None }
    }
}

impl Executor for Compiled {
    fn name(&self) -> &'static str {
        self.backend.name()
    }

    fn run_into(&self, kernel: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<RunStats> {
        if self.backend == Backend::Interp {
            return tessera_dsl::interp::run_into(kernel, inputs, outputs);
        }
        if !self.backend.available() {
            return Err(KernelError::new(&kernel.name, "backend", "backend-unavailable", format!("this build has no `{}` backend", self.backend), "build tessera-codegen with `--features llvm` (needs LLVM 22), or use the `jit` backend"));
        }
        runnable(kernel)?;
        let (sched, arrays) = runtime::prepare(kernel, inputs, outputs)?;
        let revisiting: Vec<tessera_dsl::RefId> = sched.blocked.iter().zip(&sched.revisits).filter(|(_, &r)| r).map(|(&r, _)| r).collect();
        let modes = default_modes(kernel, &revisiting);
        match get_or_compile(self.backend, kernel, &modes, self.exact) {
            Ok(code) => {
                let threads = self.threads.unwrap_or_else(runtime::threads);
                runtime::run(kernel, code.program(), &sched, &arrays, outputs, threads)
            }
            Err(_) => tessera_dsl::interp::run_into(kernel, inputs, outputs),
        }
    }
}

/// [`tessera_dsl::verify::runnable`] (some TPU generation accepts the kernel), remembered
/// for the last [`VERIFIED_KERNELS`] kernels that passed: a compiled call costs a few
/// microseconds, and verifying costs tens.
fn runnable(kernel: &Kernel) -> Result<()> {
    static VERIFIED: Mutex<Vec<(u64, Kernel)>> = Mutex::new(Vec::new());
    let key = fingerprint(kernel);
    let seen = |v: &Vec<(u64, Kernel)>| v.iter().any(|(h, k)| *h == key && k == kernel);
    if VERIFIED.lock().map(|v| seen(&v)).unwrap_or(false) {
        return Ok(());
    }
    tessera_dsl::verify::runnable(kernel)?;
    if let Ok(mut v) = VERIFIED.lock() {
        if v.len() >= VERIFIED_KERNELS {
            v.remove(0);
        }
        v.push((key, kernel.clone()));
    }
    Ok(())
}

/// How many verified kernels [`runnable`] remembers.
const VERIFIED_KERNELS: usize = 64;

/// Compiled code of either backend (one per cache entry, behind an `Arc`).
#[allow(clippy::large_enum_variant)]
pub enum Code {
    Cranelift(cranelift::Compiled),
    #[cfg(feature = "llvm")]
    Llvm(llvm::Compiled),
}

impl Code {
    pub fn program(&self) -> &runtime::Program {
        match self {
            Code::Cranelift(c) => &c.program,
            #[cfg(feature = "llvm")]
            Code::Llvm(c) => &c.program,
        }
    }

    pub fn compile_time(&self) -> Duration {
        match self {
            Code::Cranelift(c) => c.compile_time,
            #[cfg(feature = "llvm")]
            Code::Llvm(c) => c.compile_time,
        }
    }
}

struct Entry {
    backend: Backend,
    kernel: Kernel,
    modes: Vec<MemMode>,
    exact: bool,
    code: std::result::Result<Arc<Code>, String>,
    last_used: u64,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<u64, Vec<Entry>>,
    len: usize,
    tick: u64,
    capacity: Option<usize>,
    hits: u64,
    misses: u64,
    compile_time: Duration,
    fallbacks: u64,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// The compilation cache's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    pub entries: usize,
    pub capacity: usize,
    pub hits: u64,
    pub misses: u64,
    /// Total time spent compiling (misses).
    pub compile_time: Duration,
    /// Kernels that run on the interpreter because the compiler refused them.
    pub fallbacks: u64,
}

const DEFAULT_CAPACITY: usize = 256;

fn with_cache<T>(f: impl FnOnce(&mut Cache) -> T) -> T {
    let mut g = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let c = g.get_or_insert_with(Cache::default);
    f(c)
}

/// How many compiled kernels the cache keeps: `TESSERA_JIT_CACHE`, default 256.
pub fn cache_capacity() -> usize {
    with_cache(|c| c.capacity.unwrap_or_else(|| std::env::var("TESSERA_JIT_CACHE").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_CAPACITY)).max(1))
}

pub fn set_cache_capacity(n: usize) {
    with_cache(|c| c.capacity = Some(n.max(1)));
    with_cache(evict);
}

pub fn cache_stats() -> CacheStats {
    let capacity = cache_capacity();
    with_cache(|c| CacheStats { entries: c.len, capacity, hits: c.hits, misses: c.misses, compile_time: c.compile_time, fallbacks: c.fallbacks })
}

/// Drops every compiled kernel (code still running stays alive until it returns).
pub fn clear_cache() {
    with_cache(|c| {
        c.entries.clear();
        c.len = 0;
    });
}

fn evict(c: &mut Cache) {
    let cap = c.capacity.unwrap_or_else(|| std::env::var("TESSERA_JIT_CACHE").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_CAPACITY)).max(1);
    while c.len > cap {
        let Some((&key, pos)) = c.entries.iter().flat_map(|(k, v)| v.iter().enumerate().map(move |(i, e)| ((k, i), e.last_used))).min_by_key(|(_, t)| *t).map(|((k, i), _)| (k, i)) else { break };
        if let Some(v) = c.entries.get_mut(&key) {
            v.remove(pos);
            if v.is_empty() {
                c.entries.remove(&key);
            }
        }
        c.len -= 1;
    }
}

/// A structural hash of the kernel (cheap: shapes, kinds and op kinds); equality decides.
pub fn fingerprint(k: &Kernel) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    k.name.hash(&mut h);
    for g in &k.grid {
        g.extent.hash(&mut h);
        g.semantics.hash(&mut h);
        g.dynamic.hash(&mut h);
    }
    for r in &k.refs {
        r.kind.hash(&mut h);
        r.dtype.hash(&mut h);
        r.shape.hash(&mut h);
        r.memory.hash(&mut h);
        if let Some(b) = &r.block {
            b.block_shape.hash(&mut h);
        }
    }
    k.values.len().hash(&mut h);
    for d in &k.insts {
        std::mem::discriminant(&d.inst).hash(&mut h);
        d.results.len().hash(&mut h);
    }
    h.finish()
}

/// The compiled code for `kernel`, from the cache or compiled now; `Err` (with the reason)
/// when the kernel runs on the interpreter instead.
pub fn get_or_compile(backend: Backend, kernel: &Kernel, modes: &[MemMode], exact: bool) -> std::result::Result<Arc<Code>, String> {
    let key = {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        fingerprint(kernel).hash(&mut h);
        backend.hash(&mut h);
        modes.hash(&mut h);
        exact.hash(&mut h);
        h.finish()
    };
    let found = with_cache(|c| {
        c.tick += 1;
        let tick = c.tick;
        let hit = c.entries.get_mut(&key).and_then(|v| v.iter_mut().find(|e| e.backend == backend && e.exact == exact && e.modes == modes && e.kernel == *kernel)).map(|e| {
            e.last_used = tick;
            e.code.clone()
        });
        if hit.is_some() {
            c.hits += 1;
        }
        hit
    });
    if let Some(code) = found {
        return code;
    }
    let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compile(backend, kernel, modes, exact)));
    let code = match compiled {
        Ok(Ok(code)) => Ok(Arc::new(code)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("the {backend} compiler panicked on `{}`", kernel.name)),
    };
    if let Err(reason) = &code {
        if std::env::var_os("TESSERA_JIT_VERBOSE").is_some() {
            eprintln!("tessera {backend}: `{}` runs on the interpreter: {reason}", kernel.name);
        }
    }
    with_cache(|c| {
        c.misses += 1;
        match &code {
            Ok(code) => c.compile_time += code.compile_time(),
            Err(_) => c.fallbacks += 1,
        }
        c.tick += 1;
        let tick = c.tick;
        c.entries.entry(key).or_default().push(Entry { backend, kernel: kernel.clone(), modes: modes.to_vec(), exact, code: code.clone(), last_used: tick });
        c.len += 1;
        evict(c);
    });
    code
}

fn compile(backend: Backend, kernel: &Kernel, modes: &[MemMode], exact: bool) -> std::result::Result<Code, String> {
    match backend {
        Backend::Jit => cranelift::compile(kernel, modes, exact).map(Code::Cranelift).map_err(|e| e.0),
        #[cfg(feature = "llvm")]
        Backend::Llvm => llvm::compile(kernel, modes, exact).map(Code::Llvm).map_err(|e| e.0),
        #[cfg(not(feature = "llvm"))]
        Backend::Llvm => Err("this build has no LLVM backend (feature `llvm`)".to_string()),
        Backend::Interp => Err("the interpreter compiles nothing".to_string()),
    }
}

/// Why `kernel` runs on the interpreter under `backend` (with its default memory modes),
/// or `None` when it compiles. Compiles it (through the cache) if needed.
pub fn fallback_reason(backend: Backend, kernel: &Kernel) -> Option<String> {
    let modes = default_modes(kernel, &[]);
    get_or_compile(backend, kernel, &modes, false).err()
}

/// Compiles `kernel` for `backend` (default memory modes) and returns the compile time
/// (zero when it was cached), or the fallback reason.
pub fn compile_time(backend: Backend, kernel: &Kernel) -> std::result::Result<Duration, String> {
    let before = cache_stats();
    let modes = default_modes(kernel, &[]);
    get_or_compile(backend, kernel, &modes, false)?;
    let after = cache_stats();
    Ok(after.compile_time.saturating_sub(before.compile_time))
}
