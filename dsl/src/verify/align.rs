//! A small divisibility analysis over the IR: for every i32 value, a power of two it is
//! always a multiple of. Mosaic must *prove* a dynamic offset aligned before it loads,
//! stores or copies at it (`E2003 ... UnprovenMemoryAccessAlignment`, "Offsets along tiled
//! dimensions must be aligned"), so the verifier asks this analysis, and the Mosaic
//! emitter passes what it proves on as `tpu.assume_multiple`, so libtpu accepts exactly
//! what the verifier accepts.
//!
//! Only powers of two are tracked (the alignments TPUs need are 8, 32, 128...), as known
//! trailing zero bits, which keeps every rule exact under i32 wrap-around:
//!
//! | value                       | known trailing zeros                          |
//! |-----------------------------|-----------------------------------------------|
//! | constant `c`                | those of `c` (all 32 for 0)                   |
//! | `a + b`, `a - b`            | min(a, b): a sum of multiples of 8 is one     |
//! | `a * b`                     | a + b: a multiple of 8 times anything is one  |
//! | `a / 2^k` (constant)        | a - k, when a >= k (the division is exact)    |
//! | `a % b`, `min`, `max`, `select`, `if` results | min of the candidates        |
//! | `a & b`                     | max(a, b)                                     |
//! | `num_programs(d)`           | those of the grid extent                      |
//! | loop variable `lo + i*step` | min(lo, step)                                 |
//! | loop carry                  | min over its start and every value it takes (a fixpoint) |
//! | i8 -> i32 cast              | those of the operand                          |
//! | `program_id`, SMEM loads, anything else | 0: nothing known              |

use crate::ir::*;
use crate::types::DType;

/// Known power-of-two factors of a kernel's values.
pub struct Multiples {
    /// Known trailing zero bits per value, 0..=32.
    tz: Vec<u8>,
}

impl Multiples {
    pub fn of(k: &Kernel) -> Multiples {
        let mut m = Multiples { tz: vec![0; k.values.len()] };
        m.block(k, k.body);
        m
    }

    /// The largest power of two `v` is known to be a multiple of (1: nothing known;
    /// `2^32`: `v` is zero).
    pub fn multiple(&self, v: Value) -> u64 {
        1u64 << self.tz.get(v.index()).copied().unwrap_or(0)
    }

    /// Whether `v` is provably a multiple of the power of two `n`.
    pub fn proves(&self, v: Value, n: usize) -> bool {
        n <= 1 || self.multiple(v).is_multiple_of(n as u64)
    }

    fn get(&self, v: Value) -> u8 {
        self.tz[v.index()]
    }

    fn set(&mut self, v: Value, tz: u8) {
        self.tz[v.index()] = tz.min(32);
    }

    /// Runs `b`; returns the known zeros of what its `Yield` yields.
    fn block(&mut self, k: &Kernel, b: BlockId) -> Vec<u8> {
        let mut yielded = Vec::new();
        for &i in &k.block(b).insts {
            let d = k.inst(i);
            if let Inst::Yield(vals) = &d.inst {
                yielded = vals.iter().map(|&v| self.get(v)).collect();
                continue;
            }
            self.inst(k, d);
        }
        yielded
    }

    fn inst(&mut self, k: &Kernel, d: &InstData) {
        // Control flow first: an `if` or loop without results still has values inside.
        if matches!(d.inst, Inst::If { .. } | Inst::For { .. }) {
            return self.region(k, d);
        }
        let Some(&r) = d.results.first() else { return };
        let tz = match &d.inst {
            Inst::Const(Scalar::Int(c)) => trailing_zeros(*c),
            Inst::NumPrograms(a) => k.grid.get(*a).map_or(0, |g| trailing_zeros(g.extent as i64)),
            Inst::Binary(op, a, b) => {
                let (ta, tb) = (self.get(*a), self.get(*b));
                match op {
                    BinaryOp::Add | BinaryOp::Sub | BinaryOp::Rem | BinaryOp::Max | BinaryOp::Min | BinaryOp::Or | BinaryOp::Xor => ta.min(tb),
                    BinaryOp::Mul => ta.saturating_add(tb),
                    BinaryOp::And => ta.max(tb),
                    BinaryOp::Div => match k.as_const(*b) {
                        Some(Scalar::Int(c)) if c > 0 && (c as u64).is_power_of_two() && ta as u32 >= c.trailing_zeros() => ta - c.trailing_zeros() as u8,
                        _ => 0,
                    },
                    BinaryOp::Pow => 0,
                    // By an amount in range: `x << c` is `x * 2^c`, `x >> c` divides a
                    // multiple of `2^ta` by `2^c` exactly (as unsigned bits too).
                    BinaryOp::Shl | BinaryOp::Shr | BinaryOp::ShrLogical => match k.as_const(*b) {
                        Some(Scalar::Int(c)) if (0..k.ty(r).dtype.bits() as i64).contains(&c) => {
                            if *op == BinaryOp::Shl { ta.saturating_add(c as u8) } else { ta.saturating_sub(c as u8) }
                        }
                        _ => 0,
                    },
                }
            }
            Inst::Select { on_true, on_false, .. } => self.get(*on_true).min(self.get(*on_false)),
            // Sign extension keeps the value; truncation to i8 keeps the low 8 bits.
            Inst::Cast(x) if k.ty(*x).dtype.is_int() => self.get(*x).min(if k.ty(r).dtype == DType::I8 { 8 } else { 32 }),
            Inst::Unary(UnaryOp::Neg, x) => self.get(*x),
            _ => 0,
        };
        // Only integer values carry divisibility.
        let tz = if k.ty(r).dtype == DType::I32 || k.ty(r).dtype == DType::I8 { tz } else { 0 };
        self.set(r, tz);
    }

