//! The op table is consistent with itself, so everything that reads it (the CLI, the torch
//! package's fakes and autograd, the tests, the docs) can trust it: every schema parses and
//! names the entry's inputs; every case's statics parse and its plan builds and verifies on
//! every target; the declared output shapes and dtypes (the torch fakes) are the plan's
//! result types; every backward names an op of the table whose results map onto the
//! forward's inputs; and every op's smallest case matches its independent reference.
//! (The docs show the table through `tessera table --ops`, which prints it, rather than a
//! copy that adding an op would leave stale.)

use tessera_dsl::{DType, Interpreter, Target, Type};
use tessera_kernels::op::{eval_dtype, eval_shape, ArgType, Schema, COMPOSITE};
use tessera_kernels::{find, harness, library, Op};

fn schema(op: &Op) -> Schema {
    Schema::parse(op.schema).unwrap_or_else(|e| panic!("{}: {e}", op.name))
}

#[test]
fn schemas_name_the_inputs_and_outputs() {
    let mut names = std::collections::HashSet::new();
    for op in library() {
        assert!(names.insert(op.name), "two ops are called {}", op.name);
        let s = schema(op);
        let tensors: Vec<&str> = s.tensors().map(|p| p.name.as_str()).collect();
        let inputs: Vec<&str> = op.inputs.iter().map(|i| i.name).collect();
        assert_eq!(tensors, inputs, "{}: the schema's tensors and the entry's inputs differ", op.name);
        assert_eq!(s.results, op.outputs.len(), "{}: the schema returns {} results, the entry declares {}", op.name, s.results, op.outputs.len());
        assert!(!op.doc.is_empty(), "{} has no doc", op.name);
        match op.alias_of {
            Some((of, i)) => {
                let target = find(of).unwrap_or_else(|| panic!("{} aliases unknown op {of}", op.name));
                assert!(i < target.outputs.len(), "{}: {of} has no result {i}", op.name);
                assert_eq!(schema(target).params, s.params, "{}: an alias takes its op's arguments", op.name);
            }
            None => assert!(!op.cases.is_empty(), "{} has no case to run", op.name),
        }
    }
}

#[test]
fn output_expressions_are_the_plans_result_types() {
    for op in library() {
        let source = op.alias_of.and_then(|(of, _)| find(of)).unwrap_or(op);
        for case in source.cases {
            let statics = op.case_statics(case).unwrap_or_else(|e| panic!("{e}"));
            let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
            for dtype in [DType::F32, DType::BF16] {
                let types = op.types(&shapes, dtype);
                for target in Target::ALL {
                    let plan = op.plan_for(&types, &statics, &target).unwrap_or_else(|e| panic!("{} {}: {e}", op.name, case.name));
                    for launch in &plan.launches {
                        tessera_dsl::verify::verify(&launch.kernel, &target).unwrap_or_else(|e| panic!("{} {} on {target}: {e}", op.name, case.name));
                    }
                    let names: Vec<&str> = op.inputs.iter().map(|i| i.name).collect();
                    assert_eq!(plan.results.len(), op.outputs.len(), "{} {}", op.name, case.name);
                    for (out, res) in op.outputs.iter().zip(&plan.results) {
                        let shape = eval_shape(out.shape, &names, &types, &statics).unwrap_or_else(|e| panic!("{} output {}: {e}", op.name, out.name));
                        let dt = eval_dtype(out.dtype, &names, &types).unwrap_or_else(|e| panic!("{} output {}: {e}", op.name, out.name));
                        assert_eq!(Type::vector(dt, &shape), res.ty, "{} {} {dtype}: output `{}` is declared {} / {}", op.name, case.name, out.name, out.shape, out.dtype);
                    }
                }
            }
        }
    }
}

