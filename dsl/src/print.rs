//! The IR as text: stable, readable, and what snapshot tests show.

use std::fmt::{self, Write};

use crate::ir::*;
use crate::types::join;

impl fmt::Display for IndexExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexExpr::Grid(n) => write!(f, "g{n}"),
            IndexExpr::Const(c) => write!(f, "{c}"),
            IndexExpr::Prefetch { array, index } => write!(f, "{array}[{}]", join(index, ", ")),
            IndexExpr::Bin(op, a, b) => {
                let sym = match op {
                    IndexOp::Add => "+",
                    IndexOp::Sub => "-",
                    IndexOp::Mul => "*",
                    IndexOp::Div => "/",
                    IndexOp::Rem => "%",
                    IndexOp::Min => return write!(f, "min({a}, {b})"),
                    IndexOp::Max => return write!(f, "max({a}, {b})"),
                };
                write!(f, "({a} {sym} {b})")
            }
        }
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Float(x) => write!(f, "{x:?}"),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Bool(b) => write!(f, "{b}"),
        }
    }
}

fn slices(s: &[Slice]) -> String {
    s.iter().map(|s| if s.stride == 1 { format!("{}:+{}", s.start, s.len) } else { format!("{}:+{}:{}", s.start, s.len, s.stride) }).collect::<Vec<_>>().join(", ")
}

impl Kernel {
    fn print_block(&self, out: &mut String, block: BlockId, depth: usize) -> fmt::Result {
        let pad = "  ".repeat(depth);
        for &id in &self.block(block).insts {
            let d = self.inst(id);
            write!(out, "{pad}")?;
            if !d.results.is_empty() {
                let rs: Vec<String> = d.results.iter().map(|v| format!("{v}: {}", self.ty(*v))).collect();
                write!(out, "{} = ", rs.join(", "))?;
            }
            match &d.inst {
                Inst::Const(s) => write!(out, "const {s}")?,
                Inst::ProgramId(a) => write!(out, "program_id {a}")?,
                Inst::NumPrograms(a) => write!(out, "num_programs {a}")?,
                Inst::Load { src, slices: s } => write!(out, "load {src}[{}]", slices(s))?,
                Inst::Store { dst, slices: s, value } => write!(out, "store {dst}[{}] <- {value}", slices(s))?,
                Inst::Unary(op, x) => write!(out, "{} {x}", op.name())?,
                Inst::Binary(op, a, b) => write!(out, "{} {a}, {b}", op.name())?,
                Inst::Cmp(op, a, b) => write!(out, "cmp.{} {a}, {b}", op.name())?,
                Inst::Select { cond, on_true, on_false } => write!(out, "select {cond}, {on_true}, {on_false}")?,
                Inst::Cast(x) => write!(out, "cast {x}")?,
                Inst::Bitcast(x) => write!(out, "bitcast {x}")?,
                Inst::Broadcast(x) => write!(out, "broadcast {x}")?,
                Inst::Iota { dim } => write!(out, "iota dim={dim}")?,
                Inst::Reduce { op, axis, x } => write!(out, "reduce.{} {x} axis={axis}", op.name())?,
                Inst::Cumsum { axis, x } => write!(out, "cumsum {x} axis={axis}")?,
                Inst::PrngSeed(seeds) => write!(out, "prng_seed {}", join(seeds, ", "))?,
                Inst::PrngRandomBits => write!(out, "prng_random_bits")?,
                Inst::Dot { lhs, rhs, transpose_lhs, transpose_rhs } => {
                    write!(out, "dot {lhs}{}, {rhs}{}", if *transpose_lhs { ".T" } else { "" }, if *transpose_rhs { ".T" } else { "" })?
                }
                Inst::Transpose(x) => write!(out, "transpose {x}")?,
                Inst::Reshape(x) => write!(out, "reshape {x}")?,
                Inst::Item(x) => write!(out, "item {x}")?,
                Inst::Concat { axis, parts } => write!(out, "concat {} axis={axis}", parts.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", "))?,
                Inst::If { cond, then_block, else_block } => {
                    writeln!(out, "if {cond} {{")?;
                    self.print_block(out, *then_block, depth + 1)?;
                    writeln!(out, "{pad}}} else {{")?;
                    self.print_block(out, *else_block, depth + 1)?;
                    write!(out, "{pad}}}")?;
                }
                Inst::For { lo, hi, step, init, body } => {
                    let params = &self.block(*body).params;
                    let carries: Vec<String> = params[1..].iter().zip(init).map(|(p, i)| format!("{p} = {i}")).collect();
                    writeln!(out, "for {} in {lo}..{hi} step {step} carry ({}) {{", params[0], carries.join(", "))?;
                    self.print_block(out, *body, depth + 1)?;
                    write!(out, "{pad}}}")?;
                }
                Inst::DmaStart { src, dst, sem, sem_index, remote: None } => {
                    write!(out, "dma_start {}[{}] -> {}[{}] sem {sem}[{sem_index}]", src.r, slices(&src.slices), dst.r, slices(&dst.slices))?
                }
                Inst::DmaStart { src, dst, sem, sem_index, remote: Some(r) } => write!(
                    out,
                    "dma_start {}[{}] -> device {} {}[{}] send {}[{}] recv {sem}[{sem_index}]",
                    src.r,
                    slices(&src.slices),
                    r.device,
                    dst.r,
                    slices(&dst.slices),
                    r.send_sem,
                    r.send_index
                )?,
                Inst::DmaWait { src, dst, sem, sem_index, remote } => {
                    let side = match remote {
                        None => String::new(),
                        Some(RemoteWait { device, side: DmaSide::Send }) => format!("_send device {device}"),
                        Some(RemoteWait { device, side: DmaSide::Recv }) => format!("_recv device {device}"),
                    };
                    write!(out, "dma_wait{side} {}[{}] -> {}[{}] sem {sem}[{sem_index}]", src.r, slices(&src.slices), dst.r, slices(&dst.slices))?
                }
                Inst::DeviceId => write!(out, "device_id")?,
                Inst::SemSignal { sem, amount, device } => {
                    write!(out, "semaphore_signal {} += {amount}", semaphore(sem))?;
                    if let Some(d) = device {
                        write!(out, " on device {d}")?;
                    }
                }
                Inst::SemWait { sem, amount } => write!(out, "semaphore_wait {} -= {amount}", semaphore(sem))?,
                Inst::Yield(vals) if vals.is_empty() => write!(out, "yield")?,
                Inst::Yield(vals) => write!(out, "yield {}", join(vals, ", "))?,
            }
            writeln!(out)?;
        }
        Ok(())
    }
}

