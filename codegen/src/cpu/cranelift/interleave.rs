//! Instruction order within a block, after Cranelift's mid-end and before its backend.
//!
//! Cranelift's optimiser (the e-graph pass) re-emits every pure instruction depth-first
//! at its first use, and its backend keeps that order. A fused elementwise loop body
//! evaluates several chunks of lanes (`lower`'s `UNROLL`); depth-first, all of one
//! chunk's chain comes before the next one's. A chain of transcendentals is a few hundred
//! instructions long and mostly serial, so the CPU's reorder window sees one chunk at a
//! time and waits on latencies (the 8-op chain of `scripts/bench_fusion.py` ran at ~1.6
//! instructions per cycle). [`interleave`] re-orders each block by list scheduling: of the
//! instructions whose operands are ready it takes the one with the longest latency path to
//! the block's end, so independent chains alternate and their latencies overlap.
//!
//! The order changes nothing else:
//! - data dependencies within the block are kept;
//! - memory is kept in order: stores, calls and other side effects stay in their order,
//!   and loads stay between the same two of them (loads may swap with each other);
//! - the terminator stays last;
//! - constants (instructions without operands) are placed just before their first use,
//!   so scheduling does not lengthen their live ranges (a constant hoisted to the top of a
//!   block would hold a register through it, or be spilled).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use cranelift_codegen::ir::{Block, Function, Inst, Opcode, ValueDef};

/// Rough latencies in cycles (x86-64 FP units), enough to rank chains by length.
fn latency(op: Opcode) -> u32 {
    use Opcode::*;
    match op {
        Fdiv | Sqrt => 12,
        Fma | Fmul | Fadd | Fsub => 4,
        Call | CallIndirect => 20,
        Imul => 3,
        _ if op.can_load() => 5,
        _ => 1,
    }
}

/// What an instruction is to the memory order.
#[derive(Clone, Copy, PartialEq)]
enum Mem {
    /// Pure: only its operands order it.
    None,
    /// Reads memory: after the last barrier, before the next.
    Load,
    /// A store, call, trap or other side effect: in order with every memory instruction.
    Barrier,
}

fn mem(op: Opcode) -> Mem {
    if op.can_store() || op.is_call() || op.other_side_effects() || (op.can_trap() && !op.can_load()) {
        Mem::Barrier
    } else if op.can_load() {
        Mem::Load
    } else {
        Mem::None
    }
}

/// Re-orders the instructions of every block of `func` (see the module docs).
pub fn interleave(func: &mut Function) {
    let blocks: Vec<Block> = func.layout.blocks().collect();
    for block in blocks {
        schedule_block(func, block);
    }
}

