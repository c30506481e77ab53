//! `interp::run_into`: kernels run on caller-owned slices (no `Array`s), with the same
//! results as `interp::run`, per-dtype conversion at the block boundary, operand checks
//! that name the operand and the rule, and poison in every output element never written.

use half::bf16;
use tessera_dsl::interp::{self, Array, Data, HostData, HostDataMut, HostMut, HostRef};
use tessera_dsl::verify::verify;
use tessera_dsl::*;

const PAR: Semantics = Semantics::Parallel;
/// Rows per block: a multiple of the i8 sublane tiling, so `mixed` passes the verifier.
const ROWS: usize = 32;
const D: usize = 128;

fn spec(block: &[usize], map: Vec<IndexExpr>) -> BlockSpec {
    BlockSpec { block_shape: block.iter().map(|&b| Some(b)).collect(), index_map: map }
}

fn g(n: usize) -> IndexExpr {
    IndexExpr::grid(n)
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Element-wise equality where NaN equals NaN (bit patterns of floats, values of ints).
fn same(a: &Array, b: &Array) -> bool {
    a.dtype == b.dtype
        && a.shape == b.shape
        && match (&a.data, &b.data) {
            (Data::F32(x), Data::F32(y)) => x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())),
            (Data::BF16(x), Data::BF16(y)) => x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())),
            (x, y) => x == y,
        }
}

/// Runs `k` with `run_into` on plain vectors cloned out of `args`, writing into output
/// vectors that start as garbage (not zeros, not poison), and returns them as arrays.
fn run_into_vecs(k: &Kernel, args: &[&Array]) -> Result<(Vec<Array>, interp::RunStats)> {
    let inputs: Vec<(Vec<usize>, Data)> = args.iter().map(|a| (a.shape.clone(), a.data.clone())).collect();
    let refs: Vec<HostRef<'_>> = inputs.iter().map(|(s, d)| HostRef { shape: s, data: d.as_host() }).collect();
    let mut outs: Vec<(Vec<usize>, Data)> = k
        .refs
        .iter()
        .filter(|r| r.kind == RefKind::Output)
        .map(|r| {
            let n: usize = r.shape.iter().product();
            let data = match r.dtype {
                DType::F32 => Data::F32(vec![7.0; n]),
                DType::BF16 => Data::BF16(vec![bf16::from_f32(7.0); n]),
                DType::I32 => Data::I32(vec![7; n]),
                DType::I8 => Data::I8(vec![7; n]),
                DType::Bool => Data::Bool(vec![true; n]),
                DType::F8E4M3FN => Data::F8E4M3FN(vec![tessera_dsl::fp8::to_e4m3fn(7.0); n]),
                DType::F8E5M2 => Data::F8E5M2(vec![tessera_dsl::fp8::to_e5m2(7.0); n]),
            };
            (r.shape.clone(), data)
        })
        .collect();
    let mut views: Vec<HostMut<'_>> = outs.iter_mut().map(|(s, d)| HostMut { shape: s, data: d.as_host_mut() }).collect();
    let stats = interp::run_into(k, &refs, &mut views)?;
    drop(views);
    Ok((outs.into_iter().map(|(s, d)| Array::new(&s, d)).collect(), stats))
}