fn semaphore(s: &SemaphoreRef) -> String {
    match s {
        SemaphoreRef::Array { sem, index } => format!("{sem}[{index}]"),
        SemaphoreRef::Barrier => "barrier".to_string(),
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let grid: Vec<String> = self
            .grid
            .iter()
            .map(|g| match g.dynamic {
                Some(r) => format!("<={} ({r}[0]) {}", g.extent, g.semantics.name()),
                None => format!("{} {}", g.extent, g.semantics.name()),
            })
            .collect();
        writeln!(f, "kernel {} grid [{}] {{", self.name, grid.join(", "))?;
        for (i, r) in self.refs.iter().enumerate() {
            write!(f, "  {} {}: {} {}[{}] {}", RefId(i as u32), r.name, r.kind.name(), r.dtype, join(&r.shape, ","), r.memory.name())?;
            if let Some(b) = &r.block {
                let dims: Vec<String> = b.block_shape.iter().map(|d| d.map_or("squeezed".to_string(), |n| n.to_string())).collect();
                write!(f, " block [{}] at ({})", dims.join(","), join(&b.index_map, ", "))?;
            }
            writeln!(f)?;
        }
        if let Some(c) = &self.collective {
            let axes: Vec<String> = c.mesh.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
            writeln!(f, "  mesh [{}] collective_id {}", axes.join(", "), c.collective_id)?;
        }
        if let Some(l) = self.vmem_limit_bytes {
            writeln!(f, "  vmem_limit {l}")?;
        }
        let mut body = String::new();
        self.print_block(&mut body, self.body, 1)?;
        f.write_str(&body)?;
        writeln!(f, "}}")
    }
}
