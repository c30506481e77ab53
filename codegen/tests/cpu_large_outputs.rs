//! Outputs large enough for the driver's huge-page advice (`madvise(MADV_HUGEPAGE)` on
//! Linux, outputs of 8 MiB or more): fresh, untouched result memory of odd sizes and
//! alignments comes back with exactly the values of an independent loop, on one thread
//! and on several.

use tessera_codegen::cpu::{Backend, Compiled};
use tessera_dsl::interp::{HostDataMut, HostMut};
use tessera_dsl::{BlockSpec, DType, Executor, IndexExpr, Kernel, KernelBuilder, Semantics};

/// `o = x * 3 + 1` over `[rows, cols]` f32 in row blocks of 8.
fn affine(rows: usize, cols: usize) -> Kernel {
    let mut b = KernelBuilder::new("affine_large");
    b.grid(&[(rows / 8, Semantics::Parallel)]);
    let spec = BlockSpec { block_shape: vec![Some(8), Some(cols)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[rows, cols], spec.clone());
    let o = b.output("o", DType::F32, &[rows, cols], spec);
    let v = b.load(x, &[]);
    let v = b.mul(v, 3.0);
    let r = b.add(v, 1.0);
    b.store(o, &[], r);
    b.finish().unwrap()
}

#[test]
fn large_fresh_outputs_hold_exactly_the_reference_values() {
    // 16 MiB and a bit (rows not a multiple of 2 MiB of data), on 1 and 2 threads; the
    // output starts at an offset into a fresh allocation so its ends are not 2 MiB-aligned.
    for (rows, threads, skip) in [(2048, 1, 0), (2056, 2, 3), (2048, 2, 1)] {
        let cols = 2048;
        let n = rows * cols;
        let x: Vec<f32> = (0..n).map(|i| ((i % 9973) as f32 - 4986.0) * 0.37).collect();
        let want: Vec<f32> = x.iter().map(|&v| v * 3.0 + 1.0).collect();
        let k = affine(rows, cols);
        // Fresh zeroed memory (never written by this process before the kernel).
        let mut buf = vec![0f32; n + skip];
        let shape = [rows, cols];
        let exec = Compiled { backend: Backend::Jit, exact: false, threads: Some(threads) };
        let input = tessera_dsl::interp::HostRef { shape: &shape, data: tessera_dsl::interp::HostData::F32(&x) };
        let mut outs = [HostMut { shape: &shape, data: HostDataMut::F32(&mut buf[skip..]) }];
        exec.run_into(&k, &[input], &mut outs).unwrap();
        let got = &buf[skip..];
        let bad = got.iter().zip(&want).position(|(g, w)| g.to_bits() != w.to_bits());
        assert_eq!(bad, None, "rows {rows}, threads {threads}, offset {skip}: first difference at {bad:?}");
        assert!(buf[..skip].iter().all(|&v| v == 0.0), "nothing written before the output");
    }
}