/// Every operand kind and dtype at once, over `nb` grid steps:
/// - `perm` (scalar prefetch, i32) drives the index map of `x` and picks the HBM page;
/// - `x` (bf16, blocked), `q` (i8, blocked), `t` (f32, whole in VMEM), `h` (f32, ANY/HBM,
///   copied page by page into scratch with a DMA);
/// - `ob` (bf16) = x * 2 + q, `oi` (i8) = q + q (wrapping), `o32` (i32) = q * 1000,
///   `ow` (f32, whole in VMEM) = t * 3, `of` (f32) = h[perm[i]] + ow (read back from the
///   output), `oany` (f32, ANY/HBM) page i = h[perm[i]] by DMA.
fn mixed(nb: usize) -> Kernel {
    let mut b = KernelBuilder::new("mixed");
    b.grid(&[(nb, PAR)]);
    let perm = b.prefetch("perm", &[nb]);
    let x = b.input("x", DType::BF16, &[nb * ROWS, D], spec(&[ROWS, D], vec![IndexExpr::Prefetch { array: perm, index: vec![g(0)] }, 0.into()]));
    let q = b.input("q", DType::I8, &[nb * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let t = b.unblocked(RefKind::Input, "t", DType::F32, &[ROWS, D], MemorySpace::Vmem);
    let h = b.unblocked(RefKind::Input, "h", DType::F32, &[nb, ROWS, D], MemorySpace::Any);
    let ob = b.output("ob", DType::BF16, &[nb * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let oi = b.output("oi", DType::I8, &[nb * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let o32 = b.output("o32", DType::I32, &[nb * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let ow = b.unblocked(RefKind::Output, "ow", DType::F32, &[ROWS, D], MemorySpace::Vmem);
    let of = b.output("of", DType::F32, &[nb * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let oany = b.unblocked(RefKind::Output, "oany", DType::F32, &[nb, ROWS, D], MemorySpace::Any);
    let buf = b.scratch("buf", DType::F32, &[1, ROWS, D], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 1);

    let xv = b.load(x, &[]);
    let qv = b.load(q, &[]);
    let qb = b.cast(qv, DType::BF16);
    let x2 = b.mul(xv, 2.0);
    let sum = b.add(x2, qb);
    b.store(ob, &[], sum);
    // Int8 vectors take no arithmetic on a TPU (rule vector-op-dtype): add in i32 and
    // truncate, which wraps exactly as an i8 add would.
    let q32 = b.cast(qv, DType::I32);
    let qq = b.add(q32, q32);
    let qq = b.cast(qq, DType::I8);
    b.store(oi, &[], qq);
    let big = b.mul(q32, 1000);
    b.store(o32, &[], big);
    let tv = b.load(t, &[]);
    let t3 = b.mul(tv, 3.0);
    b.store(ow, &[], t3);

    let pid = b.program_id(0);
    let page = b.load(perm, &[ds(pid, 1)]);
    b.dma_start(h, &[ds(page, 1)], buf, &[], sem, 0);
    b.dma_wait(h, &[ds(page, 1)], buf, &[], sem, 0);
    let hv = b.load(buf, &[]);
    let hv = b.reshape(hv, &[ROWS, D]);
    let back = b.load(ow, &[]);
    let fv = b.add(hv, back);
    b.store(of, &[], fv);
    b.dma_start(buf, &[], oany, &[ds(pid, 1)], sem, 0);
    b.dma_wait(buf, &[], oany, &[ds(pid, 1)], sem, 0);
    b.finish().unwrap()
}

struct MixedInputs {
    perm: Vec<i32>,
    x: Vec<bf16>,
    q: Vec<i8>,
    t: Vec<f32>,
    h: Vec<f32>,
}

fn mixed_inputs(nb: usize) -> MixedInputs {
    let n = nb * ROWS * D;
    MixedInputs {
        perm: (0..nb).map(|i| ((i * 3 + 1) % nb) as i32).collect(),
        x: values(n, 1).iter().map(|&v| bf16::from_f32(v * 5.0)).collect(),
        // The whole i8 range, so `q + q` wraps.
        q: (0..n).map(|e| (e * 37 % 256) as u8 as i8).collect(),
        t: values(ROWS * D, 2),
        h: values(n, 3),
    }
}

#[test]
fn run_into_on_borrowed_slices_matches_run_for_every_dtype() {
    let nb = 4;
    let k = mixed(nb);
    verify(&k, &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
    let inp = mixed_inputs(nb);
    let n = nb * ROWS * D;
    let (ps, rows, page, pages) = ([nb], [nb * ROWS, D], [ROWS, D], [nb, ROWS, D]);

    // run_into straight on the caller's slices.
    let mut ob = vec![bf16::ZERO; n];
    let mut oi = vec![0i8; n];
    let mut o32 = vec![0i32; n];
    let mut ow = vec![0f32; ROWS * D];
    let mut of = vec![0f32; n];
    let mut oany = vec![0f32; n];
    let inputs = [
        HostRef::new(&ps, inp.perm.as_slice()),
        HostRef::new(&rows, inp.x.as_slice()),
        HostRef::new(&rows, inp.q.as_slice()),
        HostRef::new(&page, inp.t.as_slice()),
        HostRef::new(&pages, inp.h.as_slice()),
    ];
    let mut outputs = [
        HostMut::new(&rows, ob.as_mut_slice()),
        HostMut::new(&rows, oi.as_mut_slice()),
        HostMut::new(&rows, o32.as_mut_slice()),
        HostMut::new(&page, ow.as_mut_slice()),
        HostMut::new(&rows, of.as_mut_slice()),
        HostMut::new(&pages, oany.as_mut_slice()),
    ];
    let stats = interp::run_into(&k, &inputs, &mut outputs).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.grid_steps, nb);
    assert_eq!(stats.block_writebacks, 4 * nb);

    // Against independent references.
    for i in 0..nb {
        let p = inp.perm[i] as usize;
        for e in 0..ROWS * D {
            let (at, src) = (i * ROWS * D + e, p * ROWS * D + e);
            let want = bf16::from_f32(bf16::from_f32(inp.x[src].to_f32() * 2.0).to_f32() + inp.q[at] as f32);
            assert_eq!(ob[at].to_bits(), want.to_bits(), "ob[{at}]");
            assert_eq!(oi[at], inp.q[at].wrapping_add(inp.q[at]), "oi[{at}]");
            assert_eq!(o32[at], inp.q[at] as i32 * 1000, "o32[{at}]");
            assert_eq!(of[at], inp.h[src] + inp.t[e] * 3.0, "of[{at}]");
            assert_eq!(oany[at], inp.h[src], "oany[{at}]");
        }
    }
    assert!(ow.iter().zip(&inp.t).all(|(&o, &t)| o == t * 3.0));

    // And bit for bit against `run` on arrays.
    let args = [
        Array::from_i32(&[nb], inp.perm.clone()),
        Array::from_bf16(&rows, inp.x.clone()),
        Array::from_i8(&rows, inp.q.clone()),
        Array::from_f32(&page, inp.t.clone()),
        Array::from_f32(&pages, inp.h.clone()),
    ];
    let (want, want_stats) = interp::run_with_stats(&k, &args.iter().collect::<Vec<_>>()).unwrap();
    let got = [
        Array::from_bf16(&rows, ob),
        Array::from_i8(&rows, oi),
        Array::from_i32(&rows, o32),
        Array::from_f32(&page, ow),
        Array::from_f32(&rows, of),
        Array::from_f32(&pages, oany),
    ];
    assert_eq!(want.len(), got.len());
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(same(w, g), "output {i} differs between run and run_into");
    }
    assert_eq!((want_stats.grid_steps, want_stats.block_loads, want_stats.block_writebacks), (stats.grid_steps, stats.block_loads, stats.block_writebacks));
}

/// `o = x + 1` (int8: `x ^ 1`, TPUs do no int8 vector arithmetic) with an array dim (20)
/// that is not a multiple of the block dim (8): the last input block is read with poison
/// padding, the last output block written clipped.
fn edge_blocks(dtype: DType) -> Kernel {
    let mut b = KernelBuilder::new("edge");
    b.grid(&[(3, PAR)]);
    let x = b.input("x", dtype, &[20, D], spec(&[8, D], vec![g(0), 0.into()]));
    let o = b.output("o", dtype, &[20, D], spec(&[8, D], vec![g(0), 0.into()]));
    let v = b.load(x, &[]);
    let s = if dtype == DType::I8 { b.binary(BinaryOp::Xor, v, 1) } else { b.add(v, 1) };
    b.store(o, &[], s);
    b.finish().unwrap()
}

#[test]
fn partial_edge_blocks_are_clipped_in_the_callers_memory() {
    for dtype in [DType::F32, DType::BF16, DType::I32, DType::I8] {
        let k = edge_blocks(dtype);
        let xs: Vec<f32> = (0..20 * D).map(|e| (e % 100) as f32 - 50.0).collect();
        let x = match dtype {
            DType::I32 => Array::from_i32(&[20, D], xs.iter().map(|&v| v as i32).collect()),
            DType::I8 => Array::from_i8(&[20, D], xs.iter().map(|&v| v as i8).collect()),
            _ => Array::from_f32_in(dtype, &[20, D], xs.clone()),
        };
        let (got, _) = run_into_vecs(&k, &[&x]).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        let want = interp::run(&k, &[&x]).unwrap();
        assert!(same(&got[0], &want[0]), "{dtype}: run_into and run differ");
        let vals = got[0].to_f64_vec();
        let want = |x: f32| if dtype == DType::I8 { ((x as i8) ^ 1) as f64 } else { x as f64 + 1.0 };
        assert!(vals.iter().zip(&xs).all(|(&o, &x)| o == want(x)), "{dtype}: wrong values");
    }
}

/// Four outputs of different dtypes; only grid step 0 writes its block.
fn partial_writes() -> Kernel {
    let mut b = KernelBuilder::new("partial");
    b.grid(&[(2, PAR)]);
    let x = b.input("x", DType::F32, &[16, D], spec(&[8, D], vec![g(0), 0.into()]));
    let outs: Vec<RefId> = [("of", DType::F32), ("ob", DType::BF16), ("oi", DType::I32), ("oq", DType::I8)].iter().map(|&(name, dt)| b.output(name, dt, &[16, D], spec(&[8, D], vec![g(0), 0.into()]))).collect();
    let pid = b.program_id(0);
    let is0 = b.cmp(CmpOp::Eq, pid, 0);
    b.when(is0, |b| {
        let v = b.load(x, &[]);
        for &o in &outs {
            let dt = b.ref_decl(o).dtype;
            let c = b.cast(v, dt);
            b.store(o, &[], c);
        }
    });
    b.finish().unwrap()
}

#[test]
fn output_blocks_never_written_stay_poisoned_in_the_callers_memory() {
    let k = partial_writes();
    let xs: Vec<f32> = (0..16 * D).map(|e| (e % 50) as f32).collect();
    let shape = [16, D];
    // The caller's buffers start as garbage; run_into must not leave any of it behind.
    let (mut of, mut ob, mut oi, mut oq) = (vec![3.0f32; 16 * D], vec![bf16::from_f32(3.0); 16 * D], vec![3i32; 16 * D], vec![3i8; 16 * D]);
    let mut outputs = [HostMut::new(&shape, of.as_mut_slice()), HostMut::new(&shape, ob.as_mut_slice()), HostMut::new(&shape, oi.as_mut_slice()), HostMut::new(&shape, oq.as_mut_slice())];
    interp::run_into(&k, &[HostRef::new(&shape, xs.as_slice())], &mut outputs).unwrap_or_else(|e| panic!("{e}"));
    let half = 8 * D;
    assert!(of[..half].iter().zip(&xs).all(|(&o, &x)| o == x));
    assert!(ob[..half].iter().zip(&xs).all(|(&o, &x)| o.to_f32() == x));
    assert!(oi[..half].iter().zip(&xs).all(|(&o, &x)| o == x as i32));
    assert!(oq[..half].iter().zip(&xs).all(|(&o, &x)| o == x as i8));
    assert!(of[half..].iter().all(|v| v.is_nan()));
    assert!(ob[half..].iter().all(|v| v.is_nan()));
    assert!(oi[half..].iter().all(|&v| v == i32::MIN));
    assert!(oq[half..].iter().all(|&v| v == i8::MIN));

    // The same poison as `run` and `Array::poison`, bit for bit.
    let want = interp::run(&k, &[&Array::from_f32(&shape, xs.clone())]).unwrap();
    let got = [Array::from_f32(&shape, of), Array::from_bf16(&shape, ob), Array::from_i32(&shape, oi), Array::from_i8(&shape, oq)];
    for (w, g) in want.iter().zip(&got) {
        assert!(same(w, g), "{} output differs from run", w.dtype);
        let poison = Array::poison(w.dtype, &[1]);
        let tail = Array::new(&[1], match &g.data {
            Data::F32(v) => Data::F32(vec![v[half]]),
            Data::BF16(v) => Data::BF16(vec![v[half]]),
            Data::I32(v) => Data::I32(vec![v[half]]),
            Data::I8(v) => Data::I8(vec![v[half]]),
            Data::Bool(v) => Data::Bool(vec![v[half]]),
            Data::F8E4M3FN(v) => Data::F8E4M3FN(vec![v[half]]),
            Data::F8E5M2(v) => Data::F8E5M2(vec![v[half]]),
        });
        assert!(same(&tail, &poison), "{} poison differs from Array::poison", w.dtype);
    }
}

#[test]
fn an_any_output_never_copied_into_stays_poisoned() {
    // DMA into only the even pages of an ANY output; the odd pages keep their poison.
    let mut b = KernelBuilder::new("even_pages");
    b.grid(&[(4, PAR)]);
    let x = b.input("x", DType::I32, &[4 * ROWS, D], spec(&[ROWS, D], vec![g(0), 0.into()]));
    let o = b.unblocked(RefKind::Output, "o", DType::I32, &[4, ROWS, D], MemorySpace::Any);
    let buf = b.scratch("buf", DType::I32, &[1, ROWS, D], MemorySpace::Vmem);
    let sem = b.semaphores("sem", 1);
    let pid = b.program_id(0);
    let r = b.binary(BinaryOp::Rem, pid, 2);
    let even = b.cmp(CmpOp::Eq, r, 0);
    b.when(even, |b| {
        let v = b.load(x, &[]);
        let v = b.reshape(v, &[1, ROWS, D]);
        b.store(buf, &[], v);
        b.dma_start(buf, &[], o, &[ds(pid, 1)], sem, 0);
        b.dma_wait(buf, &[], o, &[ds(pid, 1)], sem, 0);
    });
    let k = b.finish().unwrap();
    let xs: Vec<i32> = (0..(4 * ROWS * D) as i32).collect();
    let mut out = vec![0i32; 4 * ROWS * D];
    let shape = [4, ROWS, D];
    interp::run_into(&k, &[HostRef::new(&[4 * ROWS, D], xs.as_slice())], &mut [HostMut::new(&shape, out.as_mut_slice())]).unwrap_or_else(|e| panic!("{e}"));
    for (p, chunk) in out.chunks(ROWS * D).enumerate() {
        if p % 2 == 0 {
            assert_eq!(chunk, &xs[p * ROWS * D..(p + 1) * ROWS * D]);
        } else {
            assert!(chunk.iter().all(|&v| v == i32::MIN), "page {p} should be poison");
        }
    }
}

#[test]
fn wrong_operands_are_named_errors_and_write_nothing() {
    let nb = 2;
    let k = mixed(nb);
    let inp = mixed_inputs(nb);
    let n = nb * ROWS * D;
    let (ps, rows, page, pages) = ([nb], [nb * ROWS, D], [ROWS, D], [nb, ROWS, D]);
    let (mut ob, mut oi, mut o32, mut ow, mut of, mut oany) = (vec![bf16::ZERO; n], vec![0i8; n], vec![0i32; n], vec![0f32; ROWS * D], vec![0f32; n], vec![0f32; n]);
    let inputs = [
        HostRef::new(&ps, inp.perm.as_slice()),
        HostRef::new(&rows, inp.x.as_slice()),
        HostRef::new(&rows, inp.q.as_slice()),
        HostRef::new(&page, inp.t.as_slice()),
        HostRef::new(&pages, inp.h.as_slice()),
    ];
    let mut outputs = [
        HostMut::new(&rows, ob.as_mut_slice()),
        HostMut::new(&rows, oi.as_mut_slice()),
        HostMut::new(&rows, o32.as_mut_slice()),
        HostMut::new(&page, ow.as_mut_slice()),
        HostMut::new(&rows, of.as_mut_slice()),
        HostMut::new(&pages, oany.as_mut_slice()),
    ];
    let check = |e: KernelError, rule: &str, subject: &str, message: &str| {
        assert_eq!(e.kernel, "mixed", "{e}");
        assert_eq!(e.rule, rule, "{e}");
        assert!(e.subject.contains(subject), "subject should name {subject}: {e}");
        assert!(e.message.contains(message), "message should say {message}: {e}");
        assert!(!e.help.is_empty(), "{e}");
    };

    // Counts.
    check(interp::run_into(&k, &inputs[..4], &mut outputs).unwrap_err(), "argument-count", "arguments", "4 arguments given, the kernel takes 5 (perm, x, q, t, h)");
    check(interp::run_into(&k, &inputs, &mut outputs[..5]).unwrap_err(), "output-count", "outputs", "5 outputs given, the kernel has 6 (ob, oi, o32, ow, of, oany)");

    // Input dtype, shape and data length.
    let x_f32 = vec![0f32; n];
    let mut bad = inputs;
    bad[1] = HostRef::new(&rows, x_f32.as_slice());
    check(interp::run_into(&k, &bad, &mut outputs).unwrap_err(), "argument-dtype", "input `x`", "expected bf16 elements, got f32");
    let perm8 = vec![0i8; nb];
    let mut bad = inputs;
    bad[0] = HostRef::new(&ps, perm8.as_slice());
    check(interp::run_into(&k, &bad, &mut outputs).unwrap_err(), "argument-dtype", "prefetch `perm`", "expected i32 elements, got i8");
    let mut bad = inputs;
    let wide = [nb * ROWS / 2, 2 * D];
    bad[2] = HostRef::new(&wide, inp.q.as_slice());
    check(interp::run_into(&k, &bad, &mut outputs).unwrap_err(), "argument-shape", "input `q`", "expected shape [64, 128], got [32, 256]");
    let mut bad = inputs;
    bad[4] = HostRef::new(&pages, &inp.h[1..]);
    check(interp::run_into(&k, &bad, &mut outputs).unwrap_err(), "argument-shape", "input `h`", "has 8192 elements but the data holds 8191");

    // Output dtype, shape and data length.
    let mut ob_f32 = vec![0f32; n];
    check(interp::run_into(&k, &inputs, &mut [HostMut::new(&rows, ob_f32.as_mut_slice())]).unwrap_err(), "output-count", "outputs", "1 outputs given");
    let swap = |outputs: &mut [HostMut<'_>], i: usize, with: HostMut<'_>| -> Result<interp::RunStats> {
        let mut v: Vec<HostMut<'_>> = outputs.iter_mut().map(|o| HostMut { shape: o.shape, data: o.data.reborrow_mut() }).collect();
        v[i] = with;
        interp::run_into(&k, &inputs, &mut v)
    };
    check(swap(&mut outputs, 0, HostMut::new(&rows, ob_f32.as_mut_slice())).unwrap_err(), "output-dtype", "output `ob`", "expected bf16 elements, got f32");
    let mut oi32 = vec![0i32; n];
    check(swap(&mut outputs, 1, HostMut::new(&rows, oi32.as_mut_slice())).unwrap_err(), "output-dtype", "output `oi`", "expected i8 elements, got i32");
    let mut ow_big = vec![0f32; 2 * ROWS * D];
    check(swap(&mut outputs, 3, HostMut::new(&[2 * ROWS, D], ow_big.as_mut_slice())).unwrap_err(), "output-shape", "output `ow`", "expected shape [32, 128], got [64, 128]");
    let mut short = vec![0f32; n - 1];
    check(swap(&mut outputs, 5, HostMut::new(&pages, short.as_mut_slice())).unwrap_err(), "output-shape", "output `oany`", "has 8192 elements but the data holds 8191");

    // Every check runs before anything is written: the outputs still hold their zeros.
    assert!(ob.iter().all(|v| v.to_f32() == 0.0) && oi.iter().all(|&v| v == 0) && o32.iter().all(|&v| v == 0));
    assert!(ow.iter().chain(&of).chain(&oany).all(|&v| v == 0.0));

    // The Array wrappers report the same rules.
    let e = interp::run(&k, &[&Array::from_i32(&[nb], inp.perm.clone())]).unwrap_err();
    check(e, "argument-count", "arguments", "1 arguments given");
}

#[test]
fn host_views_of_arrays_and_slices_agree() {
    let mut a = Array::from_bf16(&[2, 2], vec![bf16::ONE; 4]);
    assert_eq!(a.as_host().data.dtype(), DType::BF16);
    assert_eq!(a.as_host().data.len(), 4);
    let mut m = a.as_host_mut();
    assert_eq!(m.data.dtype(), DType::BF16);
    m.data.fill_poison();
    assert!(a.as_bf16().unwrap().iter().all(|v| v.is_nan()));
    let xs = [1i8, 2, 3];
    assert_eq!(HostData::from(&xs[..]), HostData::I8(&xs));
    let mut ys = [0i32; 2];
    let mut h: HostDataMut<'_> = (&mut ys[..]).into();
    h.fill_poison();
    assert_eq!(h.reborrow(), HostData::I32(&[i32::MIN, i32::MIN]));
}
