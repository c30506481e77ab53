//! The op table's input contract (`tessera_kernels::contract`): every op's inputs are
//! checked against their declared `kind` and `dims` before its plan builder runs, and
//! the caller's mistakes come back as the caller's, naming the op, the input and the rule.
//!
//! - generic: for every op of the table, mutations derived from its own `dims` strings
//!   (a dtype of the wrong kind, a rank off by one, a shared dim that disagrees, a count
//!   that overflows) are rejected with `operand-dtype` / `operand-rank` / `operand-shape`
//!   / `shape-overflow` naming the mutated input;
//! - arrays whose data disagree with their shape or dtype fields (`Op::run`,
//!   `plan::execute`, `plan::execute_into`) are `argument-shape` / `argument-dtype`;
//! - the specific defects of issue 9's battery (dtype of norm weights, gmm_bwd's
//!   transposed rhs, flash attention's lse, lenient reshapes, statics beyond what a plan
//!   can allocate, errors naming the wrong operand, the harness's zero reference);
//! - the CLI: `--shape` overrides used or rejected, no panic or abort on absurd shapes,
//!   alias ops emitted.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tessera_dsl::interp::{Array, HostMut, HostRef};
use tessera_dsl::{DType, Interpreter, KernelError, Target, Type};
use tessera_kernels::{find, harness, library, plan, Kind, Op};

/// The shapes and statics of an op's first case (an alias's: its source's).
fn first_case(op: &Op) -> (Vec<Vec<usize>>, tessera_kernels::Statics) {
    let source = op.alias_of.and_then(|(of, _)| find(of)).unwrap_or(op);
    let case = &source.cases[0];
    (case.shapes.iter().map(|s| s.to_vec()).collect(), op.case_statics(case).expect("case statics"))
}

/// `plan_for` on `types` must fail with one of `rules`, naming `input` of `op`.
fn rejects(op: &Op, types: &[Option<Type>], statics: &tessera_kernels::Statics, input: &str, rules: &[&str], what: &str) -> KernelError {
    let e = match op.plan_for(types, statics, &Target::V6E) {
        Ok(_) => panic!("{}: {what}: accepted", op.name),
        Err(e) => e,
    };
    assert!(rules.contains(&e.rule), "{}: {what}: rule {} (wanted one of {rules:?}): {e}", op.name, e.rule);
    assert_eq!(e.kernel, op.name, "{what}: {e}");
    assert!(e.subject.contains(&format!("`{input}`")), "{}: {what}: the error should name input `{input}`: {e}", op.name);
    assert!(!e.help.is_empty() && !e.help.contains("Tessera bug"), "{}: {what}: {e}", op.name);
    e
}

/// The names of an input's dims (`[..., n]` -> `["n"]`, `[t*k, d]` -> `["t*k", "d"]`),
/// optional ones left out, conditionals resolved by `flag`.
fn dim_names(dims: &str, flag: bool) -> Vec<String> {
    dims.trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty() && *d != "..." && !d.ends_with('?'))
        .map(|d| match d.split_once('?') {
            Some((_, rest)) => {
                let (a, b) = rest.split_once(':').unwrap();
                (if flag { a } else { b }).trim().to_string()
            }
            None => d.to_string(),
        })
        .collect()
}

fn wrong_kind(kind: Kind) -> [DType; 2] {
    match kind {
        Kind::Float => [DType::I32, DType::Bool],
        Kind::Float32 => [DType::BF16, DType::I32],
        Kind::AnyFloat => [DType::I32, DType::Bool],
        Kind::KvCache => [DType::I32, DType::Bool],
        Kind::Int32 => [DType::F32, DType::I8],
        Kind::Int8 => [DType::F32, DType::I32],
    }
}

#[test]
fn every_input_is_checked_against_its_kind() {
    for op in library() {
        let (shapes, statics) = first_case(op);
        for dtype in [DType::F32, DType::BF16] {
            let types = op.types(&shapes, dtype);
            for (i, input) in op.inputs.iter().enumerate().filter(|(i, _)| types[*i].is_some()) {
                for bad in wrong_kind(input.kind) {
                    let mut t = types.clone();
                    t[i] = t[i].as_ref().map(|t| t.with_dtype(bad));
                    let e = rejects(op, &t, &statics, input.name, &["operand-dtype"], &format!("`{}` as {bad}", input.name));
                    assert!(e.help.contains("int32") || e.help.contains("float32") || e.help.contains("int8"), "{e}");
                }
            }
        }
    }
}

#[test]
fn every_input_is_checked_against_its_rank_and_dims() {
    for op in library() {
        let (shapes, statics) = first_case(op);
        let flag = statics.bool("transpose_rhs");
        let types = op.types(&shapes, DType::F32);
        for (i, input) in op.inputs.iter().enumerate().filter(|(i, _)| types[*i].is_some()) {
            let shape = &shapes[i];
            let rest = input.dims.contains("...");
            // One dim fewer (a scalar weight for n = 1 included) and, unless leading dims
            // are free, one more.
            let mut fewer = shape.clone();
            fewer.pop();
            let mut t = types.clone();
            t[i] = Some(Type::vector(DType::F32, &fewer).with_dtype(types[i].as_ref().unwrap().dtype));
            if !rest || fewer.is_empty() {
                rejects(op, &t, &statics, input.name, &["operand-rank", "operand-shape"], &format!("`{}` {fewer:?}", input.name));
            }
            if !rest {
                let mut more = shape.clone();
                more.insert(0, 3);
                t[i] = Some(types[i].as_ref().unwrap().clone());
                t[i].as_mut().unwrap().shape = more.clone();
                rejects(op, &t, &statics, input.name, &["operand-rank", "operand-shape"], &format!("`{}` {more:?}", input.name));
            }
            // Every named dim this input shares with another given input, off by one:
            // rejected, naming one of the two (the later one in schema order).
            let names = dim_names(input.dims, flag);
            let own_offset = shape.len() - names.len();
            for (d, name) in names.iter().enumerate() {
                let sharers: Vec<&str> = op.inputs.iter().enumerate().filter(|(j, other)| *j != i && types[*j].is_some() && dim_names(other.dims, flag).iter().any(|n| n.split(['*', '+']).map(str::trim).any(|a| a == name))).map(|(_, o)| o.name).collect();
                if sharers.is_empty() {
                    continue;
                }
                let mut t = types.clone();
                t[i].as_mut().unwrap().shape[own_offset + d] += 1;
                let e = op.plan_for(&t, &statics, &Target::V6E).err().unwrap_or_else(|| panic!("{}: `{}` dim `{name}` + 1 accepted", op.name, input.name));
                assert_eq!(e.rule, "operand-shape", "{}: `{}` dim `{name}` + 1: {e}", op.name, input.name);
                let named = std::iter::once(input.name).chain(sharers.iter().copied()).any(|n| e.subject.contains(&format!("`{n}`")));
                assert!(named, "{}: `{}` dim `{name}` + 1 should name it or {sharers:?}: {e}", op.name, input.name);
                assert!(e.message.contains(&format!("`{name}`")) || e.message.contains(name.as_str()), "{}: the message should say which dim: {e}", op.name);
            }
            // An element count no usize holds (checked before the rank and the dims).
            let mut t = types.clone();
            let mut huge = shape.clone();
            huge[0] = usize::MAX / 2 + 1;
            huge.push(4);
            t[i].as_mut().unwrap().shape = huge.clone();
            rejects(op, &t, &statics, input.name, &["shape-overflow"], &format!("`{}` {huge:?}", input.name));
        }
    }
}

