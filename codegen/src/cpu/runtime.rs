//! The driver both compiled backends share: it checks the operands, walks the
//! [`Schedule`], moves windows (or points the body at the caller's arrays), calls the
//! compiled grid-step function, simulates DMA and turns failures reported by compiled code
//! into the interpreter's errors. Grid steps of different units (indices of the leading
//! `parallel` dims) run on several threads.
//!
//! Memory the compiled code touches is always one of: the caller's input arrays (read
//! only: the compiler refuses kernels that write an input), the caller's output arrays
//! (threads write disjoint blocks: `parallel-revisit` is checked first, and kernels with
//! unblocked outputs run on one thread), and buffers owned by one thread (windows,
//! scratch, the frame of materialised values).

use std::ffi::c_void;
use std::time::Instant;

use half::bf16;
use tessera_dsl::interp::{next_index, HostData, HostDataMut, HostMut, HostRef, RunStats};
use tessera_dsl::{DType, Kernel, KernelError, RefId, RefKind, Result, Semantics};

use super::layout::{row_major, MemMode, RefLayout, Sites};
use super::schedule::{schedule, Schedule};

/// What compiled code receives for one grid step. `#[repr(C)]`: the generated code reads
/// its fields at fixed offsets ([`CTX_REFS`], ...).
#[repr(C)]
pub struct StepCtx {
    /// One pointer per ref: where its view starts this step (null for semaphores).
    pub refs: *const *mut u8,
    /// The grid coordinates of the step.
    pub grid: *const i32,
    /// The frame: materialised values, 64-byte aligned.
    pub frame: *mut u8,
    /// The thread's [`ThreadRt`], passed back to the helpers.
    pub rt: *mut c_void,
}

pub const CTX_REFS: i32 = 0;
pub const CTX_GRID: i32 = 8;
pub const CTX_FRAME: i32 = 16;
pub const CTX_RT: i32 = 24;

/// A compiled grid-step function: returns 0, or non-zero after a helper recorded an error
/// in the [`ThreadRt`].
pub type StepFn = unsafe extern "C" fn(*mut StepCtx) -> i32;

/// A compiled kernel as the driver needs it. The backend keeps the code alive.
pub struct Program {
    pub step: StepFn,
    pub frame_bytes: usize,
    pub layouts: Vec<RefLayout>,
    pub sites: Sites,
}

// SAFETY: `step` points at immutable, finalised machine code that only touches memory
// through the `StepCtx` it is given; the rest is plain data.
unsafe impl Send for Program {}
unsafe impl Sync for Program {}

/// An async copy in flight (as the interpreter's).
struct PendingDma {
    sem: (RefId, usize),
    data: Vec<u8>,
    dst: RefId,
    origin: Vec<usize>,
    lens: Vec<usize>,
    bytes: usize,
    issued: String,
}

/// Per-thread state the helpers see.
pub struct ThreadRt<'a> {
    pub kernel: &'a Kernel,
    pub program: &'a Program,
    pub ptrs: Vec<*mut u8>,
    pub grid: Vec<i32>,
    pub error: Option<KernelError>,
    dmas: Vec<PendingDma>,
    /// Threads the GEMM may use.
    pub gemm_threads: usize,
    /// The random generator of the running grid step (`None` until `prng_seed`), the
    /// interpreter's [`tessera_dsl::interp::Prng`].
    pub prng: Option<tessera_dsl::interp::Prng>,
}

fn poison_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => f32::NAN.to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(f32::NAN).to_bits().to_le_bytes().to_vec(),
        DType::I32 => i32::MIN.to_le_bytes().to_vec(),
        DType::I8 => vec![i8::MIN as u8],
        DType::Bool => vec![0],
        // NaN (e4m3fn's only one; one of e5m2's).
        DType::F8E4M3FN | DType::F8E5M2 => vec![0x7f],
    }
}

fn poisoned(dtype: DType, n: usize) -> Vec<u8> {
    poison_bytes(dtype).repeat(n)
}

/// Copies the `region` box from `src` (element `src_strides`, origin element offset
/// `src_off`) to `dst` likewise; `esize` bytes per element; the last stride is 1 on both.
///
/// # Safety
/// Every element of the box must lie inside both allocations.
unsafe fn copy_box(src: *const u8, src_strides: &[usize], dst: *mut u8, dst_strides: &[usize], region: &[usize], esize: usize) {
    let Some((&len, outer)) = region.split_last() else {
        // SAFETY: the caller guarantees one element at each pointer.
        unsafe { std::ptr::copy(src, dst, esize) };
        return;
    };
    if region.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; outer.len()];
    loop {
        let so: usize = idx.iter().zip(src_strides).map(|(i, s)| i * s).sum();
        let dof: usize = idx.iter().zip(dst_strides).map(|(i, s)| i * s).sum();
        let (ss, ds) = (src_strides[outer.len()], dst_strides[outer.len()]);
        if ss == 1 && ds == 1 {
            // SAFETY: the row lies inside both allocations (caller); `copy` allows overlap.
            unsafe { std::ptr::copy(src.add(so * esize), dst.add(dof * esize), len * esize) };
        } else {
            for j in 0..len {
                // SAFETY: as above, element by element.
                unsafe { std::ptr::copy(src.add((so + j * ss) * esize), dst.add((dof + j * ds) * esize), esize) };
            }
        }
        if !next_index(&mut idx, outer) {
            return;
        }
    }
}

/// Fills the `region` box at `dst` (element strides) with the repeated `pattern`.
///
/// # Safety
/// Every element of the box must lie inside the allocation.
unsafe fn fill_box(dst: *mut u8, strides: &[usize], region: &[usize], pattern: &[u8]) {
    let esize = pattern.len();
    let n: usize = region.iter().product();
    if n == 0 {
        return;
    }
    let mut idx = vec![0usize; region.len()];
    for _ in 0..n {
        let off: usize = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
        // SAFETY: inside the box (caller).
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), dst.add(off * esize), esize) };
        next_index(&mut idx, region);
    }
}