fn schedule_block(func: &mut Function, block: Block) {
    let insts: Vec<Inst> = func.layout.block_insts(block).collect();
    let n = insts.len();
    if n < 3 {
        return;
    }
    let Some((&term, body)) = insts.split_last() else { return };
    if !func.dfg.insts[term].opcode().is_terminator() {
        return;
    }
    let pos: HashMap<Inst, usize> = body.iter().enumerate().map(|(i, &x)| (x, i)).collect();
    let op = |i: usize| func.dfg.insts[body[i]].opcode();
    // A constant: no operands, no memory effect; placed at its first use instead.
    let is_const: Vec<bool> = (0..body.len()).map(|i| mem(op(i)) == Mem::None && func.dfg.inst_values(body[i]).next().is_none()).collect();

    // Edges `pred -> succ` within the body (constants excluded: they have no operands and
    // are emitted with their users).
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); body.len()];
    let mut npreds = vec![0usize; body.len()];
    let mut consts_of: Vec<Vec<usize>> = vec![Vec::new(); body.len()];
    let mut last_barrier: Option<usize> = None;
    let mut loads_since: Vec<usize> = Vec::new();
    for i in 0..body.len() {
        if is_const[i] {
            continue;
        }
        let mut preds: Vec<usize> = Vec::new();
        for v in func.dfg.inst_values(body[i]) {
            if let ValueDef::Result(d, _) = func.dfg.value_def(v) {
                if let Some(&p) = pos.get(&d) {
                    if is_const[p] {
                        if !consts_of[i].contains(&p) {
                            consts_of[i].push(p);
                        }
                    } else {
                        preds.push(p);
                    }
                }
            }
        }
        match mem(op(i)) {
            Mem::None => {}
            Mem::Load => {
                preds.extend(last_barrier);
                loads_since.push(i);
            }
            Mem::Barrier => {
                preds.extend(last_barrier);
                preds.append(&mut loads_since);
                last_barrier = Some(i);
            }
        }
        preds.sort_unstable();
        preds.dedup();
        for p in preds {
            succs[p].push(i);
            npreds[i] += 1;
        }
    }

    // Priority: the longest latency path from an instruction to the end of the block.
    let mut prio = vec![0u32; body.len()];
    for i in (0..body.len()).rev() {
        let tail = succs[i].iter().map(|&s| prio[s]).max().unwrap_or(0);
        prio[i] = latency(op(i)) + tail;
    }

    let mut ready: BinaryHeap<(u32, Reverse<usize>)> = (0..body.len()).filter(|&i| !is_const[i] && npreds[i] == 0).map(|i| (prio[i], Reverse(i))).collect();
    let mut placed = vec![false; body.len()];
    let mut order: Vec<usize> = Vec::with_capacity(body.len());
    while let Some((_, Reverse(i))) = ready.pop() {
        for &c in &consts_of[i] {
            if !placed[c] {
                placed[c] = true;
                order.push(c);
            }
        }
        placed[i] = true;
        order.push(i);
        for &s in &succs[i] {
            npreds[s] -= 1;
            if npreds[s] == 0 {
                ready.push((prio[s], Reverse(s)));
            }
        }
    }
    if (0..body.len()).any(|i| !placed[i] && !is_const[i]) {
        // Unreachable in SSA (no cycles within a block); keep the order as it was.
        return;
    }
    // Constants only the terminator uses (or nothing) keep their place before it.
    order.extend((0..body.len()).filter(|&i| !placed[i]));
    if order.iter().enumerate().all(|(k, &i)| k == i) {
        return;
    }
    for &i in body {
        func.layout.remove_inst(i);
    }
    for &i in &order {
        func.layout.insert_inst(body[i], term);
    }
}

#[cfg(test)]
mod tests {
    use cranelift_codegen::ir::types::{F32X4, I64};
    use cranelift_codegen::ir::{AbiParam, Function, InstBuilder, Signature, Value};
    use cranelift_codegen::isa::CallConv;
    use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
    use proptest::prelude::*;

    use super::*;

