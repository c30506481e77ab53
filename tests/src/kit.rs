//! Small kernels with one knob each, shared by the rulebook's evidence pairs and the probe
//! sweeps: every one is a realistic kernel shape (a copy, a matmul, a sliced load, a DMA)
//! whose single parameter walks across one TPU rule's edge.

use tessera_dsl::{IndexExpr as I, *};

pub type Built = Result<Kernel, KernelError>;

pub fn spec(block: &[usize], map: Vec<I>) -> BlockSpec {
    BlockSpec { block_shape: block.iter().map(|&d| Some(d)).collect(), index_map: map }
}

/// A block index map that walks every dim with its own grid dim.
fn walk(rank: usize) -> Vec<I> {
    (0..rank).map(I::Grid).collect()
}

/// `out = x` over `shape` in `block`s, one grid dim per array dim (the last block may
/// reach past the array's end). The simplest kernel a block rule can break.
pub fn copy(name: &str, dtype: DType, shape: &[usize], block: &[usize]) -> Built {
    let mut b = KernelBuilder::new(name);
    let grid: Vec<(usize, Semantics)> = shape.iter().zip(block).map(|(&s, &k)| (s.div_ceil(k.max(1)), Semantics::Parallel)).collect();
    b.grid(&grid);
    let x = b.input("x", dtype, shape, spec(block, walk(shape.len())));
    let o = b.output("out", dtype, shape, spec(block, walk(shape.len())));
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    b.finish()
}

/// [`copy`] over a grid of `extents` (each block index clamped to block 0 so any grid is
/// in bounds), for grid-bound rules.
pub fn copy_on_grid(name: &str, extents: &[usize]) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&extents.iter().map(|&e| (e, Semantics::Arbitrary)).collect::<Vec<_>>());
    let map = vec![I::Const(0), I::Const(0)];
    let x = b.input("x", DType::F32, &[8, 128], spec(&[8, 128], map.clone()));
    let o = b.output("out", DType::F32, &[8, 128], spec(&[8, 128], map));
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    b.finish()
}

/// `out = a (op) b` (or `op(a)`, a reduction along `axis`...) on one `[rows, lanes]` block:
/// the op x dtype probes.
pub fn elementwise(name: &str, dtype: DType, rows: usize, lanes: usize, body: impl FnOnce(&mut KernelBuilder, Value, Value) -> Value) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(1, Semantics::Parallel)]);
    let zero = vec![I::Const(0), I::Const(0)];
    let x = b.input("x", dtype, &[rows, lanes], spec(&[rows, lanes], zero.clone()));
    let y = b.input("y", dtype, &[rows, lanes], spec(&[rows, lanes], zero.clone()));
    let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
    let r = body(&mut b, xv, yv);
    let t = b.ty(r).clone();
    let o = b.output("out", t.dtype, &t.shape, spec(&t.shape, vec![I::Const(0); t.rank()]));
    b.store(o, &[], r);
    b.finish()
}