fn host_ptr(h: HostData<'_>) -> *mut u8 {
    match h {
        HostData::F32(v) => v.as_ptr() as *mut u8,
        HostData::BF16(v) => v.as_ptr() as *mut u8,
        HostData::I32(v) => v.as_ptr() as *mut u8,
        HostData::I8(v) => v.as_ptr() as *mut u8,
        HostData::Bool(v) => v.as_ptr() as *mut u8,
        HostData::F8E4M3FN(v) => v.as_ptr() as *mut u8,
        HostData::F8E5M2(v) => v.as_ptr() as *mut u8,
    }
}

fn host_mut_ptr(h: &mut HostDataMut<'_>) -> *mut u8 {
    match h {
        HostDataMut::F32(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::BF16(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::I32(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::I8(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::Bool(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::F8E4M3FN(v) => v.as_mut_ptr() as *mut u8,
        HostDataMut::F8E5M2(v) => v.as_mut_ptr() as *mut u8,
    }
}

/// The caller's arrays as raw pointers (inputs never written), one per ref (null for
/// scratch).
#[derive(Clone)]
pub struct Arrays {
    pub ptrs: Vec<*mut u8>,
}

// SAFETY: the pointers are into the caller's operand memory, alive for the whole run;
// threads only read inputs and write disjoint output blocks (see the module docs).
unsafe impl Send for Arrays {}
unsafe impl Sync for Arrays {}

/// Checks the operands as the interpreter does (count, dtype, shape, length, then block
/// specs); returns nothing written on error.
pub fn check_operands(k: &Kernel, inputs: &[HostRef<'_>], outputs: &[HostMut<'_>]) -> Result<()> {
    let err = |subject: &str, rule: &'static str, msg: String, help: String| KernelError::new(&k.name, subject, rule, msg, help);
    // Formatted only when an error needs it (this runs on every call).
    let subj = |d: &tessera_dsl::RefDecl| format!("{} `{}`", d.kind.name(), d.name);
    let ins: Vec<_> = k.refs.iter().filter(|r| matches!(r.kind, RefKind::Prefetch | RefKind::Input)).collect();
    if inputs.len() != ins.len() {
        let names: Vec<&str> = ins.iter().map(|r| r.name.as_str()).collect();
        return Err(err("arguments", "argument-count", format!("{} arguments given, the kernel takes {} ({})", inputs.len(), ins.len(), names.join(", ")), "pass the prefetch and input operands in signature order".into()));
    }
    let outs: Vec<_> = k.refs.iter().filter(|r| r.kind == RefKind::Output).collect();
    if outputs.len() != outs.len() {
        let names: Vec<&str> = outs.iter().map(|r| r.name.as_str()).collect();
        return Err(err("outputs", "output-count", format!("{} outputs given, the kernel has {} ({})", outputs.len(), outs.len(), names.join(", ")), "pass one output buffer per output operand, in signature order".into()));
    }
    let (mut next_in, mut next_out) = (inputs.iter(), outputs.iter());
    for decl in &k.refs {
        if let Some(b) = &decl.block {
            let rank = decl.shape.len();
            if b.block_shape.len() != rank || b.index_map.len() != rank {
                return Err(err(&subj(decl), "block-rank", format!("block shape has {} dims and the index map {} results, the array {:?} has {rank} dims", b.block_shape.len(), b.index_map.len(), decl.shape), "give one block dim and one index-map result per array dim".into()));
            }
            for (d, (&blk, &full)) in b.block_shape.iter().zip(&decl.shape).enumerate() {
                // A block larger than its array dim is legal (libtpu compiles it): the
                // excess is padding, as in a partial edge block (the interpreter's rule).
                let n = blk.unwrap_or(1);
                if n == 0 {
                    return Err(err(&subj(decl), "block-shape", format!("block dim {d} is 0 (the array dim is {full})"), "use block dims of at least 1".into()));
                }
            }
            if matches!(decl.kind, RefKind::Prefetch | RefKind::Scratch) {
                return Err(err(&subj(decl), "blocked-memory-space", format!("a {} with a block spec", decl.kind.name()), "scalar prefetch and scratch buffers are seen whole; drop the block spec".into()));
            }
        }
        let (shape, dtype, len) = match decl.kind {
            RefKind::Prefetch | RefKind::Input => {
                let a = next_in.next().expect("count checked");
                (a.shape, a.data.dtype(), a.data.len())
            }
            RefKind::Output => {
                let o = next_out.next().expect("count checked");
                (o.shape, o.data.dtype(), o.data.len())
            }
            RefKind::Scratch => continue,
        };
        let (role, rule_dtype, rule_shape) = if decl.kind == RefKind::Output { ("output", "output-dtype", "output-shape") } else { ("argument", "argument-dtype", "argument-shape") };
        if dtype != decl.dtype {
            return Err(err(&subj(decl), rule_dtype, format!("expected {} elements, got {dtype} data", decl.dtype), format!("pass a {} {role}", decl.dtype)));
        }
        if shape != decl.shape.as_slice() {
            return Err(err(&subj(decl), rule_shape, format!("expected shape {:?}, got {shape:?}", decl.shape), format!("pass an {role} of shape {:?} or rebuild the kernel for this shape", decl.shape)));
        }
        let n: usize = decl.shape.iter().product();
        if len != n {
            return Err(err(&subj(decl), rule_shape, format!("shape {shape:?} has {n} elements but the data holds {len}"), "make the data length match the shape".into()));
        }
    }
    Ok(())
}

/// Prepares a run: checks the operands, poisons the outputs and computes the schedule.
pub fn prepare(k: &Kernel, inputs: &[HostRef<'_>], outputs: &mut [HostMut<'_>]) -> Result<(Schedule, Arrays)> {
    check_operands(k, inputs, outputs)?;
    let sched = schedule(k, inputs);
    let out_refs: Vec<RefId> = k.refs_of(RefKind::Output).map(|(r, _)| r).collect();
    for (o, &r) in outputs.iter_mut().zip(&out_refs) {
        if sched.error.is_some() || !fully_overwritten(k, &sched, r) {
            o.data.fill_poison();
        }
    }
    let (mut ni, mut no) = (inputs.iter(), outputs.iter_mut());
    let ptrs = k
        .refs
        .iter()
        .map(|r| match r.kind {
            RefKind::Prefetch | RefKind::Input => host_ptr(ni.next().expect("checked").data),
            RefKind::Output => host_mut_ptr(&mut no.next().expect("checked").data),
            RefKind::Scratch => std::ptr::null_mut(),
        })
        .collect();
    Ok((sched, Arrays { ptrs }))
}

/// Whether every element of output `r` is written before anything could read it, so
/// that poisoning it first changes nothing: the body never loads it or moves it by DMA,
/// stores its whole block unconditionally (at the top level), and the grid visits every
/// block.
pub fn fully_overwritten(k: &Kernel, sched: &Schedule, r: RefId) -> bool {
    let decl = k.ref_decl(r);
    let Some(spec) = &decl.block else { return false };
    let Some(b) = sched.blocked.iter().position(|&x| x == r) else { return false };
    let mut touched = false;
    k.walk(k.body, &mut |_, d| match &d.inst {
        tessera_dsl::Inst::Load { src, .. } if *src == r => touched = true,
        tessera_dsl::Inst::DmaStart { src, dst, .. } | tessera_dsl::Inst::DmaWait { src, dst, .. } if src.r == r || dst.r == r => touched = true,
        _ => {}
    });
    if touched {
        return false;
    }
    let view = decl.view();
    let full_store = k.block(k.body).insts.iter().any(|&i| match &k.inst(i).inst {
        tessera_dsl::Inst::Store { dst, slices, .. } if *dst == r => slices.len() == view.len() && slices.iter().zip(&view).all(|(s, &n)| s.len == n && matches!(k.as_const(s.start), Some(tessera_dsl::Scalar::Int(0)))),
        _ => false,
    });
    if !full_store {
        return false;
    }
    let window = spec.window();
    let blocks: usize = decl.shape.iter().zip(&window).map(|(n, w)| n.div_ceil(*w)).product();
    let mut seen = std::collections::HashSet::new();
    for step in 0..sched.steps {
        seen.insert(sched.block(step, b).to_vec());
    }
    seen.len() == blocks
}

/// How many threads to use for the grid and for GEMMs.
/// `TESSERA_THREADS`, else the available parallelism; read once (the latter parses cgroup
/// files, too slow for every call).
pub fn threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        if let Some(n) = std::env::var("TESSERA_THREADS").ok().and_then(|s| s.parse::<usize>().ok()) {
            return n.max(1);
        }
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    })
}

/// Outputs from this size up get [`advise_huge_pages`].
const HUGE_OUTPUT_BYTES: usize = 8 << 20;

/// Asks Linux for transparent huge pages (`madvise(MADV_HUGEPAGE)`) on the 2 MiB-aligned
/// interior of each output of at least [`HUGE_OUTPUT_BYTES`]. A fresh result tensor from
/// torch is untouched memory, and its first touch by the kernel page-faults once every
/// 4 KiB: for a [4096, 4096] f32 result ~45 ms of CPU a call on the 2-core VM, as much as
/// a fifth of a fused elementwise kernel; with huge pages it faults once every 2 MiB. Only
/// advice (the kernel's result cannot change; memory already touched keeps its pages until
/// the OS collapses them), and only where THP is `madvise` or `always`; elsewhere nothing.
fn advise_huge_pages(outputs: &[HostMut<'_>]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        for o in outputs {
            let (ptr, bytes) = match &o.data {
                HostDataMut::F32(s) => (s.as_ptr() as usize, std::mem::size_of_val(*s)),
                HostDataMut::BF16(s) => (s.as_ptr() as usize, std::mem::size_of_val(*s)),
                HostDataMut::I32(s) => (s.as_ptr() as usize, std::mem::size_of_val(*s)),
                HostDataMut::I8(s) => (s.as_ptr() as usize, s.len()),
                HostDataMut::Bool(s) => (s.as_ptr() as usize, s.len()),
                HostDataMut::F8E4M3FN(s) => (s.as_ptr() as usize, s.len()),
                HostDataMut::F8E5M2(s) => (s.as_ptr() as usize, s.len()),
            };
            if bytes < HUGE_OUTPUT_BYTES {
                continue;
            }
            let a = ptr.next_multiple_of(HUGE);
            let b = (ptr + bytes) / HUGE * HUGE;
            if b > a {
                // SAFETY: [a, b) lies inside the borrowed output; MADV_HUGEPAGE only changes
                // how the kernel backs those pages, never their contents. A failure (no THP
                // in this kernel) is harmless and ignored.
                unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE) };
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = outputs;
}

/// Runs the program over the whole schedule; `threads` 1 runs in order on this thread.
pub fn run(k: &Kernel, p: &Program, sched: &Schedule, arrays: &Arrays, outputs: &mut [HostMut<'_>], threads: usize) -> Result<RunStats> {
    let start = Instant::now();
    advise_huge_pages(outputs);
    let all_blocked = k.refs.iter().filter(|r| r.kind == RefKind::Output).all(|r| r.block.is_some());
    let window_elems: usize = k.refs.iter().filter_map(|r| r.block.as_ref()).map(|b| b.window().iter().product::<usize>()).sum();
    let work = sched.steps.saturating_mul(window_elems.max(1));
    let units = sched.units;
    let t = threads.min(units);
    let mut stats = RunStats::default();
    if t > 1 && all_blocked && sched.error.is_none() && work >= (1 << 16) {
        // Up to CHUNKS_PER_THREAD chunks of whole units a thread, taken in order by whichever
        // thread is free: on a machine shared with other jobs one thread that is
        // descheduled for a while no longer holds up the call with half of the grid.
        const CHUNKS_PER_THREAD: usize = 4;
        let n = units.min(t * CHUNKS_PER_THREAD);
        let chunks: Vec<(usize, usize)> = (0..n).map(|i| (i * units / n * sched.unit_len, (i + 1) * units / n * sched.unit_len)).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results: Vec<Result<RunStats>> = {
            let slots: Vec<std::sync::Mutex<Option<Result<RunStats>>>> = (0..n).map(|_| std::sync::Mutex::new(None)).collect();
            rayon::scope(|s| {
                for _ in 0..t {
                    s.spawn(|_| loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(a, b)) = chunks.get(i) else { break };
                        let r = run_range(k, p, sched, arrays, a, b, 1);
                        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                    });
                }
            });
            slots.into_iter().map(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every chunk ran")).collect()
        };
        if results.iter().all(|r| r.is_ok()) {
            for r in results.into_iter().flatten() {
                stats.grid_steps += r.grid_steps;
                stats.block_loads += r.block_loads;
                stats.block_writebacks += r.block_writebacks;
            }
            stats.elapsed = start.elapsed();
            return Ok(stats);
        }
        // The first error in grid order is the sequential run's: run again on one thread.
        outputs.iter_mut().for_each(|o| o.data.fill_poison());
    }
    let mut stats = match run_range(k, p, sched, arrays, 0, sched.steps, threads) {
        Ok(s) => s,
        Err(e) => {
            // Outputs that were not poisoned first must not show the caller's old data.
            outputs.iter_mut().for_each(|o| o.data.fill_poison());
            return Err(e);
        }
    };
    if let Some((_, e)) = &sched.error {
        return Err(e.clone());
    }
    stats.elapsed = start.elapsed();
    Ok(stats)
}

/// Runs steps `a..b` in order on this thread with its own windows, scratch and frame.
#[allow(clippy::too_many_arguments)]
fn run_range(k: &Kernel, p: &Program, sched: &Schedule, arrays: &Arrays, a: usize, b: usize, gemm_threads: usize) -> Result<RunStats> {
    let mut stats = RunStats::default();
    let nrefs = k.refs.len();
    // Thread-owned memory.
    let mut owned: Vec<Vec<u8>> = vec![Vec::new(); nrefs];
    let mut ptrs = vec![std::ptr::null_mut::<u8>(); nrefs];
    for (i, (decl, l)) in k.refs.iter().zip(&p.layouts).enumerate() {
        match l.mode {
            MemMode::Scratch => {
                owned[i] = poisoned(decl.dtype, decl.shape.iter().product());
                ptrs[i] = owned[i].as_mut_ptr();
            }
            MemMode::Window => {
                let w = decl.window();
                owned[i] = poisoned(decl.dtype, w.iter().product());
                ptrs[i] = owned[i].as_mut_ptr();
            }
            MemMode::Whole => ptrs[i] = arrays.ptrs[i],
            MemMode::Direct | MemMode::Semaphore => {}
        }
    }
    // 64-byte aligned frame.
    let mut frame: Vec<u64> = vec![0; p.frame_bytes.div_ceil(8) + 8];
    let frame_ptr = {
        let raw = frame.as_mut_ptr() as *mut u8;
        // SAFETY: at most 63 bytes into an allocation 64 bytes longer than the frame.
        unsafe { raw.add(raw.align_offset(64)) }
    };
    let grid_rank = k.grid.len();
    let mut rt = ThreadRt { kernel: k, program: p, ptrs, grid: vec![0; grid_rank.max(1)], error: None, dmas: Vec::new(), gemm_threads, prng: None };
    let mut current: Vec<Option<Vec<u32>>> = vec![None; sched.blocked.len()];
    let sequential = k.grid.iter().all(|g| g.semantics == Semantics::Arbitrary);
    let end = b.min(sched.steps);
    for step in a..end {
        for (bi, &r) in sched.blocked.iter().enumerate() {
            let idx = sched.block(step, bi);
            if current[bi].as_deref() == Some(idx) {
                continue;
            }
            let decl = k.ref_decl(r);
            let l = &p.layouts[r.index()];
            if decl.kind == RefKind::Output {
                if let Some(prev) = current[bi].take() {
                    write_back(k, p, arrays, &rt.ptrs, r, &prev);
                    stats.block_writebacks += 1;
                }
            }
            enter_block(k, l, arrays, &mut rt.ptrs, r, idx);
            if decl.kind == RefKind::Input {
                stats.block_loads += 1;
            }
            current[bi] = Some(idx.to_vec());
        }
        sched.coords(step, &mut rt.grid);
        // Each grid step starts unseeded, as in the interpreter.
        rt.prng = None;
        let mut ctx = StepCtx { refs: rt.ptrs.as_ptr(), grid: rt.grid.as_ptr(), frame: frame_ptr, rt: &mut rt as *mut ThreadRt as *mut c_void };
        // SAFETY: `ctx` points at one pointer per ref, each the start of memory laid out as
        // `p.layouts` says for this step (windows, scratch and the frame owned here, the
        // caller's arrays checked against the kernel's shapes), which is what the step
        // function was compiled for; it bounds-checks every dynamic access itself.
        let status = unsafe { (p.step)(&mut ctx) };
        if status != 0 {
            return Err(rt.error.take().unwrap_or_else(|| KernelError::new(&k.name, "compiled code", "jit-internal", format!("grid step {:?} failed without an error", rt.grid), "report this bug")));
        }
        stats.grid_steps += 1;
        if !sequential || step + 1 == sched.steps {
            rt.check_no_pending_dma(step + 1 == sched.steps)?;
        }
    }
    for (bi, &r) in sched.blocked.iter().enumerate() {
        if k.ref_decl(r).kind == RefKind::Output {
            if let Some(prev) = current[bi].take() {
                write_back(k, p, arrays, &rt.ptrs, r, &prev);
                stats.block_writebacks += 1;
            }
        }
    }
    drop(owned);
    Ok(stats)
}

fn origin_region(decl: &tessera_dsl::RefDecl, idx: &[u32]) -> (Vec<usize>, Vec<usize>) {
    let window = decl.window();
    let origin: Vec<usize> = idx.iter().zip(&window).map(|(&b, w)| b as usize * w).collect();
    let region = origin.iter().zip(&window).zip(&decl.shape).map(|((o, w), full)| (*w).min(full - o)).collect();
    (origin, region)
}

/// Points blocked operand `r` at block `idx`: in place, or by loading / poisoning its window.
fn enter_block(k: &Kernel, l: &RefLayout, arrays: &Arrays, ptrs: &mut [*mut u8], r: RefId, idx: &[u32]) {
    let decl = k.ref_decl(r);
    let (origin, region) = origin_region(decl, idx);
    let esize = decl.dtype.bytes();
    let full = row_major(&decl.shape);
    let off: usize = origin.iter().zip(&full).map(|(o, s)| o * s).sum();
    let window = decl.window();
    match l.mode {
        MemMode::Direct => {
            // SAFETY: `off` is the block's first element, inside the array (block indices
            // were checked against the number of blocks by the schedule).
            ptrs[r.index()] = unsafe { arrays.ptrs[r.index()].add(off * esize) };
        }
        MemMode::Window => {
            let win = ptrs[r.index()];
            let wstrides = row_major(&window);
            let pattern = poison_bytes(decl.dtype);
            if decl.kind == RefKind::Input {
                if region != window {
                    // SAFETY: the window buffer holds the whole window.
                    unsafe { fill_box(win, &wstrides, &window, &pattern) };
                }
                // SAFETY: `region` is inside the array from `origin` and inside the window.
                unsafe { copy_box(arrays.ptrs[r.index()].add(off * esize), &full, win, &wstrides, &region, esize) };
            } else {
                // SAFETY: the window buffer holds the whole window.
                unsafe { fill_box(win, &wstrides, &window, &pattern) };
            }
        }
        _ => {}
    }
}

/// Writes output `r`'s window for block `idx` back (window mode; in place needs nothing).
fn write_back(k: &Kernel, p: &Program, arrays: &Arrays, ptrs: &[*mut u8], r: RefId, idx: &[u32]) {
    if p.layouts[r.index()].mode != MemMode::Window {
        return;
    }
    let decl = k.ref_decl(r);
    let (origin, region) = origin_region(decl, idx);
    let esize = decl.dtype.bytes();
    let full = row_major(&decl.shape);
    let off: usize = origin.iter().zip(&full).map(|(o, s)| o * s).sum();
    // SAFETY: the region lies inside the window buffer and, from `origin`, inside the array.
    unsafe { copy_box(ptrs[r.index()], &row_major(&decl.window()), arrays.ptrs[r.index()].add(off * esize), &full, &region, esize) };
}

impl ThreadRt<'_> {
    fn err(&self, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> KernelError {
        KernelError::new(&self.kernel.name, subject, rule, message, help)
    }

    fn grid_usize(&self) -> Vec<usize> {
        self.grid[..self.kernel.grid.len()].iter().map(|&g| g as usize).collect()
    }

    /// Records the error of slice site `site` with dynamic start `start`.
    pub fn fail_slice(&mut self, site: usize, start: i32) {
        let Some(s) = self.program.sites.slices.get(site) else { return };
        let start = start as i64;
        let e = self
            .err(
                s.subject.clone(),
                "slice-out-of-bounds",
                if s.stride == 1 {
                    format!("at grid step {:?}, dim {}: elements {start}..{} of a block of {}", self.grid_usize(), s.dim, start + s.len as i64, s.extent)
                } else {
                    let span = ((s.len - 1) * s.stride + 1) as i64;
                    format!("at grid step {:?}, dim {}: {} elements {start}, {}, .., {} (stride {}) of a block of {}", self.grid_usize(), s.dim, s.len, start + s.stride as i64, start + span - 1, s.stride, s.extent)
                },
                "keep dynamic slices inside the block (clamp the start or fix the loop bounds)",
            )
            .at(s.loc.clone());
        self.error = Some(e);
    }

    fn check_box(&self, subject: String, view: &[usize], starts: &[i32], lens: &[usize], loc: &Option<tessera_dsl::SourceLoc>) -> Result<Vec<usize>> {
        let mut origin = Vec::with_capacity(view.len());
        for (dim, ((&s, &len), &extent)) in starts.iter().zip(lens).zip(view).enumerate() {
            let start = s as i64;
            if start < 0 || start + len as i64 > extent as i64 {
                return Err(self
                    .err(subject, "slice-out-of-bounds", format!("at grid step {:?}, dim {dim}: elements {start}..{} of a block of {extent}", self.grid_usize(), start + len as i64), "keep dynamic slices inside the block (clamp the start or fix the loop bounds)")
                    .at(loc.clone()));
            }
            origin.push(start as usize);
        }
        Ok(origin)
    }

    fn semaphore(&self, sem: RefId, i: i32, loc: &Option<tessera_dsl::SourceLoc>) -> Result<(RefId, usize)> {
        let decl = self.kernel.ref_decl(sem);
        let n: usize = decl.shape.iter().product();
        if i < 0 || i as usize >= n {
            return Err(self.err(format!("semaphore `{}`", decl.name), "slice-out-of-bounds", format!("at grid step {:?}: semaphore {i} of an array of {n}", self.grid_usize()), "keep semaphore indices inside the array").at(loc.clone()));
        }
        Ok((sem, i as usize))
    }

    fn sem_name(&self, sem: (RefId, usize)) -> String {
        format!("`{}[{}]`", self.kernel.refs[sem.0.index()].name, sem.1)
    }

    /// `dma_start` / `dma_wait` of DMA site `site`; `args` holds the semaphore index, the
    /// source starts and the destination starts.
    pub fn dma(&mut self, site: usize, args: &[i32]) -> Result<()> {
        let k = self.kernel;
        let s = &self.program.sites.dmas[site];
        let (ns, nd) = (s.src_lens.len(), s.dst_lens.len());
        let sem = self.semaphore(s.sem, args[0], &s.loc)?;
        let (src_starts, dst_starts) = (&args[1..1 + ns], &args[1 + ns..1 + ns + nd]);
        let (sd, dd) = (k.ref_decl(s.src), k.ref_decl(s.dst));
        let (sl, dl) = (&self.program.layouts[s.src.index()], &self.program.layouts[s.dst.index()]);
        let esize = dd.dtype.bytes();
        if s.start {
            let src_origin = self.check_box(format!("DMA source {} `{}`", sd.kind.name(), sd.name), &sl.view, src_starts, &s.src_lens, &s.loc)?;
            let origin = self.check_box(format!("DMA destination {} `{}`", dd.kind.name(), dd.name), &dl.view, dst_starts, &s.dst_lens, &s.loc)?;
            let count: usize = s.dst_lens.iter().product();
            let mut data = vec![0u8; count * esize];
            let soff: usize = src_origin.iter().zip(&sl.strides).map(|(o, st)| o * st).sum();
            // SAFETY: the box was checked against the source's view; the snapshot holds it.
            unsafe { copy_box(self.ptrs[s.src.index()].add(soff * esize), &sl.strides, data.as_mut_ptr(), &row_major(&s.src_lens), &s.src_lens, esize) };
            let doff: usize = origin.iter().zip(&dl.strides).map(|(o, st)| o * st).sum();
            // SAFETY: the box was checked against the destination's view.
            unsafe { fill_box(self.ptrs[s.dst.index()].add(doff * esize), &dl.strides, &s.dst_lens, &poison_bytes(dd.dtype)) };
            let issued = s.loc.as_ref().map_or_else(|| "dma_start".to_string(), |l| format!("dma_start at {l}"));
            self.dmas.push(PendingDma { sem, data, dst: s.dst, origin, lens: s.dst_lens.clone(), bytes: count * esize, issued });
            Ok(())
        } else {
            self.check_box(format!("DMA destination {} `{}`", dd.kind.name(), dd.name), &dl.view, dst_starts, &s.dst_lens, &s.loc)?;
            self.check_box(format!("DMA source {} `{}`", sd.kind.name(), sd.name), &sl.view, src_starts, &s.src_lens, &s.loc)?;
            let bytes = s.dst_lens.iter().product::<usize>() * esize;
            let Some(pos) = self.dmas.iter().position(|p| p.sem == sem) else {
                return Err(self
                    .err(format!("semaphore {}", self.sem_name(sem)), "dma-wait-without-start", format!("at grid step {:?} a dma_wait finds no copy in flight on this semaphore", self.grid_usize()), "start the copy (dma_start with the same semaphore) before waiting for it; on a TPU this wait would hang")
                    .at(s.loc.clone()));
            };
            if self.dmas[pos].bytes != bytes {
                let p = &self.dmas[pos];
                return Err(self
                    .err(
                        format!("semaphore {}", self.sem_name(sem)),
                        "dma-wait-mismatch",
                        format!("at grid step {:?} the wait describes {bytes} bytes but the oldest copy on this semaphore ({}) moves {}", self.grid_usize(), p.issued, p.bytes),
                        "wait with the same descriptor (source, destination, semaphore) the copy was started with",
                    )
                    .at(s.loc.clone()));
            }
            let p = self.dmas.remove(pos);
            let pl = &self.program.layouts[p.dst.index()];
            let esize = k.ref_decl(p.dst).dtype.bytes();
            let doff: usize = p.origin.iter().zip(&pl.strides).map(|(o, st)| o * st).sum();
            // SAFETY: checked against the destination's view when the copy started; the
            // view's layout does not change within a run.
            unsafe { copy_box(p.data.as_ptr(), &row_major(&p.lens), self.ptrs[p.dst.index()].add(doff * esize), &pl.strides, &p.lens, esize) };
            Ok(())
        }
    }

    fn check_no_pending_dma(&self, end_of_kernel: bool) -> Result<()> {
        let Some(p) = self.dmas.first() else { return Ok(()) };
        let when = if end_of_kernel { "the kernel ends" } else { "the grid step ends" };
        let why = if end_of_kernel { "" } else { " (copies may stay in flight across grid steps only when every grid dim is `arbitrary`)" };
        Err(self.err(
            format!("semaphore {}", self.sem_name(p.sem)),
            "dma-unwaited",
            format!("{when} at grid step {:?} with {} copy(ies) in flight; the first was issued by {} into `{}`{why}", self.grid_usize(), self.dmas.len(), p.issued, self.kernel.refs[p.dst.index()].name),
            "wait for every copy you start (dma_wait with the same descriptor) before its destination is read and before the step ends",
        ))
    }
}

// ---- helpers called from compiled code ---------------------------------------------------

/// # Safety
/// `rt` is the [`ThreadRt`] of the running step.
pub unsafe extern "C" fn helper_fail_slice(rt: *mut c_void, site: u32, start: i32) -> i32 {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let rt = unsafe { &mut *(rt as *mut ThreadRt) };
    rt.fail_slice(site as usize, start);
    1
}

/// # Safety
/// `rt` is the [`ThreadRt`] of the running step; `args` holds the site's argument count.
pub unsafe extern "C" fn helper_dma(rt: *mut c_void, site: u32, args: *const i32) -> i32 {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let rt = unsafe { &mut *(rt as *mut ThreadRt) };
    let Some(s) = rt.program.sites.dmas.get(site as usize) else { return 1 };
    let n = 1 + s.src_lens.len() + s.dst_lens.len();
    // SAFETY: compiled code stores exactly `n` i32 arguments for this site.
    let args = unsafe { std::slice::from_raw_parts(args, n) };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.dma(site as usize, args)));
    match r {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            rt.error = Some(e);
            1
        }
        Err(_) => {
            rt.error = Some(KernelError::new(&rt.kernel.name, "dma", "jit-internal", "the DMA simulation panicked", "report this bug"));
            1
        }
    }
}

