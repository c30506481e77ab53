//! Paged attention (decode): numerics against the f64 reference (f32, bf16; GQA 1/4/8;
//! lengths that are not multiples of the page size, empty and single-token sequences;
//! several compute-block sizes), the interpreter catching a missing DMA wait and a wrong
//! page, and libtpu acceptance of a large-block configuration.

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Inst, Kernel, Target, Type};
use tessera_kernels::harness::check_output;
use tessera_kernels::paged_attention::{self as pa, reference};
use tessera_kernels::types_of;
use tessera_tests::oracle;

/// (B, H, Hkv, D, num_pages, page_size, pages_per_seq, pages_per_compute_block).
type Set = (usize, usize, usize, usize, usize, usize, usize, usize);

const SHAPES: &[Set] = &[
    (4, 8, 2, 128, 16, 16, 4, 2),   // GQA 4, two compute blocks
    (3, 8, 8, 128, 12, 16, 5, 2),   // MHA (group 1), pages_per_seq not a multiple of the block
    (5, 8, 1, 128, 20, 16, 6, 4),   // GQA 8 (MQA)
    (2, 4, 1, 128, 8, 32, 3, 1),    // one page per block, 32-token pages
    (6, 16, 4, 128, 30, 16, 8, 3),  // GQA 4, three pages per block
    (3, 2, 2, 256, 9, 16, 4, 4),    // D = 256, everything in one block
];

fn shapes(&(b, h, hkv, d, np, ps, pps, _): &Set) -> Vec<Vec<usize>> {
    vec![vec![b, h, d], vec![hkv, np, ps, d], vec![hkv, np, ps, d], vec![b], vec![b, pps]]
}

fn inputs(set: usize, dtype: DType, seed: u64) -> Vec<Array> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut a = pa::random_inputs(&shapes(&SHAPES[set]), dtype, &mut rng);
    // Make sure some lengths end mid-page.
    let (ps, pps) = (SHAPES[set].5, SHAPES[set].6);
    if let tessera_dsl::interp::Data::I32(l) = &mut a[3].data {
        if l.len() > 2 {
            l[2] = (pps * ps - ps / 2 - 1) as i32;
        }
    }
    a
}

#[test]
fn matches_the_reference_f32_and_bf16() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let a = inputs(set, dtype, 7 + set as u64);
            let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], Some(sh.7), &Target::V5E).unwrap_or_else(|e| panic!("{e}"));
            let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
            let check = check_output(&out, &want);
            assert!(check.passed(), "set {set} {dtype}: {check:?}; lengths {:?}", a[3].as_i32().unwrap());
            // Sequence 0 is empty: zeros. Sequence 1 has one token: its value row.
            let (h, d) = (a[0].shape[1], a[0].shape[2]);
            assert!(out.to_f64_vec()[..h * d].iter().all(|&x| x == 0.0), "set {set}: empty sequence");
        }
    }
}

/// The default compute block follows the MXU: 256 tokens on v5e, 512 on v6e.
#[test]
fn default_compute_block_is_per_generation() {
    assert_eq!(pa::default_pages_per_compute_block(16, 64, &Target::V5E), 16);
    assert_eq!(pa::default_pages_per_compute_block(16, 64, &Target::V6E), 32);
    assert_eq!(pa::default_pages_per_compute_block(16, 8, &Target::TPU7X), 8);
}

#[test]
fn single_token_sequences_return_their_value_row() {
    let a = inputs(0, DType::F32, 3);
    assert_eq!(a[3].as_i32().unwrap()[1], 1);
    let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], None, &Target::V5E).unwrap().to_f64_vec();
    let (h, d, hkv, np, ps) = (8, 128, 2, 16, 16);
    let page = a[4].as_i32().unwrap()[4] as usize; // sequence 1, page 0
    let v = a[2].to_f64_vec();
    for head in 0..h {
        let kv = head / (h / hkv);
        let row = &v[((kv * np + page) * ps) * d..][..d];
        let got = &out[(h + head) * d..][..d];
        assert!(row.iter().zip(got).all(|(x, y)| (x - y).abs() < 1e-6), "head {head}");
    }
}

#[test]
fn every_compute_block_size_agrees() {
    let a = inputs(4, DType::F32, 11);
    let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
    for ppcb in 1..=9 {
        let out = pa::paged_attention(&Interpreter, &a[0], &a[1], &a[2], &a[3], &a[4], Some(ppcb), &Target::V5E).unwrap();
        assert!(check_output(&out, &want).passed(), "pages_per_compute_block {ppcb}");
    }
}