    /// One step of a random block: a load from `p + 16 * slot`, a store of value `#v` there,
    /// or a binary op (`fdiv` when `slow`) of two earlier vector values.
    #[derive(Clone, Debug)]
    enum Step {
        Load(u8),
        Store(usize, u8),
        Op(usize, usize, bool),
        Const,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..8).prop_map(Step::Load),
            (any::<usize>(), 0u8..8).prop_map(|(v, s)| Step::Store(v, s)),
            (any::<usize>(), any::<usize>(), any::<bool>()).prop_map(|(a, b, s)| Step::Op(a, b, s)),
            Just(Step::Const),
        ]
    }

    fn build(steps: &[Step]) -> Function {
        let mut sig = Signature::new(CallConv::SystemV);
        sig.params.push(AbiParam::new(I64));
        let mut func = Function::with_name_signature(Default::default(), sig);
        let mut fctx = FunctionBuilderContext::new();
        let mut b = FunctionBuilder::new(&mut func, &mut fctx);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let p = b.block_params(entry)[0];
        let mut vals: Vec<Value> = vec![b.ins().f32const(1.0)];
        vals[0] = b.ins().splat(F32X4, vals[0]);
        for s in steps {
            match *s {
                Step::Load(slot) => vals.push(b.ins().load(F32X4, crate::cpu::cranelift::vector::mflags(), p, 16 * slot as i32)),
                Step::Store(v, slot) => {
                    b.ins().store(crate::cpu::cranelift::vector::mflags(), vals[v % vals.len()], p, 16 * slot as i32);
                }
                Step::Op(x, y, slow) => {
                    let (x, y) = (vals[x % vals.len()], vals[y % vals.len()]);
                    vals.push(if slow { b.ins().fdiv(x, y) } else { b.ins().fadd(x, y) });
                }
                Step::Const => {
                    let c = b.ins().f32const(2.5);
                    vals.push(b.ins().splat(F32X4, c));
                }
            }
        }
        b.ins().return_(&[]);
        b.seal_all_blocks();
        b.finalize(super::super::isa(false).expect("host isa").frontend_config());
        func
    }

    /// The memory instructions in order, each load with the number of stores before it.
    fn memory_order(f: &Function) -> (Vec<Inst>, Vec<(Inst, usize)>) {
        let block = f.layout.entry_block().unwrap();
        let (mut stores, mut loads) = (Vec::new(), Vec::new());
        for i in f.layout.block_insts(block) {
            match mem(f.dfg.insts[i].opcode()) {
                Mem::Barrier => stores.push(i),
                Mem::Load => loads.push((i, stores.len())),
                Mem::None => {}
            }
        }
        loads.sort();
        (stores, loads)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        /// Any block stays valid SSA with the terminator last, its stores in order, and each
        /// load between the same two stores.
        #[test]
        fn a_reordered_block_keeps_its_dependencies_and_its_memory_order(steps in proptest::collection::vec(step(), 1..60)) {
            let mut f = build(&steps);
            let before = memory_order(&f);
            let n = f.dfg.num_insts();
            interleave(&mut f);
            let flags = cranelift_codegen::settings::Flags::new(cranelift_codegen::settings::builder());
            if let Err(e) = cranelift_codegen::verify_function(&f, &flags) {
                panic!("{e}\n{}", f.display());
            }
            let block = f.layout.entry_block().unwrap();
            prop_assert_eq!(f.layout.block_insts(block).count(), n);
            prop_assert!(f.dfg.insts[f.layout.last_inst(block).unwrap()].opcode().is_terminator());
            prop_assert_eq!(memory_order(&f), before);
        }
    }

    /// Two independent chains of divisions, written one after the other, alternate.
    #[test]
    fn independent_chains_alternate() {
        let chain = |start: usize| -> Vec<Step> { (0..4).map(|k| Step::Op(start + k, start + k, true)).collect() };
        // Chain A from load 0 (vals[1]), chain B from load 1 (vals[2]); A's ops first.
        let mut steps = vec![Step::Load(0), Step::Load(1), Step::Op(1, 1, true)];
        steps.extend(chain(3));
        steps.push(Step::Op(2, 2, true));
        steps.extend(chain(8));
        steps.push(Step::Store(7, 2));
        steps.push(Step::Store(12, 3));
        let mut f = build(&steps);
        interleave(&mut f);
        let block = f.layout.entry_block().unwrap();
        let divs: Vec<Value> = f.layout.block_insts(block).filter(|&i| f.dfg.insts[i].opcode() == Opcode::Fdiv).map(|i| f.dfg.inst_args(i)[0]).collect();
        // Each division's chain: its operand's root load.
        let root = |mut v: Value| loop {
            let ValueDef::Result(i, _) = f.dfg.value_def(v) else { unreachable!() };
            if f.dfg.insts[i].opcode() == Opcode::Load {
                return i;
            }
            v = f.dfg.inst_args(i)[0];
        };
        let roots: Vec<Inst> = divs.iter().map(|&v| root(v)).collect();
        assert_eq!(roots.len(), 10);
        assert!(roots.windows(2).all(|w| w[0] != w[1]), "the chains did not alternate:\n{}", f.display());
    }
}