#[test]
fn counts_that_overflow_are_shape_overflow() {
    let op = find("softmax").unwrap();
    let st = op.statics("").unwrap();
    for shape in [vec![usize::MAX, 2], vec![1 << 32, 1 << 32], vec![1 << 31, 1 << 31]] {
        let e = rejects(op, &[Some(Type::vector(DType::F32, &shape))], &st, "x", &["shape-overflow"], &format!("{shape:?}"));
        assert!(e.message.contains("overflow"), "{e}");
    }
    // Fits a count, not a device: the HBM bound, before any kernel is built.
    rejects(op, &[Some(Type::vector(DType::F32, &[1 << 20, 1 << 20]))], &st, "x", &["hbm-budget"], "4 TiB");
}

/// Issue 9's battery: i8 / i32 / bool weights, biases and affine vectors were accepted.
#[test]
fn norm_weights_of_the_wrong_dtype_are_rejected() {
    let cases: &[(&str, &[&[usize]], &[&str])] = &[
        ("rmsnorm", &[&[11, 16], &[16]], &["weight"]),
        ("rmsnorm_residual", &[&[11, 16], &[11, 16], &[16]], &["weight"]),
        ("layernorm", &[&[5, 16], &[16], &[16]], &["weight", "bias"]),
        ("gelu_affine", &[&[9, 16], &[16], &[16]], &["a", "b"]),
    ];
    for &(name, shapes, vectors) in cases {
        let op = find(name).unwrap();
        let st = op.statics("").unwrap();
        for &v in vectors {
            let at = op.inputs.iter().position(|i| i.name == v).unwrap();
            for bad in [DType::I8, DType::I32, DType::Bool] {
                let types: Vec<Option<Type>> = shapes.iter().enumerate().map(|(j, s)| Some(Type::vector(if j == at { bad } else { DType::F32 }, s))).collect();
                let e = rejects(op, &types, &st, v, &["operand-dtype"], &format!("{v} as {bad}"));
                assert!(e.help.contains("float32 or bfloat16"), "{e}");
            }
        }
    }
}