/// A tiled `[m, k] x [k, n]` matmul with an f32 (i32) VMEM accumulator, as the library
/// writes it; `vmem_limit` sets the scoped limit.
pub fn matmul(name: &str, dtype: DType, mkn: [usize; 3], blocks: [usize; 3], vmem_limit: Option<usize>) -> Built {
    let [m, k, n] = mkn;
    let [bm, bk, bn] = blocks;
    let mut b = KernelBuilder::new(name);
    b.grid(&[(m / bm, Semantics::Parallel), (n / bn, Semantics::Parallel), (k / bk, Semantics::Arbitrary)]);
    if let Some(l) = vmem_limit {
        b.vmem_limit_bytes(l);
    }
    let x = b.input("x", dtype, &[m, k], spec(&[bm, bk], vec![I::Grid(0), I::Grid(2)]));
    let y = b.input("y", dtype, &[k, n], spec(&[bk, bn], vec![I::Grid(2), I::Grid(1)]));
    let acc_t = if dtype.is_float() { DType::F32 } else { DType::I32 };
    let o = b.output("out", acc_t, &[m, n], spec(&[bm, bn], vec![I::Grid(0), I::Grid(1)]));
    let acc = b.scratch("acc", acc_t, &[bm, bn], MemorySpace::Vmem);
    let first = b.program_id(2);
    let first = b.cmp(CmpOp::Eq, first, 0);
    b.when(first, |b| {
        let z = b.zeros(&[bm, bn], acc_t);
        b.store(acc, &[], z);
    });
    let (xv, yv, av) = (b.load(x, &[]), b.load(y, &[]), b.load(acc, &[]));
    let p = b.dot(xv, yv, false, false);
    let s = b.add(av, p);
    b.store(acc, &[], s);
    let kk = b.program_id(2);
    let last = b.cmp(CmpOp::Eq, kk, (k / bk - 1) as i64);
    b.when(last, |b| {
        let a = b.load(acc, &[]);
        b.store(o, &[], a);
    });
    b.finish()
}

/// Where a slice starts: a constant, `pid * mul + add` (`pid` = `program_id(0)`), or a
/// loop induction variable `lo, lo + step, ...` (two iterations).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Start {
    Static(i64),
    Pid { mul: i64, add: i64 },
    Loop { lo: i64, step: i64 },
}

impl Start {
    pub fn label(self) -> String {
        match self {
            Start::Static(c) => format!("static{c}"),
            Start::Pid { mul, add: 0 } => format!("pid*{mul}"),
            Start::Pid { mul, add } => format!("pid*{mul}+{add}"),
            Start::Loop { lo, step } => format!("loop{lo}by{step}"),
        }
    }

    /// The start value inside the body (`iv` is the loop variable when there is one).
    fn value(self, b: &mut KernelBuilder, iv: Option<Value>) -> Arg {
        match self {
            Start::Static(c) => Arg::Int(c),
            Start::Pid { mul, add } => {
                let p = b.program_id(0);
                let m = b.mul(p, mul);
                Arg::Val(if add == 0 { m } else { b.add(m, add) })
            }
            Start::Loop { .. } => Arg::Val(iv.expect("loop start inside the loop")),
        }
    }

    /// The largest start over a grid of 2 steps (or 2 loop iterations).
    pub fn max(self) -> i64 {
        match self {
            Start::Static(c) => c,
            Start::Pid { mul, add } => mul + add,
            Start::Loop { lo, step } => lo + step,
        }
    }
}

/// Runs `f` once, inside a two-iteration loop if either start is a loop variable.
fn maybe_loop(b: &mut KernelBuilder, starts: [Start; 2], f: impl FnOnce(&mut KernelBuilder, Option<Value>)) {
    match starts.iter().find_map(|s| if let Start::Loop { lo, step } = *s { Some((lo, step)) } else { None }) {
        Some((lo, step)) => {
            b.for_range(lo, lo + 2 * step, step, &[], |b, iv, _| {
                f(b, Some(iv));
                vec![]
            });
        }
        None => f(b, None),
    }
}

/// `out[...] = x[ds(row_start, rows), ds(lane_start, lanes)]` from a whole `[src_rows,
/// src_lanes]` VMEM block, over a grid of 2: the vector-load alignment probes.
pub fn sliced_load(name: &str, dtype: DType, src: [usize; 2], rows: (Start, usize), lanes: (Start, usize)) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Arbitrary)]);
    let x = b.input("x", dtype, &src, spec(&src, vec![I::Const(0), I::Const(0)]));
    let o = b.output("out", dtype, &[rows.1, lanes.1], spec(&[rows.1, lanes.1], vec![I::Const(0), I::Const(0)]));
    maybe_loop(&mut b, [rows.0, lanes.0], |b, iv| {
        let (r, l) = (rows.0.value(b, iv), lanes.0.value(b, iv));
        let v = b.load(x, &[ds(r, rows.1), ds(l, lanes.1)]);
        b.store(o, &[], v);
    });
    b.finish()
}

