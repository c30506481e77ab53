//! The catalogue of deliberately broken kernels shared by the verifier tests and the
//! libtpu tests. Each is small, realistic, and breaks exactly one rule.

use tessera_dsl::{IndexExpr as I, *};

pub struct Broken {
    pub name: &'static str,
    /// The rule our verifier must report.
    pub rule: &'static str,
    /// Text the message must contain to point at the culprit (an operand, `VMEM`...).
    pub subject: &'static str,
    /// More text the message must contain.
    pub mentions: &'static [&'static str],
    pub target: Target,
    /// Whether libtpu is expected to reject it too when forced through (None: libtpu
    /// cannot judge it, e.g. a wrong index map that still compiles).
    pub libtpu_rejects: Option<bool>,
    pub kernel: Result<Kernel, KernelError>,
}

fn spec(block: &[usize], map: Vec<I>) -> BlockSpec {
    BlockSpec { block_shape: block.iter().map(|&d| Some(d)).collect(), index_map: map }
}

/// `out = x + 1` over a 1-D grid of row blocks (the skeleton most cases bend).
fn rowwise(name: &str, shape: &[usize], block: &[usize], map: Vec<I>, grid: usize) -> Result<Kernel, KernelError> {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(grid, Semantics::Parallel)]);
    let x = b.input("x", DType::F32, shape, spec(block, map.clone()));
    let o = b.output("out", DType::F32, shape, spec(block, map));
    let v = b.load(x, &[]);
    let v = b.add(v, 1.0);
    b.store(o, &[], v);
    b.finish()
}