/// Shapes only an element count used to check: each is now an error naming the input.
#[test]
fn specific_shape_contracts() {
    let f = |s: &[usize]| Some(Type::vector(DType::F32, s));
    let i = |s: &[usize]| Some(Type::vector(DType::I32, s));
    let op = |n| find(n).unwrap();
    // gmm_bwd, transposed rhs [g, n, k]: lhs [m, 1] against k = 123.
    let g = op("gmm_bwd");
    let st = g.statics("transpose_rhs=True").unwrap();
    let e = rejects(g, &[f(&[128, 1]), f(&[3, 1, 123]), i(&[3]), f(&[128, 1])], &st, "rhs", &["operand-shape"], "lhs [128, 1] vs rhs [3, 1, 123]");
    assert!(e.message.contains("`k`") && e.message.contains("`lhs`"), "{e}");
    assert!(g.plan_for(&[f(&[128, 123]), f(&[3, 1, 123]), i(&[3]), f(&[128, 1])], &st, &Target::V6E).is_ok());
    // flash attention's lse: [b, h, sq] (or [b, h, sq, 1]), not any array of that size.
    let fb = op("flash_attention_bwd");
    let st = fb.statics("").unwrap();
    let q = [1, 6, 195, 64];
    let bwd = |lse: &[usize]| vec![f(&q), f(&[1, 2, 100, 64]), f(&[1, 2, 100, 64]), f(&q), f(lse), f(&q), None, None];
    rejects(fb, &bwd(&[1, 1, 6, 195]), &st, "lse", &["operand-shape"], "lse [1, 1, 6, 195]");
    rejects(fb, &bwd(&[6, 195]), &st, "lse", &["operand-rank"], "lse [6, 195]");
    for ok in [&[1, 6, 195][..], &[1, 6, 195, 1]] {
        fb.plan_for(&bwd(ok), &st, &Target::V6E).unwrap_or_else(|e| panic!("lse {ok:?}: {e}"));
    }
    // cross entropy: labels [t] only (torch takes no [t, 1] target); lse [t] or [t, 1].
    let ce = op("cross_entropy");
    rejects(ce, &[f(&[8, 100]), i(&[8, 1])], &ce.statics("").unwrap(), "labels", &["operand-rank"], "labels [8, 1]");
    rejects(ce, &[f(&[8, 100]), i(&[2, 4])], &ce.statics("").unwrap(), "labels", &["operand-rank"], "labels [2, 4]");
    let ceb = op("cross_entropy_bwd");
    let st = ceb.statics("").unwrap();
    rejects(ceb, &[f(&[8, 100]), i(&[8]), f(&[1, 8]), f(&[8])], &st, "lse", &["operand-shape"], "lse [1, 8]");
    rejects(ceb, &[f(&[8, 100]), i(&[8]), f(&[8, 100]), f(&[8])], &st, "lse", &["operand-shape"], "lse [8, 100]");
    // A scalar weight for n = 1 is not a [1] vector.
    let rms = op("rmsnorm");
    rejects(rms, &[f(&[5, 1]), f(&[])], &rms.statics("").unwrap(), "weight", &["operand-rank"], "weight []");
    rms.plan_for(&[f(&[5, 1]), f(&[1, 1])], &rms.statics("").unwrap(), &Target::V6E).expect("the kernels' [1, n] weight");
    // Paged and ragged metadata shapes.
    let pa = op("paged_attention");
    let st = pa.statics("").unwrap();
    let kv = [2, 8, 16, 128];
    rejects(pa, &[f(&[4, 4, 128]), f(&kv), f(&kv), i(&[5]), i(&[4, 2]), None, None], &st, "lengths", &["operand-shape"], "lengths [5] for 4 sequences");
    rejects(pa, &[f(&[4, 4, 128]), f(&kv), f(&kv), i(&[4]), i(&[4]), None, None], &st, "page_indices", &["operand-rank"], "page_indices [4]");
    rejects(pa, &[f(&[4, 4, 128]), f(&kv), f(&[2, 8, 16, 64]), i(&[4]), i(&[4, 2]), None, None], &st, "v_pages", &["operand-shape"], "v_pages of another head dim");
    // Per-token scales are [hkv, num_pages, page_size] float32: not per page, not bf16.
    let q8 = Some(Type::vector(DType::I8, &kv));
    let scales = |shape: &[usize], dtype: DType| Some(Type::vector(dtype, shape));
    rejects(pa, &[f(&[4, 4, 128]), q8.clone(), q8.clone(), i(&[4]), i(&[4, 2]), scales(&[2, 8], DType::F32), scales(&[2, 8, 16], DType::F32)], &st, "k_token_scales", &["operand-rank"], "per-page k scales");
    rejects(pa, &[f(&[4, 4, 128]), q8.clone(), q8.clone(), i(&[4]), i(&[4, 2]), scales(&[2, 8, 16], DType::F32), scales(&[2, 8, 16], DType::BF16)], &st, "v_token_scales", &["operand-dtype"], "bf16 v scales");
    pa.plan_for(&[f(&[4, 4, 128]), q8.clone(), q8, i(&[4]), i(&[4, 2]), scales(&[2, 8, 16], DType::F32), scales(&[2, 8, 16], DType::F32)], &st, &Target::V6E).expect("an int8 cache with per-token scales");
    let ra = op("ragged_paged_attention");
    let st = ra.statics("").unwrap();
    let ragged = |cu: &[usize], ns: &[usize]| vec![f(&[16, 4, 128]), f(&kv), f(&kv), i(&[3]), i(&[3, 2]), i(cu), i(ns), None, None];
    rejects(ra, &ragged(&[3], &[1]), &st, "cu_q_lens", &["operand-shape"], "cu_q_lens [s]");
    rejects(ra, &ragged(&[2, 4], &[1]), &st, "cu_q_lens", &["operand-rank"], "cu_q_lens [2, 4]");
    rejects(ra, &ragged(&[4], &[2, 1]), &st, "num_seqs", &["operand-rank"], "num_seqs [2, 1]");
    rejects(ra, &ragged(&[4], &[2]), &st, "num_seqs", &["operand-shape"], "num_seqs [2]");
    ra.plan_for(&ragged(&[4], &[1]), &st, &Target::V6E).expect("valid ragged shapes");
}

/// Ragged metadata errors name the input at fault: a bad offset is a `cu_q_lens` error,
/// not the `q_len > kv_len` it implies for an earlier sequence.
#[test]
fn ragged_metadata_errors_name_the_input_at_fault() {
    let op = find("ragged_paged_attention").unwrap();
    let st = op.statics("sm_scale=0.08838834764831845").unwrap();
    let shapes: Vec<Vec<usize>> = vec![vec![24, 4, 128], vec![2, 6, 16, 128], vec![2, 6, 16, 128], vec![3], vec![3, 2], vec![4], vec![1]];
    let mut base = harness::inputs_for(op, &shapes, DType::F32, &st, &mut rand::SeedableRng::seed_from_u64(5));
    base[3] = Array::from_i32(&[3], vec![8, 20, 30]);
    base[4] = Array::from_i32(&[3, 2], vec![0, 1, 2, 3, 4, 5]);
    base[5] = Array::from_i32(&[4], vec![0, 8, 9, 19]);
    base[6] = Array::from_i32(&[1], vec![3]);
    let run = |a: &[Array]| op.run(&Interpreter, &a.iter().map(Some).collect::<Vec<_>>(), &st, &Target::V6E);
    run(&base).expect("the valid metadata runs");
    for (at, values, input) in [
        (5, vec![0, 9, 8, 19], "cu_q_lens"),
        (5, vec![0, 8, 9, 25], "cu_q_lens"),
        (5, vec![1, 8, 9, 19], "cu_q_lens"),
        (5, vec![-1, 8, 9, 19], "cu_q_lens"),
        (5, vec![0, -8, 9, 19], "cu_q_lens"),
        (3, vec![8, 20, 33], "kv_lens"),
        (3, vec![8, 20, 5], "kv_lens"),
        (6, vec![4], "num_seqs"),
        (4, vec![0, 1, 2, 6, 4, 5], "page_indices"),
    ] {
        let mut a = base.clone();
        a[at] = Array::from_i32(&a[at].shape.clone(), values.clone());
        let e = run(&a).err().unwrap_or_else(|| panic!("{input} {values:?} accepted"));
        assert_eq!(e.subject, format!("input `{input}`"), "{values:?}: {e}");
    }
}

fn lying(dtype: DType, shape: &[usize], len: usize) -> Array {
    let mut a = Array::zeros(dtype, &[len]);
    a.shape = shape.to_vec();
    a
}