    /// An `if` or a loop: its blocks, then its results.
    fn region(&mut self, k: &Kernel, d: &InstData) {
        match &d.inst {
            Inst::If { then_block, else_block, .. } => {
                let t = self.block(k, *then_block);
                let e = self.block(k, *else_block);
                for (i, &res) in d.results.iter().enumerate() {
                    let z = t.get(i).copied().unwrap_or(0).min(e.get(i).copied().unwrap_or(0));
                    self.set(res, z);
                }
            }
            Inst::For { lo, step, init, body, .. } => {
                let params = k.block(*body).params.clone();
                let iv = self.get(*lo).min(trailing_zeros(*step));
                self.set(params[0], iv);
                let mut carries: Vec<u8> = init.iter().map(|&v| self.get(v)).collect();
                // Known zeros only decrease, so this settles within 33 rounds.
                loop {
                    for (p, &c) in params[1..].iter().zip(&carries) {
                        self.set(*p, c);
                    }
                    let y = self.block(k, *body);
                    let next: Vec<u8> = carries.iter().enumerate().map(|(i, &c)| c.min(y.get(i).copied().unwrap_or(0))).collect();
                    if next == carries {
                        break;
                    }
                    carries = next;
                }
                for (&res, &c) in d.results.iter().zip(&carries) {
                    self.set(res, c);
                }
            }
            _ => {}
        }
    }
}

fn trailing_zeros(c: i64) -> u8 {
    // i32 semantics: the low 32 bits decide divisibility by powers of two up to 2^32.
    (c as i32 as u32).trailing_zeros().min(32) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::KernelBuilder;
    use crate::types::Semantics;

    fn analyse(f: impl FnOnce(&mut KernelBuilder) -> Vec<Value>) -> Vec<u64> {
        let mut b = KernelBuilder::new("t");
        b.grid(&[(4, Semantics::Arbitrary)]);
        let vals = f(&mut b);
        let k = b.finish().unwrap();
        let m = Multiples::of(&k);
        vals.iter().map(|&v| m.multiple(v)).collect()
    }

    #[test]
    fn products_sums_and_constants() {
        let got = analyse(|b| {
            let p = b.program_id(0);
            let p8 = b.mul(p, 8);
            let s = b.add(p8, 16);
            let t = b.add(p8, 4);
            let p3 = b.mul(p, 3);
            let n = b.num_programs(0);
            let q = b.mul(p8, p3);
            let h = b.div(s, 2);
            vec![p, p8, s, t, p3, n, q, h]
        });
        assert_eq!(got, vec![1, 8, 8, 4, 1, 4, 8, 4]);
    }

    #[test]
    fn loops_and_branches() {
        let got = analyse(|b| {
            let zero = b.i32(0);
            let mut seen = vec![];
            let out = b.for_range(0, 64, 16, &[zero], |b, i, c| {
                seen.push(i);
                let next = b.add(c[0], 32);
                vec![next]
            });
            let p = b.program_id(0);
            let c = b.cmp(CmpOp::Eq, p, 0);
            let r = b.if_else(c, |b| vec![b.i32(64)], |b| vec![b.i32(8)]);
            vec![seen[0], out[0], r[0]]
        });
        assert_eq!(got, vec![16, 32, 8]);
    }

    #[test]
    fn a_carry_that_loses_alignment_is_not_trusted() {
        let got = analyse(|b| {
            let zero = b.i32(0);
            let out = b.for_range(0, 4, 1, &[zero], |b, _, c| vec![b.add(c[0], 3)]);
            vec![out[0]]
        });
        assert_eq!(got, vec![1]);
    }
}