#[test]
fn backwards_name_ops_whose_results_are_input_gradients() {
    for op in library() {
        let Some(b) = op.backward else { continue };
        let s = schema(op);
        let inputs: Vec<&str> = op.inputs.iter().map(|i| i.name).collect();
        for g in b.grads.iter().flat_map(|g| g.split_whitespace()) {
            assert!(inputs.contains(&g), "{}: the backward gives a gradient for `{g}`, which is not a tensor input", op.name);
        }
        if b.op == COMPOSITE {
            continue;
        }
        let bwd = find(b.op).unwrap_or_else(|| panic!("{}: backward op {} is not in the table", op.name, b.op));
        assert_eq!(schema(bwd).results, b.grads.len(), "{}: {} returns {} results for {} gradients", op.name, b.op, schema(bwd).results, b.grads.len());
        let outputs: Vec<&str> = op.outputs.iter().map(|o| o.name).collect();
        let args: Vec<&str> = b.args.split(',').map(str::trim).collect();
        let bwd_params = &schema(bwd).params;
        assert!(args.len() <= bwd_params.len(), "{}: {} takes {} arguments", op.name, b.op, bwd_params.len());
        for (a, p) in args.iter().zip(bwd_params) {
            let known = inputs.contains(a) || outputs.contains(a) || s.statics().any(|q| q.name == *a) || a.strip_prefix("d_").is_some_and(|o| outputs.contains(&o));
            assert!(known, "{}: backward argument `{a}` is neither an input, an output, a static nor `d_<output>`", op.name);
            let is_tensor = !s.statics().any(|q| q.name == *a);
            assert_eq!(is_tensor, p.ty == ArgType::Tensor, "{}: `{a}` fills {}'s argument `{}` of another kind", op.name, b.op, p.name);
        }
    }
}

/// The smallest case of every op, f32 and bf16, on the interpreter against the op's
/// independent f64 reference (`tessera run --all` covers every case at full size); the ops
/// shared among a thread per core.
#[test]
fn every_op_matches_its_reference_at_its_smallest_case() {
    let ops: Vec<&'static Op> = library().collect();
    let failures: Vec<String> = tessera_tests::par_map(&ops, |&op| {
        let source = op.alias_of.and_then(|(of, _)| find(of)).unwrap_or(op);
        let case = source.cases.iter().min_by_key(|c| c.shapes.iter().map(|s| s.iter().product::<usize>()).sum::<usize>()).unwrap();
        let shapes: Vec<Vec<usize>> = case.shapes.iter().map(|s| s.to_vec()).collect();
        [DType::F32, DType::BF16]
            .into_iter()
            .filter_map(|dtype| match harness::run_case(op, &op.case_statics(case).unwrap(), &shapes, dtype, &Target::V5E, 11, &Interpreter) {
                Ok(r) if r.passed() => None,
                Ok(r) => Some(format!("{} {} {dtype}: {:?}", op.name, case.name, r.worst())),
                Err(e) => Some(format!("{} {} {dtype}: {e}", op.name, case.name)),
            })
            .collect::<Vec<_>>()
    })
    .concat();
    assert!(failures.is_empty(), "{} op cases differ from their references:\n{}", failures.len(), failures.join("\n"));
}

/// Every tuning knob (`tessera_kernels::tune`) names an int or int-list static of its op,
/// and every candidate's statics parse against the schema.
#[test]
fn tune_knobs_are_statics_of_their_ops() {
    let mut tuned = 0;
    for op in library() {
        let knobs = op.knobs;
        for k in knobs {
            let p = schema(op).statics().find(|p| p.name == k.name).cloned().unwrap_or_else(|| panic!("{}: knob `{}` is not a static of the op", op.name, k.name));
            assert!(matches!(p.ty, ArgType::Int | ArgType::Ints), "{}: knob `{}` is {:?}", op.name, k.name, p.ty);
        }
        for c in tessera_kernels::tune::candidates(op, &[]) {
            op.statics(&c).unwrap_or_else(|e| panic!("{}: candidate `{c}`: {e}", op.name));
        }
        tuned += usize::from(!knobs.is_empty());
    }
    assert!(tuned >= 7, "only {tuned} ops have tuning knobs");
    // The product, the last knob fastest; a fixed knob drops out.
    let fa = find("flash_attention_fwd").unwrap();
    let all = tessera_kernels::tune::candidates(fa, &[]);
    assert_eq!((all.len(), all[0].as_str(), all[1].as_str()), (16, "block_q=128, block_kv=128", "block_q=128, block_kv=256"));
    assert_eq!(tessera_kernels::tune::candidates(fa, &["block_q"]).len(), 4);
}