/// `out[ds(row_start, rows), ds(lane_start, lanes)] = x` into a whole `[dst_rows,
/// dst_lanes]` output block: the vector-store alignment probes.
pub fn sliced_store(name: &str, dtype: DType, dst: [usize; 2], rows: (Start, usize), lanes: (Start, usize)) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Arbitrary)]);
    let x = b.input("x", dtype, &[rows.1, lanes.1], spec(&[rows.1, lanes.1], vec![I::Const(0), I::Const(0)]));
    let o = b.output("out", dtype, &dst, spec(&dst, vec![I::Const(0), I::Const(0)]));
    maybe_loop(&mut b, [rows.0, lanes.0], |b, iv| {
        let v = b.load(x, &[]);
        let (r, l) = (rows.0.value(b, iv), lanes.0.value(b, iv));
        b.store(o, &[ds(r, rows.1), ds(l, lanes.1)], v);
    });
    b.finish()
}

/// Copies `x[ds(row_start, rows), ds(lane_start, lanes)]` of an HBM (ANY) `src` array into
/// a VMEM scratch by DMA, then to the output: the DMA slice alignment probes.
pub fn dma_slice(name: &str, dtype: DType, src: [usize; 2], rows: (Start, usize), lanes: (Start, usize)) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", dtype, &src, MemorySpace::Any);
    let o = b.output("out", dtype, &[rows.1, lanes.1], spec(&[rows.1, lanes.1], vec![I::Const(0), I::Const(0)]));
    let buf = b.scratch("buf", dtype, &[rows.1, lanes.1], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 1);
    maybe_loop(&mut b, [rows.0, lanes.0], |b, iv| {
        let (r, l) = (rows.0.value(b, iv), lanes.0.value(b, iv));
        let at = [ds(r, rows.1), ds(l, lanes.1)];
        b.dma_start(x, &at, buf, &[], sem, 0);
        b.dma_wait(x, &at, buf, &[], sem, 0);
        let v = b.load(buf, &[]);
        b.store(o, &[], v);
    });
    b.finish()
}

/// A gather through SMEM: `out = x[table[pid]]` rows, with a scalar-prefetch `table` of
/// `table_len` i32 and an SMEM scratch of `scratch_len` i32: the SMEM budget probes.
pub fn smem_fill(name: &str, table_len: usize, scratch_len: usize) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(8, Semantics::Arbitrary)]);
    let table = b.prefetch("table", &[table_len]);
    let map = vec![I::Prefetch { array: table, index: vec![I::Grid(0)] }, I::Const(0)];
    let x = b.input("x", DType::F32, &[64, 128], spec(&[8, 128], map));
    let o = b.output("out", DType::F32, &[64, 128], spec(&[8, 128], vec![I::Grid(0), I::Const(0)]));
    let v = b.load(x, &[]);
    if scratch_len > 0 {
        let s = b.scratch("counts", DType::I32, &[scratch_len], MemorySpace::Smem);
        let p = b.program_id(0);
        b.store(s, &[ds(p, 1)], p);
    }
    b.store(o, &[], v);
    b.finish()
}

/// `out = x[ds(start, len)]` from a whole rank-1 VMEM block of `n`: rank-1 alignment.
pub fn sliced_load_1d(name: &str, dtype: DType, n: usize, start: Start, len: usize) -> Built {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Arbitrary)]);
    let x = b.input("x", dtype, &[n], spec(&[n], vec![I::Const(0)]));
    let o = b.output("out", dtype, &[len], spec(&[len], vec![I::Const(0)]));
    maybe_loop(&mut b, [start, Start::Static(0)], |b, iv| {
        let s = start.value(b, iv);
        let v = b.load(x, &[ds(s, len)]);
        b.store(o, &[], v);
    });
    b.finish()
}