/// An `Array` whose data disagree with its fields is the caller's mistake, reported
/// before anything reads it: `Op::run`, `plan::execute` and `plan::execute_into`.
#[test]
fn inconsistent_arrays_are_argument_errors() {
    let op = find("rmsnorm").unwrap();
    let st = op.statics("").unwrap();
    let x = Array::from_f32(&[4, 8], vec![0.5; 32]);
    let short_w = lying(DType::F32, &[8], 7);
    let e = op.run(&Interpreter, &[Some(&x), Some(&short_w)], &st, &Target::V6E).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-shape", "input `weight`"), "{e}");
    let mut field = Array::from_f32(&[8], vec![1.0; 8]);
    field.dtype = DType::BF16;
    let e = op.run(&Interpreter, &[Some(&x), Some(&field)], &st, &Target::V6E).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-dtype", "input `weight`"), "{e}");
    // A shape of 2^64 elements with one element of data: never allocated.
    let huge = lying(DType::F32, &[1 << 32, 1 << 32], 1);
    let e = op.run(&Interpreter, &[Some(&huge), Some(&lying(DType::F32, &[1 << 32], 1))], &st, &Target::V6E).unwrap_err();
    assert_eq!(e.rule, "argument-shape", "{e}");
    // Labels one short (the interpreter's Array::new used to panic on the copy).
    let ce = find("cross_entropy").unwrap();
    let logits = Array::from_f32(&[6, 10], vec![0.1; 60]);
    let e = ce.run(&Interpreter, &[Some(&logits), Some(&lying(DType::I32, &[6], 5))], &ce.statics("").unwrap(), &Target::V6E).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-shape", "input `labels`"), "{e}");

    // The plan-level entry points: built for one type, given another or a lying array.
    let types = vec![Some(Type::vector(DType::F32, &[4, 8])), Some(Type::vector(DType::F32, &[8]))];
    let p = op.plan_for(&types, &st, &Target::V6E).unwrap();
    let w = Array::from_f32(&[8], vec![1.0; 8]);
    let e = plan::execute(&p, &Interpreter, &[Some(&x), Some(&short_w)]).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-shape", "input `weight`"), "{e}");
    let x16 = Array::from_f32(&[2, 16], vec![0.5; 32]);
    let e = plan::execute(&p, &Interpreter, &[Some(&x16), Some(&w)]).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-shape", "input `x`"), "{e}");
    let xb = Array::from_f32_as_bf16(&[4, 8], &[0.5; 32]);
    let e = plan::execute(&p, &Interpreter, &[Some(&xb), Some(&w)]).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-dtype", "input `x`"), "{e}");
    let mut out = vec![0f32; 32];
    let data = [0.5f32; 31];
    let ins = [Some(HostRef::new(&[4, 8], &data[..])), Some(w.as_host())];
    let mut outs = [HostMut::new(&[4, 8], &mut out[..])];
    let e = plan::execute_into(&p, &Interpreter, &ins, &mut outs).unwrap_err();
    assert_eq!((e.rule, e.subject.as_str()), ("argument-shape", "input `x`"), "{e}");
    let e = plan::try_to_array("rmsnorm", "input `x`", HostRef::new(&[4, 8], &data[..])).unwrap_err();
    assert_eq!(e.rule, "argument-shape", "{e}");
    // And consistent inputs run.
    plan::execute(&p, &Interpreter, &[Some(&x), Some(&w)]).expect("a consistent call runs");
}

/// Errors name the argument the caller passed: `dy` of rope_bwd, the `tiling` of gmm, and
/// routing errors never a `weights` that permute_bwd does not take.
#[test]
fn errors_name_the_callers_argument() {
    let f = |s: &[usize]| Some(Type::vector(DType::F32, s));
    let i = |s: &[usize]| Some(Type::vector(DType::I32, s));
    let rb = find("rope_bwd").unwrap();
    let st = rb.statics("").unwrap();
    for (dy, what) in [(vec![4, 2, 7], "odd head_dim"), (vec![4, 2], "rank 2")] {
        let e = rb.plan_for(&[f(&dy), i(&[4])], &st, &Target::V6E).err().expect("rejected");
        assert!(e.subject.contains("`dy`") && !e.subject.contains("`x`") && !e.message.contains("x has"), "rope_bwd {what}: {e}");
    }
    let pb = find("permute_bwd").unwrap();
    let st = pb.statics("num_experts=4").unwrap();
    for types in [vec![f(&[8, 16]), i(&[3, 2])], vec![f(&[6, 16]), i(&[3])], vec![f(&[6]), i(&[3, 2])], vec![Some(Type::vector(DType::I32, &[6, 16])), i(&[3, 2])]] {
        let e = pb.plan_for(&types, &st, &Target::V6E).err().expect("rejected");
        assert!(!format!("{e}").contains("weights"), "permute_bwd names a `weights` it does not take: {e}");
        assert!(e.subject.contains("`dout`") || e.subject.contains("`expert_ids`"), "{e}");
    }
    let g = find("gmm").unwrap();
    let types = [f(&[256, 128]), f(&[2, 128, 128]), i(&[2])];
    let e = g.plan_for(&types, &g.statics("tiling=[128, 96, 128]").unwrap(), &Target::V6E).err().expect("rejected");
    assert_eq!((e.rule, e.subject.as_str()), ("block-shape", "argument `tiling`"), "{e}");
    assert!(e.message.contains("tiling=[128, 96, 128]") && !e.message.contains("GmmBlocks"), "{e}");
    let e = g.plan_for(&types, &g.statics("tiling=[0, 128, 128]").unwrap(), &Target::V6E).err().expect("rejected");
    assert!(e.subject.contains("tiling") && !e.message.contains("GmmBlocks"), "{e}");
    let ra = find("ragged_paged_attention").unwrap();
    let kv = [2, 8, 16, 128];
    let types = [f(&[16, 4, 128]), f(&kv), f(&kv), i(&[3]), i(&[3, 2]), i(&[4]), i(&[1]), None, None];
    for (statics, arg) in [("num_queries_per_block=5", "num_queries_per_block"), ("num_kv_pages_per_block=0", "num_kv_pages_per_block"), ("sliding_window=0", "sliding_window"), ("soft_cap=-1.0", "soft_cap")] {
        let e = ra.plan_for(&types, &ra.statics(statics).unwrap(), &Target::V6E).err().expect("rejected");
        assert_eq!(e.subject, format!("argument `{arg}`"), "{statics}: {e}");
    }
}