/// `c[m, n] (+)= a[m, k] b[k, n]` in f32 with element strides ([`super::gemm::sgemm`]).
///
/// # Safety
/// The operands hold the boxes their strides describe; `c` does not overlap them.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn helper_dot_f32(rt: *mut c_void, m: i64, k: i64, n: i64, a: *const f32, rsa: i64, csa: i64, b: *const f32, rsb: i64, csb: i64, c: *mut f32, rsc: i64, acc: i32) {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let threads = unsafe { (*(rt as *mut ThreadRt)).gemm_threads };
    let (am, bm) = (super::gemm::Mat { p: a, rs: rsa as isize, cs: csa as isize }, super::gemm::Mat { p: b, rs: rsb as isize, cs: csb as isize });
    // SAFETY: the strides describe boxes inside the operands (caller).
    unsafe { super::gemm::sgemm(m as usize, n as usize, k as usize, am, bm, c, rsc as usize, acc != 0, threads) };
}

/// [`helper_dot_f32`] for bf16 operands read straight from bf16 memory.
///
/// # Safety
/// As [`helper_dot_f32`].
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn helper_dot_bf16(rt: *mut c_void, m: i64, k: i64, n: i64, a: *const bf16, rsa: i64, csa: i64, b: *const bf16, rsb: i64, csb: i64, c: *mut f32, rsc: i64, acc: i32) {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let threads = unsafe { (*(rt as *mut ThreadRt)).gemm_threads };
    let (am, bm) = (super::gemm::Mat { p: a, rs: rsa as isize, cs: csa as isize }, super::gemm::Mat { p: b, rs: rsb as isize, cs: csb as isize });
    // SAFETY: the strides describe boxes inside the operands (caller).
    unsafe { super::gemm::bgemm(m as usize, n as usize, k as usize, am, bm, c, rsc as usize, acc != 0, threads) };
}