/// The shipped tuning table (kernels/tuned.json) is what the library's defaults read: each
/// entry names an op, a target and shapes whose plan, with the knobs unset, is the plan of
/// the entry's best statics given explicitly (and verifies); a shape the table lacks keeps
/// the op's own defaults.
#[test]
fn shipped_tuning_table_sets_the_defaults_it_holds() {
    let table = tessera_kernels::tune::table();
    for e in table {
        let op = find(&e.op).unwrap_or_else(|| panic!("tuned.json: no op `{}`", e.op));
        let target = Target::by_name(&e.target).unwrap_or_else(|| panic!("tuned.json: no target `{}`", e.target));
        let dtype = DType::parse(&e.dtype).unwrap();
        let shapes: Vec<Vec<usize>> = op.inputs.iter().map(|i| e.shapes.iter().find(|(n, _)| n == i.name).map(|(_, s)| s.clone()).unwrap_or_default()).collect();
        let given = e.shapes.len();
        let types = op.types(&shapes[..given], dtype);
        let unset = op.statics(&e.statics).unwrap();
        let best = e.best.as_deref().unwrap_or_else(|| panic!("tuned.json: the {} entry on {} keeps the rule; ship only entries that set blocks", e.op, e.target));
        let explicit = op.statics(&format!("{}, {best}", e.statics)).unwrap();
        let by_table = op.plan_for(&types, &unset, &target).unwrap_or_else(|err| panic!("{}: {err}", e.op));
        let by_hand = op.plan_for(&types, &explicit, &target).unwrap();
        let ir = |p: &tessera_kernels::Plan| p.launches.iter().map(|l| format!("{:?}", l.kernel)).collect::<Vec<_>>();
        assert_eq!(ir(&by_table), ir(&by_hand), "{} on {}: the table's blocks ({best}) are not the defaults", e.op, e.target);
        for l in &by_table.launches {
            tessera_dsl::verify::verify(&l.kernel, &target).unwrap();
        }
        // Another batch: not in the table, so the op's own defaults.
        let mut other = shapes[..given].to_vec();
        other[0][0] += 1;
        let other_types = op.types(&other, dtype);
        assert!(tessera_kernels::tune::tuned_statics(op, &other_types, &unset, target.name).unwrap().is_none());
    }
    assert!(table.iter().any(|e| e.op == "flash_attention_fwd"), "the table ships flash attention's blocks");
    // The differentiable alias takes its source's entries.
    let (fwd, alias) = (find("flash_attention_fwd").unwrap(), find("flash_attention").unwrap());
    let e = table.iter().find(|e| e.op == "flash_attention_fwd").unwrap();
    let shapes: Vec<Vec<usize>> = ["q", "k", "v"].iter().map(|n| e.shapes.iter().find(|(m, _)| m == n).unwrap().1.clone()).collect();
    let types = fwd.types(&shapes, DType::parse(&e.dtype).unwrap());
    assert_eq!(tessera_kernels::tune::tuned_statics(alias, &types, &alias.statics(&e.statics).unwrap(), &e.target).unwrap(), e.best);
}

