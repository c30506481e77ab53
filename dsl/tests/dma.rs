//! Async copies and DMA semaphores: builder checks, verifier rules, and the interpreter's
//! simulation (a missing or wrong wait must fail, not pass by luck).

use tessera_dsl::interp::{self, Array};
use tessera_dsl::verify::verify;
use tessera_dsl::*;

const ROWS: usize = 8;
const D: usize = 128;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Variant {
    /// Double-buffered gather, every copy waited for.
    Correct,
    /// The wait for the current page is missing.
    NoWait,
    /// The prefetch of the next page fetches the page after it.
    WrongPage,
    /// Waits on the other slot's semaphore.
    WrongSemaphore,
}

/// `o[s] = sum_j x[idx[s * n + j]]`: each grid step gathers `n` pages of an HBM array
/// through a two-slot VMEM buffer, starting page j+1's copy before summing page j.
fn gather(pages: usize, steps: usize, n: usize, semantics: Semantics, v: Variant) -> Kernel {
    let mut b = KernelBuilder::new("gather_pages");
    b.grid(&[(steps, semantics)]);
    let idx = b.prefetch("idx", &[steps * n]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[pages, ROWS, D], MemorySpace::Any);
    let o = b.output("o", DType::F32, &[steps, ROWS, D], BlockSpec { block_shape: vec![None, Some(ROWS), Some(D)], index_map: vec![IndexExpr::grid(0), 0.into(), 0.into()] });
    let buf = b.scratch("buf", DType::F32, &[2, ROWS, D], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 2);
    let page = |b: &mut KernelBuilder, j: Value| {
        let i = b.program_id(0);
        let base = b.mul(i, n as i64);
        let at = b.add(base, j);
        b.load(idx, &[ds(at, 1)])
    };
    let zero = b.i32(0);
    let p0 = page(&mut b, zero);
    b.dma_start(x, &[ds(p0, 1)], buf, &[ds(0, 1)], sem, 0);
    let acc0 = b.zeros(&[ROWS, D], DType::F32);
    let acc = b.for_range(0, n as i64, 1, &[acc0], |b, j, c| {
        let slot = b.binary(BinaryOp::Rem, j, 2);
        let other = b.sub(1, slot);
        let next = b.add(j, 1);
        let more = b.cmp(CmpOp::Lt, next, n as i64);
        b.when(more, |b| {
            let fetch = if v == Variant::WrongPage { b.add(next, 1) } else { next };
            let fetch = b.min(fetch, (n - 1) as i64);
            let p = page(b, fetch);
            b.dma_start(x, &[ds(p, 1)], buf, &[ds(other, 1)], sem, other);
        });
        let p = page(b, j);
        let wait_sem = if v == Variant::WrongSemaphore { other } else { slot };
        if v != Variant::NoWait {
            b.dma_wait(x, &[ds(p, 1)], buf, &[ds(slot, 1)], sem, wait_sem);
        }
        let tile = b.load(buf, &[ds(slot, 1), Index::Full, Index::Full]);
        let tile = b.reshape(tile, &[ROWS, D]);
        vec![b.add(c[0], tile)]
    });
    b.store(o, &[], acc[0]);
    b.finish().unwrap()
}

fn inputs(pages: usize, steps: usize, n: usize) -> (Array, Array) {
    let idx: Vec<i32> = (0..steps * n).map(|k| ((k * 7 + 3) % pages) as i32).collect();
    let x: Vec<f32> = (0..pages * ROWS * D).map(|e| ((e * 31 % 97) as f32) / 97.0 - 0.5).collect();
    (Array::from_i32(&[steps * n], idx), Array::from_f32(&[pages, ROWS, D], x))
}

fn expected(idx: &Array, x: &Array, steps: usize, n: usize) -> Vec<f64> {
    let (idx, x) = (idx.as_i32().unwrap(), x.to_f64_vec());
    let mut out = vec![0.0; steps * ROWS * D];
    for s in 0..steps {
        for j in 0..n {
            let p = idx[s * n + j] as usize;
            for e in 0..ROWS * D {
                out[s * ROWS * D + e] += x[p * ROWS * D + e];
            }
        }
    }
    out
}

fn run(k: &Kernel, idx: &Array, x: &Array) -> Result<Vec<Array>> {
    verify(k, &Target::V5E)?;
    interp::run(k, &[idx, x])
}

#[test]
fn double_buffered_gather_matches() {
    for (pages, steps, n) in [(5, 3, 4), (3, 2, 1), (9, 1, 7)] {
        for sem in [Semantics::Parallel, Semantics::Arbitrary] {
            let k = gather(pages, steps, n, sem, Variant::Correct);
            let (idx, x) = inputs(pages, steps, n);
            let out = run(&k, &idx, &x).unwrap_or_else(|e| panic!("{e}"));
            let want = expected(&idx, &x, steps, n);
            for (g, w) in out[0].to_f64_vec().iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "{pages} {steps} {n}: got {g}, want {w}");
            }
        }
    }
}