/// [`helper_dot_bf16`] in exact mode: the operands widened to f32, then the interpreter's dot.
///
/// # Safety
/// As [`helper_dot_f32`].
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn helper_dot_bf16_exact(rt: *mut c_void, m: i64, k: i64, n: i64, a: *const bf16, rsa: i64, csa: i64, b: *const bf16, rsb: i64, csb: i64, c: *mut f32, rsc: i64, acc: i32) {
    let (mu, ku, nu) = (m as usize, k as usize, n as usize);
    let mut af = vec![0f32; mu * ku];
    let mut bfv = vec![0f32; ku * nu];
    for i in 0..mu {
        for p in 0..ku {
            // SAFETY: inside the operand box.
            af[i * ku + p] = unsafe { *a.offset(i as isize * rsa as isize + p as isize * csa as isize) }.to_f32();
        }
    }
    for p in 0..ku {
        for j in 0..nu {
            // SAFETY: inside the operand box.
            bfv[p * nu + j] = unsafe { *b.offset(p as isize * rsb as isize + j as isize * csb as isize) }.to_f32();
        }
    }
    // SAFETY: contiguous copies of the operands.
    unsafe { helper_dot_f32_exact(rt, m, k, n, af.as_ptr(), k, 1, bfv.as_ptr(), n, 1, c, rsc, acc) };
}