/// Block-size statics beyond what a kernel can take are errors naming the static, not a
/// literal out of i32 range deep in some kernel; empty inputs are refused as inputs.
#[test]
fn block_statics_and_empty_inputs() {
    let run_default = |name: &str, statics: &str| {
        let op = find(name).unwrap();
        let (shapes, _) = first_case(op);
        let source = op.alias_of.and_then(|(of, _)| find(of)).unwrap_or(op);
        let st = op.statics(&format!("{}, {statics}", source.cases[0].statics).trim_start_matches(", ")).unwrap();
        op.plan_for(&op.types(&shapes, DType::F32), &st, &Target::V6E).err().unwrap_or_else(|| panic!("{name} {statics} accepted"))
    };
    for (name, statics, arg) in [
        ("gmm", "tiling=[1099511627776, 128, 128]", "tiling"),
        ("tgmm", "tiling=[128, -1, 128]", "tiling"),
        ("flash_attention_fwd", "block_kv=1099511627776", "block_kv"),
        ("flash_attention_bwd", "block_q=0", "block_q"),
        ("paged_attention", "pages_per_compute_block=1099511627776", "pages_per_compute_block"),
        ("ragged_paged_attention", "num_queries_per_block=1099511627776", "num_queries_per_block"),
        ("ragged_paged_attention", "num_kv_pages_per_block=1099511627776", "num_kv_pages_per_block"),
        ("ragged_paged_attention", "num_kv_pages_per_block=0", "num_kv_pages_per_block"),
    ] {
        let e = run_default(name, statics);
        assert_eq!(e.subject, format!("argument `{arg}`"), "{name} {statics}: {e}");
        assert!(!e.message.contains("Blocks {") && e.rule != "literal-range", "{name} {statics}: {e}");
    }
    for op in library() {
        let (shapes, statics) = first_case(op);
        let types = op.types(&shapes, DType::F32);
        for (i, input) in op.inputs.iter().enumerate().filter(|(i, _)| types[*i].is_some()) {
            let mut t = types.clone();
            let last = t[i].as_ref().unwrap().rank() - 1;
            t[i].as_mut().unwrap().shape[last] = 0;
            let e = rejects(op, &t, &statics, input.name, &["operand-shape"], &format!("`{}` with a zero dim", input.name));
            assert!(e.message.contains("empty"), "{e}");
        }
    }
}

/// Non-finite softmax scales are option errors; an alias's errors name the alias.
#[test]
fn attention_scales_are_finite_and_aliases_named() {
    let f = |s: &[usize]| Some(Type::vector(DType::F32, s));
    for name in ["flash_attention_fwd", "flash_attention", "flash_attention_bwd"] {
        let op = find(name).unwrap();
        let mut types = vec![f(&[1, 2, 8, 16]), f(&[1, 1, 8, 16]), f(&[1, 1, 8, 16])];
        if name == "flash_attention_bwd" {
            types.extend([f(&[1, 2, 8, 16]), f(&[1, 2, 8]), f(&[1, 2, 8, 16])]);
        }
        types.resize(op.inputs.len(), None);
        for bad in ["nan", "inf", "-inf", "1e39"] {
            let e = op.plan_for(&types, &op.statics(&format!("sm_scale={bad}")).unwrap(), &Target::V6E).err().expect("rejected");
            assert_eq!((e.kernel.as_str(), e.rule, e.subject.as_str()), (name, "option-value", "argument `sm_scale`"), "{e}");
        }
    }
    let ra = find("ragged_paged_attention").unwrap();
    let (shapes, _) = first_case(ra);
    let e = ra.plan_for(&ra.types(&shapes, DType::F32), &ra.statics("sm_scale=nan").unwrap(), &Target::V6E).err().expect("rejected");
    assert_eq!(e.subject, "argument `sm_scale`", "{e}");
    // Run-time errors of an alias name it too.
    let op = find("flash_attention").unwrap();
    let q = lying(DType::F32, &[1, 2, 8, 16], 3);
    let kv = Array::from_f32(&[1, 1, 8, 16], vec![0.0; 128]);
    let e = op.run(&Interpreter, &[Some(&q), Some(&kv), Some(&kv)], &op.statics("").unwrap(), &Target::V6E).unwrap_err();
    assert_eq!((e.kernel.as_str(), e.rule), ("flash_attention", "argument-shape"), "{e}");
    let types = vec![f(&[1, 2, 8, 16]), f(&[1, 1, 8, 16]), f(&[1, 1, 8, 16]), None, None];
    let plan = op.plan_for(&types, &op.statics("").unwrap(), &Target::V6E).unwrap();
    let e = plan::execute(&plan, &Interpreter, &[Some(&Array::from_f32(&[1, 2, 16, 8], vec![0.0; 256])), Some(&kv), Some(&kv)]).unwrap_err();
    assert_eq!((e.kernel.as_str(), e.rule, e.subject.as_str()), ("flash_attention", "argument-shape", "input `q`"), "{e}");
}