/// A table sets blocks and nothing else: an entry whose `best` names another static (a
/// hand-edited `causal=False` would compute non-causal attention for a causal call) is refused
/// when the call looks it up, and blocks a call cannot use say which table they came from.
#[test]
fn a_tuning_table_sets_only_blocks_and_names_itself_in_errors() {
    let op = find("flash_attention_fwd").unwrap();
    let entry = |seq: usize, best: &str| {
        format!(
            r#"{{"format": 1, "entries": [{{"op": "flash_attention_fwd", "case": "causal", "target": "v5e", "dtype": "bf16",
               "shapes": {{"q": [1, 2, {seq}, 128], "k": [1, 2, {seq}, 128], "v": [1, 2, {seq}, 128]}},
               "statics": "causal=True, sm_scale=None, soft_cap=None, window_left=None, window_right=None, block_q=None, block_kv=None",
               "best": "{best}"}}]}}"#
        )
    };
    // Shapes no other test plans (the table is process-wide).
    let plan = |seq: usize| {
        let shapes = vec![vec![1, 2, seq, 128]; 3];
        op.plan_for(&op.types(&shapes, DType::BF16), &op.statics("causal=True").unwrap(), &Target::V5E)
    };
    tessera_kernels::tune::add_table(&entry(384, "block_q=128, causal=False"), "edited.json").unwrap();
    let Err(err) = plan(384) else { panic!("an entry setting `causal` was taken") };
    assert_eq!(err.rule, "tuning-table", "{err}");
    assert!(err.to_string().contains("edited.json") && err.to_string().contains("causal=False"), "{err}");
    tessera_kernels::tune::add_table(&entry(640, "block_q=100, block_kv=128"), "bad-blocks.json").unwrap();
    let Err(err) = plan(640) else { panic!("block_q = 100 planned") };
    assert!(err.to_string().contains("from the tuning table bad-blocks.json"), "{err}");
    tessera_kernels::tune::add_table(&entry(896, "block_q=128, block_kv=128"), "good.json").unwrap();
    assert!(plan(896).is_ok());
    // A null `best` (the rule won that run) holds the call against earlier tables.
    let ir = |p: tessera_kernels::Plan| p.launches.iter().map(|l| format!("{:?}", l.kernel)).collect::<Vec<_>>();
    let rule = ir(op.plan_by_rule(&op.types(&vec![vec![1, 2, 1152, 128]; 3], DType::BF16), &op.statics("causal=True").unwrap(), &Target::V5E).unwrap());
    assert_eq!(tessera_kernels::tune::add_table(&entry(1152, "block_q=128, block_kv=128"), "old.json").unwrap(), 1);
    assert_ne!(ir(plan(1152).unwrap()), rule, "the old table's 128 x 128 are not the rule's blocks");
    let null = entry(1152, "").replace(r#""best": """#, r#""best": null"#);
    assert_eq!(tessera_kernels::tune::add_table(&null, "new.json").unwrap(), 0, "a null entry sets no blocks");
    assert_eq!(ir(plan(1152).unwrap()), rule);
    // An entry tuned through the alias (`tessera tune flash_attention`) serves the op too.
    let rule = ir(op.plan_by_rule(&op.types(&vec![vec![1, 2, 1408, 128]; 3], DType::BF16), &op.statics("causal=True").unwrap(), &Target::V5E).unwrap());
    let by_alias = entry(1408, "block_q=128, block_kv=128").replace(r#""op": "flash_attention_fwd""#, r#""op": "flash_attention""#);
    tessera_kernels::tune::add_table(&by_alias, "alias.json").unwrap();
    assert_ne!(ir(plan(1408).unwrap()), rule, "the alias's entry was not taken");
    for (edit, to, says) in [(r#""dtype": "bf16""#, r#""dtype": "bf17""#, "not a float dtype"), (r#""target": "v5e""#, r#""target": "v9""#, "not a TPU generation"), ("block_q=128, block_kv=128", "block_q=128, block_q=256", "sets `block_q` twice")] {
        let err = tessera_kernels::tune::add_table(&entry(1408, "block_q=128, block_kv=128").replace(edit, to), "typo.json").expect_err(says);
        assert!(err.to_string().contains(says) && err.to_string().contains("entry 0"), "{err}");
    }
    // A malformed entry is an error naming it, not a line silently skipped.
    for (edit, says) in [(r#""dtype": "bf16""#, "`dtype` is null"), (r#""k": [1, 2, 1152, 128]"#, "the shape of `k`")] {
        let bad = entry(1152, "block_q=128, block_kv=128").replace(edit, if says.starts_with("`dtype`") { r#""dtype": null"# } else { r#""k": [1, -2, 1152, 128]"# });
        let err = tessera_kernels::tune::add_table(&bad, "typo.json").expect_err(says);
        assert_eq!(err.rule, "tuning-table", "{err}");
        assert!(err.to_string().contains("typo.json") && err.to_string().contains("entry 0 (`flash_attention_fwd`)") && err.to_string().contains(says), "{err}");
    }
}

/// matmul's default blocks follow the target's ridge (v6e, where HBM binds at 512 x 1024
/// output tiles, takes 2048-row tiles with bk 1024 once the problem has rows for two steps,
/// raising the kernel's VMEM limit past the default scoped 32 MiB; the other
/// generations keep (512, 1024, 1024)); given blocks win; partial m / n blocks compute the
/// right product and a k block that does not divide k is refused.
#[test]
fn matmul_blocks_follow_the_ridge_and_the_statics() {
    let op = find("matmul").unwrap();
    let blocks = |n: usize, dtype: DType, statics: &str, target: &Target| {
        let plan = op.plan_for(&op.types(&[vec![n, n], vec![n, n]], dtype), &op.statics(statics).unwrap(), target).unwrap();
        let ir = plan.launches[0].kernel.to_string();
        let block = |name: &str| ir.lines().find(|l| l.contains(name)).and_then(|l| l.split("block ").nth(1)).and_then(|b| b.split(' ').next()).unwrap().to_string();
        (block("@0 x:"), block("@1 y:"))
    };
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(blocks(4096, DType::BF16, "", &Target::V6E), s("[2048,1024]", "[1024,1024]"));
    assert_eq!(blocks(2048, DType::BF16, "", &Target::V6E), s("[1024,1024]", "[1024,1024]"));
    assert_eq!(blocks(1024, DType::BF16, "", &Target::V6E), s("[512,1024]", "[1024,1024]"));
    for t in [Target::V5E, Target::V5P, Target::TPU7X] {
        assert_eq!(blocks(4096, DType::BF16, "", &t), s("[512,1024]", "[1024,1024]"), "{}", t.name);
    }
    assert_eq!(blocks(4096, DType::BF16, "block_m=256, block_k=512, block_n=2048", &Target::V6E), s("[256,512]", "[512,2048]"));
    // An m whose divisors are far below the tile: all of it under two tiles (libtpu's estimate
    // on v6e, 1000 x 4096 x 4096 bf16: 45.9 us against 127.3 us for 200-row blocks, y re-read
    // five times), else whole tiles and a partial last block.
    let rows = |m: usize, target: &Target| {
        let plan = op.plan_for(&op.types(&[vec![m, 4096], vec![4096, 4096]], DType::BF16), &op.statics("").unwrap(), target).unwrap();
        plan.launches[0].kernel.to_string().lines().find(|l| l.contains("@0 x:")).and_then(|l| l.split("block [").nth(1)).and_then(|b| b.split(',').next()).unwrap().parse::<usize>().unwrap()
    };
    assert_eq!((rows(1000, &Target::V6E), rows(600, &Target::V5E), rows(2600, &Target::V5E), rows(3000, &Target::V6E)), (1000, 600, 512, 1000));
    let limit = |n: usize, target: &Target| op.plan_for(&op.types(&[vec![n, n], vec![n, n]], DType::BF16), &op.statics("").unwrap(), target).unwrap().launches[0].kernel.vmem_limit_bytes;
    assert!(limit(8192, &Target::V6E).is_some_and(|b| b > 32 << 20), "the tall tile raises the limit");
    assert_eq!(limit(8192, &Target::V5E), None, "(512, 1024, 1024) fits v5e's default scoped VMEM");
    // Partial m and n blocks against the f64 reference, on the interpreter.
    let shapes = [vec![300, 256], vec![256, 200]];
    let statics = op.statics("block_m=128, block_k=128, block_n=128").unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let report = harness::run_case(op, &statics, &shapes, dtype, &Target::V6E, 5, &Interpreter).unwrap();
        assert!(report.passed(), "{dtype}: {:?}", report.worst());
    }
    let err = |statics: &str| op.plan_for(&op.types(&shapes, DType::F32), &op.statics(statics).unwrap(), &Target::V6E).err().expect("refused");
    let e = err("block_k=96");
    assert_eq!((e.rule, e.subject.as_str()), ("option-value", "argument `block_k`"), "{e}");
    assert!(e.to_string().contains("does not divide k = 256"), "{e}");
    assert_eq!(err("block_m=0").rule, "option-value");
    // Zero and negative blocks alike ask for a positive one.
    for bad in ["block_m=0", "block_n=-4"] {
        let e = err(bad);
        assert!(e.rule == "option-value" && e.help.starts_with("pass a positive"), "{bad}: {e}");
    }
    // A block the windows cannot take names the op's argument (was the verifier's
    // `matmul_kernel`, input `y`); one far past its dim is refused up front (was a VMEM
    // value-size error).
    let e = err("block_n=1");
    assert_eq!((e.kernel.as_str(), e.rule, e.subject.as_str()), ("matmul", "block-tiling", "argument `block_n`"), "{e}");
    assert!(e.to_string().contains("use a multiple of 128 up to 256, or 200"), "{e}");
    let e = err("block_m=1048576");
    assert_eq!((e.rule, e.subject.as_str()), ("block-shape", "argument `block_m`"), "{e}");
    assert!(e.to_string().contains("larger than m = 300") && e.to_string().contains("up to 304, or 300"), "{e}");
    assert!(op.plan_for(&op.types(&shapes, DType::F32), &op.statics("block_m=304, block_n=200").unwrap(), &Target::V6E).is_ok());
}