/// The interpreter's dot (`matrixmultiply::sgemm` over contiguous copies), for exact mode.
///
/// # Safety
/// As [`helper_dot_f32`].
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn helper_dot_f32_exact(_rt: *mut c_void, m: i64, k: i64, n: i64, a: *const f32, rsa: i64, csa: i64, b: *const f32, rsb: i64, csb: i64, c: *mut f32, rsc: i64, _acc: i32) {
    let (m, k, n) = (m as usize, k as usize, n as usize);
    if m == 0 || n == 0 {
        return;
    }
    for i in 0..m {
        for j in 0..n {
            // SAFETY: inside the output box.
            unsafe { *c.add(i * rsc as usize + j) = 0.0 };
        }
    }
    if k == 0 {
        return;
    }
    // SAFETY: as the interpreter's call; the strides describe the operands (caller).
    unsafe { matrixmultiply::sgemm(m, k, n, 1.0, a, rsa as isize, csa as isize, b, rsb as isize, csb as isize, 0.0, c, rsc as isize, 1) };
}

/// `c[m, n] = a[m, k] b[k, n]` in wrapping i32 (the interpreter's loop order).
///
/// # Safety
/// As [`helper_dot_f32`].
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn helper_dot_i32(_rt: *mut c_void, m: i64, k: i64, n: i64, a: *const i32, rsa: i64, csa: i64, b: *const i32, rsb: i64, csb: i64, c: *mut i32, rsc: i64, _acc: i32) {
    let (m, k, n) = (m as usize, k as usize, n as usize);
    let (rsa, csa, rsb, csb, rsc) = (rsa as usize, csa as usize, rsb as usize, csb as usize, rsc as usize);
    for i in 0..m {
        for j in 0..n {
            // SAFETY: inside the output box.
            unsafe { *c.add(i * rsc + j) = 0 };
        }
        for p in 0..k {
            // SAFETY: inside the operand boxes.
            let x = unsafe { *a.add(i * rsa + p * csa) };
            for j in 0..n {
                // SAFETY: inside the operand and output boxes.
                unsafe {
                    let y = *b.add(p * rsb + j * csb);
                    let cj = c.add(i * rsc + j);
                    *cj = (*cj).wrapping_add(x.wrapping_mul(y));
                }
            }
        }
    }
}