fn kernel_for(a: &[Array], ppcb: usize) -> Kernel {
    pa::build(&types_of(a), Some(ppcb), &Target::V5E).unwrap()
}

fn ref_named(k: &Kernel, name: &str) -> tessera_dsl::RefId {
    k.find_ref(name).unwrap()
}

#[test]
fn removing_a_dma_wait_fails_loudly() {
    let a = inputs(0, DType::F32, 5);
    let mut k = kernel_for(&a, 2);
    let v_buf = ref_named(&k, "v_buf");
    let waits: Vec<_> = k.insts.iter().enumerate().filter(|(_, d)| matches!(&d.inst, Inst::DmaWait { dst, .. } if dst.r == v_buf)).map(|(i, _)| tessera_dsl::InstId(i as u32)).collect();
    assert_eq!(waits.len(), 1);
    for b in &mut k.blocks {
        b.insts.retain(|i| !waits.contains(i));
    }
    let e = pa::run_kernel(&Interpreter, &k, &a[0], &a[1], &a[2], &a[3], &a[4]).unwrap_err();
    assert_eq!(e.rule, "dma-unwaited", "{e}");
    assert!(e.message.contains("v_buf"), "{e}");
}

#[test]
fn copying_the_wrong_page_is_caught() {
    let a = inputs(0, DType::F32, 5);
    let want = reference::paged_attention(&a[0], &a[1], &a[2], &a[3], &a[4]);
    let mut k = kernel_for(&a, 2);
    let k_buf = ref_named(&k, "k_buf");
    // Every K copy fetches page (kv head index) instead of the page table's entry; the
    // waits still balance, so only the numbers can tell.
    for d in &mut k.insts {
        if let Inst::DmaStart { src, dst, .. } = &mut d.inst {
            if dst.r == k_buf {
                src.slices[1].start = src.slices[0].start;
            }
        }
    }
    let out = pa::run_kernel(&Interpreter, &k, &a[0], &a[1], &a[2], &a[3], &a[4]).unwrap();
    assert!(!check_output(&out, &want).passed());
}

#[test]
fn verifies_on_every_target() {
    for (set, sh) in SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let t: Vec<Type> = shapes(sh).iter().enumerate().map(|(i, s)| Type::vector(if i < 3 { dtype } else { DType::I32 }, s)).collect();
            let k = pa::build(&t, Some(sh.7), &Target::V5E).unwrap();
            for target in [Target::V5E, Target::V6E, Target::TPU7X] {
                tessera_dsl::verify::verify(&k, &target).unwrap_or_else(|e| panic!("set {set} {dtype} {target}: {e}"));
            }
        }
    }
}

/// Every numerics shape set (GQA 1/4/8, D 128/256) plus a large compute block (32 pages
/// of 16 tokens = 512 tokens) over a big cache, f32 and bf16.
#[test]
fn shape_sets_and_a_large_block_config_compile_with_libtpu() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    for target in [Target::V5E, Target::V6E, Target::TPU7X] {
        let mut modules = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            for (set, sh) in SHAPES.iter().enumerate() {
                let t: Vec<Type> = shapes(sh).iter().enumerate().map(|(i, s)| Type::vector(if i < 3 { dtype } else { DType::I32 }, s)).collect();
                let l = tessera_codegen::lower(&pa::build(&t, Some(sh.7), &Target::V5E).unwrap(), &target).unwrap_or_else(|e| panic!("{e}"));
                modules.push((format!("paged_attention_set{set}_{dtype}"), l.stablehlo));
            }
            let (b, h, hkv, d, np, ps, pps) = (16, 32, 8, 128, 1024, 16, 64);
            let t = vec![
                Type::vector(dtype, &[b, h, d]),
                Type::vector(dtype, &[hkv, np, ps, d]),
                Type::vector(dtype, &[hkv, np, ps, d]),
                Type::vector(DType::I32, &[b]),
                Type::vector(DType::I32, &[b, pps]),
            ];
            let k = pa::build(&t, Some(32), &Target::V5E).unwrap();
            let l = tessera_codegen::lower(&k, &target).unwrap_or_else(|e| panic!("{e}"));
            modules.push((format!("paged_attention_large_{dtype}"), l.stablehlo));
        }
        oracle::assert_accepted(&modules, target.name);
    }
}