#[test]
fn printed_ir_shows_the_copies() {
    let text = format!("{}", gather(5, 3, 4, Semantics::Parallel, Variant::Correct));
    assert!(text.contains("@4 sem: scratch i32[2] semaphore_mem"), "{text}");
    assert!(text.contains("dma_start @1["), "{text}");
    assert!(text.contains("dma_wait @1["), "{text}");
}

#[test]
fn a_missing_wait_fails_loudly() {
    let (idx, x) = inputs(5, 3, 4);
    // Parallel grid: the unwaited copy is reported at the end of the first step.
    let e = run(&gather(5, 3, 4, Semantics::Parallel, Variant::NoWait), &idx, &x).unwrap_err();
    assert_eq!(e.rule, "dma-unwaited", "{e}");
    assert!(e.subject.contains("sem[") && e.message.contains("issued by dma_start into `buf`"), "{e}");
    // Sequential grid: copies may cross steps, but not the end of the kernel.
    let e = run(&gather(5, 3, 4, Semantics::Arbitrary, Variant::NoWait), &idx, &x).unwrap_err();
    assert_eq!(e.rule, "dma-unwaited", "{e}");
    assert!(e.message.contains("the kernel ends"), "{e}");
}

#[test]
fn reading_a_destination_in_flight_reads_poison() {
    // Start a copy, read the destination, then wait: the read sees NaN.
    let mut b = KernelBuilder::new("early_read");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[ROWS, D], MemorySpace::Any);
    let o = b.output("o", DType::F32, &[ROWS, D], BlockSpec { block_shape: vec![Some(ROWS), Some(D)], index_map: vec![0.into(), 0.into()] });
    let buf = b.scratch("buf", DType::F32, &[ROWS, D], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 1);
    let z = b.zeros(&[ROWS, D], DType::F32);
    b.store(buf, &[], z);
    b.dma_start(x, &[], buf, &[], sem, 0);
    let early = b.load(buf, &[]);
    b.dma_wait(x, &[], buf, &[], sem, 0);
    b.store(o, &[], early);
    let k = b.finish().unwrap();
    let xs = Array::from_f32(&[ROWS, D], vec![1.0; ROWS * D]);
    let out = interp::run(&k, &[&xs]).unwrap();
    assert!(out[0].to_f32_vec().iter().all(|v| v.is_nan()));
}

#[test]
fn a_wrong_page_changes_the_result() {
    let (idx, x) = inputs(5, 3, 4);
    let out = run(&gather(5, 3, 4, Semantics::Parallel, Variant::WrongPage), &idx, &x).unwrap();
    let want = expected(&idx, &x, 3, 4);
    assert!(out[0].to_f64_vec().iter().zip(&want).any(|(g, w)| (g - w).abs() > 1e-3));
}

#[test]
fn waiting_on_the_wrong_semaphore_fails() {
    // The waits balance the semaphores (as they would on a TPU), but each one completes
    // the other slot's copy, so the page being summed is still in flight: NaN.
    let (idx, x) = inputs(5, 3, 4);
    let out = run(&gather(5, 3, 4, Semantics::Parallel, Variant::WrongSemaphore), &idx, &x).unwrap();
    assert!(out[0].to_f32_vec().iter().all(|v| v.is_nan()));
    // With one page per step the wait finds nothing on the other semaphore.
    let (idx, x) = inputs(3, 2, 1);
    let e = run(&gather(3, 2, 1, Semantics::Parallel, Variant::WrongSemaphore), &idx, &x).unwrap_err();
    assert_eq!(e.rule, "dma-wait-without-start", "{e}");
    assert!(e.subject.contains("sem[1]"), "{e}");
}