/// The inclusive prefix sum of a slot (`outer x n x inner` words, scanned along `n`) into
/// another, as the interpreter: f32 adds in index order (`kind` 0), bf16 the same with each
/// output rounded to bf16 (1), i32 wrapping (2).
///
/// # Safety
/// `src` and `dst` each hold `outer * n * inner` 4-byte words.
pub unsafe extern "C" fn helper_cumsum(src: *const u8, dst: *mut u8, outer: i64, n: i64, inner: i64, kind: i32) {
    let (outer, n, inner) = (outer as usize, n as usize, inner as usize);
    for o in 0..outer {
        for i in 0..inner {
            let (mut f, mut x) = (0.0f32, 0i32);
            for j in 0..n {
                let at = (o * n + j) * inner + i;
                // SAFETY: `at` < outer * n * inner, inside both slots.
                unsafe {
                    if kind == 2 {
                        x = x.wrapping_add(*(src as *const i32).add(at));
                        *(dst as *mut i32).add(at) = x;
                    } else {
                        f += *(src as *const f32).add(at);
                        *(dst as *mut f32).add(at) = if kind == 1 { bf16::from_f32(f).to_f32() } else { f };
                    }
                }
            }
        }
    }
}

/// `prng_seed(seeds[..n])` for the running grid step.
///
/// # Safety
/// `rt` is the [`ThreadRt`] of the running step; `seeds` holds `n` i32 values.
pub unsafe extern "C" fn helper_prng_seed(rt: *mut c_void, seeds: *const i32, n: i64) {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let rt = unsafe { &mut *(rt as *mut ThreadRt) };
    // SAFETY: compiled code stores `n` seeds.
    let seeds = unsafe { std::slice::from_raw_parts(seeds, n as usize) };
    rt.prng = Some(tessera_dsl::interp::Prng::seeded(seeds));
}