/// Statics bounded by what a plan can name and run: the device routing counts every expert
/// in VMEM, so at most `MAX_EXPERTS`.
#[test]
fn num_experts_beyond_the_routing_bound_is_an_option_error() {
    let f = |s: &[usize]| Some(Type::vector(DType::F32, s));
    let i = |s: &[usize]| Some(Type::vector(DType::I32, s));
    for (name, types) in [("permute", vec![f(&[8, 16]), i(&[8, 2])]), ("permute_bwd", vec![f(&[16, 16]), i(&[8, 2])]), ("combine", vec![f(&[16, 16]), f(&[8, 2]), i(&[8, 2])])] {
        let op = find(name).unwrap();
        for n in ["3000000000", "0", "2147483648", "2147483647", "65537"] {
            let e = op.plan_for(&types, &op.statics(&format!("num_experts={n}")).unwrap(), &Target::V6E).err().expect("rejected");
            assert_eq!((e.rule, e.subject.as_str()), ("option-value", "argument `num_experts`"), "{name} num_experts={n}: {e}");
        }
    }
    // At the bound the routing runs and verifies.
    let pb = find("permute_bwd").unwrap();
    let ids = Array::from_i32(&[4, 2], vec![0, 5, 7, 65_535, 3, 4, 9, 10]);
    let dout = Array::from_f32(&[8, 16], (0..128).map(|v| v as f32).collect());
    let out = pb.run(&Interpreter, &[Some(&dout), Some(&ids)], &pb.statics("num_experts=65536").unwrap(), &Target::V6E).expect("permute_bwd over 65536 experts");
    assert_eq!(out[0].shape, vec![4, 16]);
    let p = find("permute").unwrap();
    let plan = p.plan_for(&[f(&[4, 16]), i(&[4, 2])], &p.statics("num_experts=65536").unwrap(), &Target::V6E).unwrap();
    assert_eq!(plan.results[1].ty.shape, vec![65536]);
    for launch in &plan.launches {
        tessera_dsl::verify::verify(&launch.kernel, &Target::V6E).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The harness judges a (near) zero reference absolutely, and a real error still fails.
#[test]
fn zero_references_are_judged_by_absolute_error() {
    let zeros = vec![0.0; 8];
    let noise = Array::from_f32(&[8], vec![8.4e-8, -3e-8, 0.0, 0.0, 1e-9, 0.0, 0.0, 0.0]);
    assert!(harness::check_output(&noise, &zeros).passed(), "{:?}", harness::check_output(&noise, &zeros));
    let wrong = Array::from_f32(&[8], vec![1e-3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert!(!harness::check_output(&wrong, &zeros).passed());
    let nan = Array::from_f32(&[8], vec![f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    assert!(!harness::check_output(&nan, &zeros).passed());
    // Infinities are judged by class: -inf where the reference is -inf passes, f32::MIN
    // (a finite stand-in) does not, and neither does an infinity where it is finite.
    let lse_ref = vec![f64::NEG_INFINITY, 0.5];
    assert!(harness::check_output(&Array::from_f32(&[2], vec![f32::NEG_INFINITY, 0.5]), &lse_ref).passed());
    let c = harness::check_output(&Array::from_f32(&[2], vec![f32::MIN, 0.5]), &lse_ref);
    assert!(!c.passed() && c.nonfinite == 1, "{c:?}");
    assert!(!harness::check_output(&Array::from_f32(&[2], vec![0.0, f32::INFINITY]), &[0.0, 0.5]).passed());
    // A normal reference keeps the relative error: 1% off a value of 1e-3 fails.
    let want: Vec<f64> = (0..8).map(|i| 1e-3 * (i + 1) as f64).collect();
    let off = Array::from_f32(&[8], want.iter().map(|&w| (w * 1.01) as f32).collect());
    assert!(!harness::check_output(&off, &want).passed());
    // The battery's example: a query that sees one key has dq = 0 exactly.
    let op = find("flash_attention_bwd").unwrap();
    let shapes = vec![vec![1, 1, 1, 128], vec![1, 1, 1, 128], vec![1, 1, 1, 128], vec![1, 1, 1, 128], vec![1, 1, 1], vec![1, 1, 1, 128]];
    let r = harness::run_case(op, &op.statics("causal=True").unwrap(), &shapes, DType::F32, &Target::V5E, 0, &Interpreter).unwrap();
    assert!(r.passed(), "{:?}", r.outputs);
}

/// `run_case` uses the shapes it is given exactly, or refuses them before drawing inputs.
#[test]
fn the_harness_uses_shapes_as_given_or_refuses_them() {
    let run = |name: &str, shapes: Vec<Vec<usize>>, statics: &str| {
        let op = find(name).unwrap();
        harness::run_case(op, &op.statics(statics).unwrap(), &shapes, DType::F32, &Target::V5E, 0, &Interpreter)
    };
    let e = run("cross_entropy", vec![vec![15, 22], vec![2, 15]], "").unwrap_err();
    assert!(e.subject.contains("`labels`"), "{e}");
    let e = run("softmax", vec![vec![1 << 20, 1 << 20]], "").unwrap_err();
    assert_eq!(e.rule, "hbm-budget", "{e}");
    let e = run("permute_bwd", vec![vec![8, 1], vec![1 << 40, 1024]], "num_experts=5").unwrap_err();
    assert!(e.subject.contains("`dout`") || e.subject.contains("`expert_ids`"), "{e}");
    let r = run("cross_entropy_bwd", vec![vec![6, 40], vec![6], vec![6, 1], vec![6]], "").unwrap();
    assert!(r.passed() && r.shapes[2] == vec![6, 1], "{r:?}");
    let r = run("flash_attention_bwd", vec![vec![1, 2, 20, 64], vec![1, 1, 30, 64], vec![1, 1, 30, 64], vec![1, 2, 20, 64], vec![1, 2, 20, 1], vec![1, 2, 20, 64]], "").unwrap();
    assert!(r.passed(), "{r:?}");
}

// ---- the CLI ----------------------------------------------------------------------------

/// The `tessera` binary of this workspace (built on first use, in this test's profile).
fn tessera() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary");
        let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").to_path_buf();
        let profile = dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug").to_string();
        let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "-q", "-p", "tessera-cli"]).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        match profile.as_str() {
            "release" => drop(cmd.arg("--release")),
            "debug" => {}
            other => drop(cmd.args(["--profile", other])),
        }
        assert!(cmd.status().expect("cargo build").success(), "cannot build the tessera CLI");
        dir.join("tessera")
    })
}

/// `tessera args` under a 3 GiB address-space limit: (exit code, stdout, stderr); a signal
/// or a panic fails the test.
fn cli(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new("sh").arg("-c").arg("ulimit -v 3145728 && exec \"$0\" \"$@\"").arg(tessera()).args(args).env("RUST_BACKTRACE", "0").output().expect("run the CLI");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
    let code = out.status.code().unwrap_or_else(|| panic!("`tessera {}` was killed by a signal:\n{stderr}", args.join(" ")));
    assert!(!stderr.contains("panicked"), "`tessera {}` panicked:\n{stderr}", args.join(" "));
    (code, stdout, stderr)
}

/// Exit 2 with a message naming each of `needles`.
fn cli_rejects(args: &[&str], needles: &[&str]) {
    let (code, stdout, stderr) = cli(args);
    assert_eq!(code, 2, "`tessera {}`: exit {code}\n{stdout}\n{stderr}", args.join(" "));
    for n in needles {
        assert!(stderr.contains(n), "`tessera {}` should mention {n}:\n{stderr}", args.join(" "));
    }
}

#[test]
fn cli_shape_overrides_are_used_or_rejected() {
    cli_rejects(&["run", "cross_entropy", "--shape", "logits=15x22", "--shape", "labels=2x15"], &["`labels`", "operand-rank"]);
    cli_rejects(&["run", "cross_entropy", "--shape", "logits=15x22", "--shape", "labels=14"], &["`labels`", "operand-shape", "[15]"]);
    cli_rejects(&["run", "ragged_paged_attention", "--shape", "cu_q_lens=2x4"], &["`cu_q_lens`"]);
    cli_rejects(&["run", "ragged_paged_attention", "--shape", "num_seqs=2x1"], &["`num_seqs`"]);
    cli_rejects(&["run", "paged_attention", "--shape", "page_indices=4"], &["`page_indices`", "operand-rank"]);
    cli_rejects(&["run", "cross_entropy_bwd", "--shape", "lse=1x65537"], &["`lse`"]);
    // One shape per input, and (with --all) only names some op has.
    cli_rejects(&["run", "softmax", "--shape", "x=4x4", "--shape", "x=8x8"], &["`x` already has a shape"]);
    cli_rejects(&["emit", "--all", "--shape", "nope=4x4", "--out", "/tmp/tessera-op-contract-unused"], &["no selected op has an input `nope`"]);
    cli_rejects(&["run", "softmax", "--shape", "y=4"], &["has no input `y`"]);
    // A used override: lse as a column.
    let (code, stdout, stderr) = cli(&["run", "cross_entropy_bwd", "--shape", "logits=6x40", "--shape", "labels=6", "--shape", "lse=6x1", "--shape", "dloss=6"]);
    assert!(code == 0 && stdout.contains("6x40,6,6x1,6") && stdout.contains(" ok"), "{stdout}\n{stderr}");
}

/// Bad arguments are refused before anything prints (stdout stays empty): a static given
/// twice (no silent last-wins), an unknown case, a shape the op refuses.
#[test]
fn cli_arguments_are_checked_before_output() {
    let cases: [(&[&str], &[&str]); 5] = [
        (&["run", "matmul", "--statics", "block_m=8,block_m=16"], &["`block_m` is given twice", "block_m=8", "block_m=16"]),
        (&["emit", "matmul", "--statics", "block_m=8, block_n=128, block_m=8", "--out", "/tmp/tessera-op-contract-unused"], &["`block_m` is given twice"]),
        (&["run", "softmax", "--case", "nope"], &["no case `nope`"]),
        (&["run", "cross_entropy", "--shape", "logits=15x22", "--shape", "labels=2x15"], &["`labels`", "operand-rank"]),
        (&["run", "--all", "--case", "nope"], &["no op has a case `nope`"]),
    ];
    for (args, needles) in cases {
        cli_rejects(args, needles);
        let (_, stdout, _) = cli(args);
        assert!(stdout.is_empty(), "`tessera {}` printed before refusing:\n{stdout}", args.join(" "));
    }
}

/// A reader that closes the pipe early (`tessera list | head -1`) ends the CLI quietly (the
/// default SIGPIPE action), not with a panic on the next `println!`.
#[test]
fn cli_output_into_a_closed_pipe_is_not_a_panic() {
    let mut child = std::process::Command::new(tessera()).arg("list").env("RUST_BACKTRACE", "0").stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("run the CLI");
    // The read end closes before the CLI has written anything: its first write hits a closed pipe.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The help says what each command takes: the op is any op of the binary (not only the
/// library's), and `tune` (one op at a time) does not offer `--all`.
#[test]
fn cli_help_matches_the_commands() {
    for cmd in ["run", "emit", "check", "cost", "tune"] {
        let (code, stdout, stderr) = cli(&[cmd, "--help"]);
        assert_eq!(code, 0, "{stdout}\n{stderr}");
        assert!(stdout.contains("Op name (see `list`)") && !stdout.contains("Library op name"), "`{cmd} --help`:\n{stdout}");
        assert_eq!(stdout.contains("--all"), cmd != "tune", "`{cmd} --help`:\n{stdout}");
    }
    cli_rejects(&["tune", "--all"], &["tune one op at a time"]);
}

/// `--shape` without `--case` goes to each case of the op: a case that cannot take the shapes
/// (flash attention's segmented case, with plain q/k/v), or that then gives the same kernels
/// as an earlier one (rmsnorm's `wide`), is skipped saying so, not an error or a duplicate.
#[test]
fn cli_shapes_without_a_case_skip_the_cases_that_cannot_take_them() {
    let dir = std::env::temp_dir().join(format!("tessera-emit-shapes-{}", std::process::id()));
    let qkv = ["--shape", "q=1x2x256x128", "--shape", "k=1x2x256x128", "--shape", "v=1x2x256x128"];
    let mut args = vec!["emit", "flash_attention_fwd", "--target", "v6e", "--out", dir.to_str().unwrap()];
    args.extend(qkv);
    let (code, stdout, stderr) = cli(&args);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stderr.contains("flash_attention_fwd_segmented: skipped, the case cannot take these inputs"), "{stderr}");
    assert!(dir.join("flash_attention_fwd_causal.mosaic.mlir").exists() && !dir.join("flash_attention_fwd_segmented.mosaic.mlir").exists());
    let (code, stdout, stderr) = cli(&["emit", "rmsnorm", "--target", "v6e", "--out", dir.to_str().unwrap(), "--shape", "x=64x1000", "--shape", "weight=1000"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stderr.contains("rmsnorm_wide: skipped, the same kernels as `rmsnorm`"), "{stderr}");
    assert!(!dir.join("rmsnorm_wide.mosaic.mlir").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// `tune` refuses before compiling anything: a `--save` file that is not a tuning table (it
/// is never overwritten), and shapes no case of the op can take (each case skipped, saying why).
#[test]
fn cli_tune_checks_its_inputs_before_compiling() {
    let bad = std::env::temp_dir().join(format!("tessera-tune-bad-{}.json", std::process::id()));
    std::fs::write(&bad, [0xffu8, 0xfe, 0x00]).unwrap();
    cli_rejects(&["tune", "matmul", "--case", "default", "--target", "v5e", "--save", bad.to_str().unwrap()], &["not a tuning table", "not UTF-8"]);
    assert_eq!(std::fs::read(&bad).unwrap(), [0xffu8, 0xfe, 0x00], "the file was overwritten");
    std::fs::write(&bad, r#"{"format": 2, "entries": []}"#).unwrap();
    cli_rejects(&["tune", "matmul", "--case", "default", "--target", "v5e", "--save", bad.to_str().unwrap()], &["format 2"]);
    std::fs::remove_file(&bad).unwrap();
    let qkv = ["--shape", "q=1x2x256x128", "--shape", "k=1x2x256x128", "--shape", "v=1x2x256x128"];
    let mut args = vec!["tune", "flash_attention_fwd", "--case", "segmented", "--target", "v5e", "--dtype", "bf16"];
    args.extend(qkv);
    cli_rejects(&args, &["skipped, the case cannot take these inputs", "q_segment_ids", "no case could take these inputs"]);
}

/// `--all --case NAME` takes that case of each op that has it, saying how many ops it
/// skipped (not stopping at the first op without it).
#[test]
fn cli_all_with_a_case_skips_the_ops_without_it() {
    let dir = std::env::temp_dir().join(format!("tessera-op-contract-alt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, stdout, stderr) = cli(&["emit", "--all", "--case", "alt", "--out", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stderr.contains("--case `alt`: skipped ") && stderr.contains("which have no case `alt`"), "{stderr}");
    let with_alt = library().filter(|op| op.alias_of.is_none() && op.case("alt").is_some()).count();
    let files: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert!(files.iter().all(|f| f.contains("_alt")), "{files:?}");
    let ops: std::collections::BTreeSet<&str> = files.iter().filter_map(|f| f.split("_alt").next()).collect();
    assert_eq!(ops.len(), with_alt, "one op per alt case: {ops:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_absurd_shapes_are_errors_not_crashes() {
    cli_rejects(&["run", "softmax", "--shape", "x=18446744073709551615x2"], &["shape-overflow", "`x`"]);
    cli_rejects(&["run", "softmax", "--shape", "x=1048576x1048576"], &["hbm-budget"]);
    cli_rejects(&["run", "permute_bwd", "--shape", "expert_ids=1099511627776x1024"], &["permute_bwd", "operand-shape"]);
    cli_rejects(&["run", "permute_bwd", "--shape", "dout=1125899906842624x1", "--shape", "expert_ids=1099511627776x1024", "--statics", "num_experts=5"], &["hbm-budget"]);
    for op in ["permute", "permute_bwd"] {
        cli_rejects(&["run", op, "--statics", "num_experts=3000000000"], &["num_experts", "option-value"]);
    }
    // Valid, but more host memory than the 3 GiB the test allows: a clean error.
    cli_rejects(&["run", "permute", "--shape", "x=8x16", "--shape", "expert_ids=8x2", "--statics", "num_experts=2147483647"], &["num_experts", "option-value"]);
}

#[test]
fn cli_emit_writes_alias_kernels_and_nothing_for_rejected_shapes() {
    let dir = std::env::temp_dir().join(format!("tessera-op-contract-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.to_str().unwrap();
    let (code, stdout, stderr) = cli(&["emit", "flash_attention", "--case", "causal", "--out", out]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let files: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert!(files.iter().any(|f| f == "flash_attention_causal.mosaic.mlir") && files.iter().any(|f| f == "flash_attention_causal.stablehlo.mlir"), "{files:?}");
    // An alias op with a shape its source rejects: an error, no file.
    let _ = std::fs::remove_dir_all(&dir);
    cli_rejects(&["emit", "flash_attention", "--case", "causal", "--shape", "q=2x2x12", "--out", out], &["`q`", "operand-rank"]);
    for (op, shape, rule) in [("softmax", "x=99999999999x99999999999", "shape-overflow"), ("softmax", "x=4294967296x8", "hbm-budget"), ("router_topk", "logits=1099511627776x8", "hbm-budget")] {
        cli_rejects(&["emit", op, "--shape", shape, "--out", out], &[rule]);
    }
    assert!(std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0) == 0, "rejected emits wrote files");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cli_run_zero_reference_passes() {
    let (code, stdout, stderr) = cli(&["run", "flash_attention_bwd", "--case", "causal", "--shape", "q=1x1x1x128", "--shape", "k=1x1x1x128", "--shape", "v=1x1x1x128", "--shape", "o=1x1x1x128", "--shape", "lse=1x1x1", "--shape", "do=1x1x1x128"]);
    assert!(code == 0 && stdout.contains(" ok"), "{stdout}\n{stderr}");
}

/// `tessera cost` profiles a kernel with a dynamic grid dim (gmm's visit axis) without
/// libtpu's static estimate, which cannot see the trip count and costs a minute or more per
/// target there: its cycles are `-`, its bundles and VMEM the LLO's, its time the IR's
/// model; the fixed-grid metadata kernel beside it keeps its estimate. Both targets in well
/// under the ~65 s one profiled gmm kernel took.
#[test]
fn cli_cost_skips_the_blind_estimate_of_a_dynamic_grid() {
    if !tessera_tests::oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 to compile with libtpu");
        return;
    }
    let started = std::time::Instant::now();
    let (code, out, err) = cli(&["cost", "gmm", "--case", "default", "--dtype", "bf16", "--target", "v5e", "--target", "v6e"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(started.elapsed().as_secs() < 50, "took {:?}:\n{err}", started.elapsed());
    for target in ["v5e", "v6e"] {
        let row = |kernel: &str| out.lines().find(|l| l.starts_with(target) && l.contains(kernel)).unwrap_or_else(|| panic!("no {target} {kernel} row:\n{out}")).split_whitespace().map(str::to_string).collect::<Vec<_>>();
        // target, kernel, dtype, cycles, +outside, bundles, vspill, sspill, VMEM MiB, est us, ...
        let gmm = row("gmm-gmm_kernel");
        assert_eq!((gmm[3].as_str(), gmm[4].as_str(), gmm[9].as_str()), ("-", "-", "-"), "{gmm:?}");
        assert!(gmm[5].parse::<u64>().unwrap() > 100 && gmm[8].parse::<f64>().unwrap() > 0.0, "{gmm:?}");
        assert!(gmm.iter().any(|c| c == "hbm" || c == "compute") && out.contains("time from the IR's model"), "{out}");
        let meta = row("gmm-group_metadata_kernel");
        assert!(meta[3].parse::<u64>().unwrap() > 0, "{meta:?}");
    }
}