/// A kernel with one copy `x[src] -> buf[dst]`, built by `f`.
fn one_copy(f: impl FnOnce(&mut KernelBuilder, RefId, RefId, RefId)) -> Result<Kernel> {
    let mut b = KernelBuilder::new("one_copy");
    b.grid(&[(1, Semantics::Parallel)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[4, ROWS, D], MemorySpace::Any);
    let _o = b.output("o", DType::F32, &[ROWS, D], BlockSpec { block_shape: vec![Some(ROWS), Some(D)], index_map: vec![0.into(), 0.into()] });
    let buf = b.scratch("buf", DType::F32, &[2, ROWS, D], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 2);
    f(&mut b, x, buf, sem);
    b.finish()
}

#[test]
fn builder_rejects_bad_descriptors() {
    let e = one_copy(|b, x, buf, sem| b.dma_start(x, &[ds(0, 2)], buf, &[ds(0, 1)], sem, 0)).unwrap_err();
    assert_eq!(e.rule, "dma-shape", "{e}");
    let e = one_copy(|b, x, buf, sem| b.dma_start(x, &[ds(3, 2)], buf, &[], sem, 0)).unwrap_err();
    assert_eq!(e.rule, "static-out-of-bounds", "{e}");
    let e = one_copy(|b, x, buf, sem| b.dma_start(x, &[ds(0, 1)], buf, &[ds(0, 1)], sem, 2)).unwrap_err();
    assert_eq!(e.rule, "static-out-of-bounds", "{e}");
    let e = one_copy(|b, x, buf, _| b.dma_start(x, &[ds(0, 1)], buf, &[ds(0, 1)], buf, 0)).unwrap_err();
    assert_eq!(e.rule, "dma-semaphore", "{e}");
    let e = one_copy(|b, x, buf, sem| b.dma_start(buf, &[ds(0, 1)], x, &[ds(0, 1)], sem, 0)).unwrap_err();
    assert_eq!(e.rule, "dma-destination", "{e}");
    let e = one_copy(|b, _, _, sem| {
        b.load(sem, &[]);
    })
    .unwrap_err();
    assert_eq!(e.rule, "semaphore-access", "{e}");
    let e = one_copy(|b, x, _, sem| {
        let ib = b.scratch("ib", DType::I32, &[ROWS, D], MemorySpace::Vmem);
        b.dma_start(x, &[ds(0, 1)], ib, &[], sem, 0)
    })
    .unwrap_err();
    assert_eq!(e.rule, "dma-dtype", "{e}");
    // Leading 1s do not matter: x[p] is [1, 8, 128], a [8, 128] buffer slot is fine too.
    one_copy(|b, x, buf, sem| {
        b.dma_start(x, &[ds(1, 1)], buf, &[ds(1, 1)], sem, 1);
        b.dma_wait(x, &[ds(1, 1)], buf, &[ds(1, 1)], sem, 1);
    })
    .unwrap();
}

#[test]
fn verifier_rejects_hbm_loads_and_out_of_bounds_copies() {
    let mut k = one_copy(|b, x, buf, sem| {
        b.dma_start(x, &[ds(0, 1)], buf, &[ds(0, 1)], sem, 0);
        b.dma_wait(x, &[ds(0, 1)], buf, &[ds(0, 1)], sem, 0);
    })
    .unwrap();
    verify(&k, &Target::V5E).unwrap();
    // Hand-edit the IR: a copy reaching past the end of the array.
    for d in &mut k.insts {
        if let Inst::DmaStart { src, .. } = &mut d.inst {
            src.slices[0].len = 5;
        }
    }
    let e = verify(&k, &Target::V5E).unwrap_err();
    assert!(e.rule == "dma-out-of-bounds" || e.rule == "dma-shape", "{e}");

    let e = one_copy(|b, x, _, _| {
        b.load(x, &[]);
    })
    .unwrap_err();
    assert_eq!(e.rule, "hbm-direct-access", "{e}");
}

#[test]
fn dynamic_out_of_bounds_copy_is_caught_at_run_time() {
    let k = one_copy(|b, x, buf, sem| {
        let p = b.program_id(0);
        let p = b.add(p, 4);
        b.dma_start(x, &[ds(p, 1)], buf, &[ds(0, 1)], sem, 0);
        b.dma_wait(x, &[ds(p, 1)], buf, &[ds(0, 1)], sem, 0);
    })
    .unwrap();
    let xs = Array::from_f32(&[4, ROWS, D], vec![0.0; 4 * ROWS * D]);
    let e = interp::run(&k, &[&xs]).unwrap_err();
    assert_eq!(e.rule, "slice-out-of-bounds", "{e}");
    assert!(e.subject.contains("DMA source"), "{e}");
}

#[test]
fn a_wait_for_a_different_size_is_a_mismatch() {
    let k = one_copy(|b, x, buf, sem| {
        b.dma_start(x, &[ds(0, 1)], buf, &[ds(0, 1)], sem, 0);
        b.dma_wait(x, &[ds(0, 1), ds(0, 4)], buf, &[ds(0, 1), ds(0, 4)], sem, 0);
    })
    .unwrap();
    let xs = Array::from_f32(&[4, ROWS, D], vec![0.0; 4 * ROWS * D]);
    let e = interp::run(&k, &[&xs]).unwrap_err();
    assert_eq!(e.rule, "dma-wait-mismatch", "{e}");
}