/// A tiled matmul with explicit blocks, semantics and dtype.
fn matmul(name: &str, dtype: DType, mkn: [usize; 3], blocks: [usize; 3], sem: [Semantics; 3], vmem_limit: Option<usize>) -> Result<Kernel, KernelError> {
    let [m, k, n] = mkn;
    let [bm, bk, bn] = blocks;
    let mut b = KernelBuilder::new(name);
    b.grid(&[(m / bm, sem[0]), (n / bn, sem[1]), (k / bk, sem[2])]);
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

use Semantics::{Arbitrary as A, Parallel as P};

pub fn all() -> Vec<Broken> {
    let v5e = Target::V5E;
    vec![
        Broken {
            name: "bad_sublane_tiling",
            rule: "block-tiling",
            subject: "input `x`",
            mentions: &["100", "multiple of 8"],
            target: v5e,
            libtpu_rejects: Some(true),
            kernel: rowwise("bad_sublane_tiling", &[1000, 128], &[100, 128], vec![I::Grid(0), I::Const(0)], 10),
        },
        Broken {
            name: "bad_lane_tiling",
            rule: "block-tiling",
            subject: "input `x`",
            mentions: &["multiple of 128"],
            target: v5e,
            libtpu_rejects: Some(true),
            kernel: {
                let mut b = KernelBuilder::new("bad_lane_tiling");
                b.grid(&[(10, P)]);
                let x = b.input("x", DType::F32, &[8, 1000], spec(&[8, 100], vec![I::Const(0), I::Grid(0)]));
                let o = b.output("out", DType::F32, &[8, 1000], spec(&[8, 100], vec![I::Const(0), I::Grid(0)]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "vmem_overflow",
            rule: "vmem-budget",
            subject: "VMEM",
            mentions: &["16.00 MiB"],
            target: v5e,
            libtpu_rejects: Some(true),
            kernel: matmul("vmem_overflow", DType::F32, [4096, 4096, 4096], [2048, 2048, 2048], [P, P, A], None),
        },
        Broken {
            name: "vmem_limit_beyond_core",
            rule: "vmem-limit",
            subject: "compiler params",
            mentions: &["128 MiB"],
            target: v5e,
            libtpu_rejects: None,
            kernel: matmul("vmem_limit_beyond_core", DType::F32, [512, 512, 512], [128, 128, 128], [P, P, A], Some(256 << 20)),
        },
        Broken {
            // (int8 x int8 on tpu7x compiles with libtpu 0.0.52: a warning, matmul-emulated.)
            name: "int32_matmul",
            rule: "matmul-dtype",
            subject: "instruction `dot`",
            mentions: &["i32", "tpu7x"],
            target: Target::TPU7X,
            libtpu_rejects: Some(true),
            kernel: matmul("int32_matmul", DType::I32, [512, 512, 512], [256, 256, 256], [P, P, A], None),
        },
        Broken {
            name: "index_map_arity",
            rule: "index-map-arity",
            subject: "input `x`",
            mentions: &["returns 1 block indices", "2 dims"],
            target: v5e,
            libtpu_rejects: Some(true),
            kernel: {
                let mut b = KernelBuilder::new("index_map_arity");
                b.grid(&[(8, P)]);
                let x = b.input("x", DType::F32, &[1024, 128], spec(&[128, 128], vec![I::Grid(0)]));
                let o = b.output("out", DType::F32, &[1024, 128], spec(&[128, 128], vec![I::Grid(0), I::Const(0)]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "grid_overruns_array",
            rule: "index-out-of-bounds",
            subject: "input `x`",
            mentions: &["block index 8", "8 blocks"],
            target: v5e,
            libtpu_rejects: None,
            kernel: rowwise("grid_overruns_array", &[1024, 128], &[128, 128], vec![I::Grid(0), I::Const(0)], 16),
        },
        Broken {
            name: "parallel_reduction_axis",
            rule: "reduction-axis-semantics",
            subject: "output `out`",
            mentions: &["arbitrary"],
            target: v5e,
            libtpu_rejects: None,
            kernel: matmul("parallel_reduction_axis", DType::F32, [512, 512, 512], [128, 128, 128], [P, P, P], None),
        },
        Broken {
            // The pipeline's Pallas trick `|i, p, j| [i, j * p]` left on all-parallel
            // semantics: at p = 0 every j writes block [i, 0] (the new-user trial's log-softmax).
            name: "parallel_revisit_static",
            rule: "parallel-revisit",
            subject: "output `out`",
            mentions: &["grid steps [0, 0, 0] and [0, 0, 1]", "grid dim 2", "mark grid dim 2 `arbitrary`"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("parallel_revisit_static");
                b.grid(&[(4, P), (2, P), (4, P)]);
                let x = b.input("x", DType::F32, &[512, 512], spec(&[128, 128], vec![I::Grid(0), I::Grid(2)]));
                let jp = I::Bin(tessera_dsl::IndexOp::Mul, Box::new(I::Grid(2)), Box::new(I::Grid(1)));
                let o = b.output("out", DType::F32, &[512, 512], spec(&[128, 128], vec![I::Grid(0), jp]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "output_not_covered",
            rule: "output-coverage",
            subject: "output `out`",
            mentions: &["4 of the output's 8 blocks"],
            target: v5e,
            libtpu_rejects: None,
            kernel: rowwise("output_not_covered", &[1024, 128], &[128, 128], vec![I::Grid(0), I::Const(0)], 4),
        },
        Broken {
            name: "reduction_axis_first",
            rule: "reduction-axis-order",
            subject: "output `out`",
            mentions: &["put reduction (arbitrary) axes last"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                // The K axis first: each output block is visited in 4 separate runs.
                let mut b = KernelBuilder::new("reduction_axis_first");
                b.grid(&[(4, A), (4, P)]);
                let x = b.input("x", DType::F32, &[512, 512], spec(&[128, 128], vec![I::Grid(1), I::Grid(0)]));
                let o = b.output("out", DType::F32, &[512, 128], spec(&[128, 128], vec![I::Grid(1), I::Const(0)]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "mixed_dtypes",
            rule: "dtype-mismatch",
            subject: "instruction `add`",
            mentions: &["f32[128,128] and bf16[128,128]", ".cast("],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("mixed_dtypes");
                b.grid(&[(1, P)]);
                let x = b.input("x", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let y = b.input("y", DType::BF16, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let o = b.output("out", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
                let s = b.add(xv, yv);
                b.store(o, &[], s);
                b.finish()
            },
        },
        Broken {
            name: "dot_contraction_mismatch",
            rule: "dot-contraction",
            subject: "instruction `dot`",
            mentions: &["lhs k = 256, rhs k = 128"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("dot_contraction_mismatch");
                b.grid(&[(1, P)]);
                let x = b.input("x", DType::F32, &[128, 256], spec(&[128, 256], vec![I::Const(0), I::Const(0)]));
                let y = b.input("y", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let o = b.output("out", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let (xv, yv) = (b.load(x, &[]), b.load(y, &[]));
                let p = b.dot(xv, yv, false, false);
                b.store(o, &[], p);
                b.finish()
            },
        },
        Broken {
            name: "load_from_hbm",
            rule: "hbm-direct-access",
            subject: "`x`",
            mentions: &["DMA"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("load_from_hbm");
                b.grid(&[(1, P)]);
                let x = b.unblocked(RefKind::Input, "x", DType::F32, &[128, 128], MemorySpace::Any);
                let o = b.output("out", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "static_slice_out_of_block",
            rule: "static-out-of-bounds",
            subject: "input `x`",
            mentions: &["120..136"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("static_slice_out_of_block");
                b.grid(&[(1, P)]);
                let x = b.input("x", DType::F32, &[128, 128], spec(&[128, 128], vec![I::Const(0), I::Const(0)]));
                let o = b.output("out", DType::F32, &[16, 128], spec(&[16, 128], vec![I::Const(0), I::Const(0)]));
                let v = b.load(x, &[ds(120, 16), Index::Full]);
                b.store(o, &[], v);
                b.finish()
            },
        },
        Broken {
            name: "smem_overflow",
            rule: "smem-budget",
            subject: "SMEM",
            mentions: &["1 MiB"],
            target: v5e,
            libtpu_rejects: None,
            kernel: {
                let mut b = KernelBuilder::new("smem_overflow");
                b.grid(&[(8, P)]);
                let table = b.prefetch("table", &[1 << 19]);
                let x = b.input("x", DType::F32, &[1024, 128], spec(&[128, 128], vec![I::Prefetch { array: table, index: vec![I::Grid(0)] }, I::Const(0)]));
                let o = b.output("out", DType::F32, &[1024, 128], spec(&[128, 128], vec![I::Grid(0), I::Const(0)]));
                let v = b.load(x, &[]);
                b.store(o, &[], v);
                b.finish()
            },
        },
    ]
}

/// The builder's or the verifier's error for a broken kernel (None if it passes both).
pub fn error_of(b: &Broken) -> Option<KernelError> {
    match &b.kernel {
        Err(e) => Some(e.clone()),
        Ok(k) => verify::verify(k, &b.target).err(),
    }
}