/// Draws `n` random words into `dst` (a slot); 1 with the error recorded when the step has
/// not seeded the generator (`inst` names the instruction, for its location).
///
/// # Safety
/// `rt` is the [`ThreadRt`] of the running step; `dst` holds `n` i32 words.
pub unsafe extern "C" fn helper_prng_bits(rt: *mut c_void, inst: u32, dst: *mut i32, n: i64) -> i32 {
    // SAFETY: compiled code passes back the `rt` field of its `StepCtx`.
    let rt = unsafe { &mut *(rt as *mut ThreadRt) };
    let Some(prng) = rt.prng.as_mut() else {
        let loc = rt.kernel.insts.get(inst as usize).and_then(|d| d.loc.clone());
        let e = rt
            .err(
                "instruction `prng_random_bits`",
                "prng-unseeded",
                format!("at grid step {:?} random bits are drawn before any prng_seed in this grid step", rt.grid_usize()),
                "seed the generator at the start of every grid step, e.g. prng_seed(seed, program_id(0)); each step starts unseeded (steps may run on different cores)",
            )
            .at(loc);
        rt.error = Some(e);
        return 1;
    };
    let bits = prng.draw(n as usize);
    // SAFETY: `dst` holds `n` words.
    unsafe { std::ptr::copy_nonoverlapping(bits.as_ptr(), dst, bits.len()) };
    0
}

pub extern "C" fn helper_fmod(x: f32, y: f32) -> f32 {
    x % y
}

pub extern "C" fn helper_pow(x: f32, y: f32) -> f32 {
    (x as f64).powf(y as f64) as f32
}

/// i32 -> bf16 rounded once from the exact value (as f32 storage).
pub extern "C" fn helper_i32_to_bf16(x: i32) -> f32 {
    bf16::from_f64(x as f64).to_f32()
}

pub extern "C" fn helper_exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}
pub extern "C" fn helper_log(x: f32) -> f32 {
    (x as f64).ln() as f32
}
pub extern "C" fn helper_tanh(x: f32) -> f32 {
    (x as f64).tanh() as f32
}
pub extern "C" fn helper_erf(x: f32) -> f32 {
    libm::erf(x as f64) as f32
}
pub extern "C" fn helper_log1p(x: f32) -> f32 {
    (x as f64).ln_1p() as f32
}
pub extern "C" fn helper_expm1(x: f32) -> f32 {
    (x as f64).exp_m1() as f32
}
pub extern "C" fn helper_sin(x: f32) -> f32 {
    (x as f64).sin() as f32
}
pub extern "C" fn helper_cos(x: f32) -> f32 {
    (x as f64).cos() as f32
}
