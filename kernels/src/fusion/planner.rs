//! The planner: partitions a [`Graph`] into row kernels by the rules in
//! [`crate::fusion`]'s module docs (one greedy pass in recording order; a node the last
//! kernel refuses may join an earlier one, rule 14).

use std::collections::BTreeSet;

use tessera_dsl::KernelError;

use super::graph::{Graph, NodeId, NodeOp, Operand};

/// At most this many distinct memory reads per kernel (a cap on operands, as Inductor's).
pub const MAX_READS: usize = 16;
/// At most this many compute nodes per kernel.
pub const MAX_NODES: usize = 96;

/// A memory read of a kernel: the buffer of node `storage` seen as `rows x cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Read {
    pub storage: NodeId,
    pub rows: usize,
    pub cols: usize,
    /// A column window `(start, len)` of each row (a row kernel reading `x[..., a:b]`
    /// straight from `x`'s memory), or the whole row.
    pub window: Option<(usize, usize)>,
    /// A piece of a `cat` ([`cat_read_of`]): its columns are not the kernel's (the `cat`
    /// places them), so it is exempt from the row-space checks.
    pub piece: bool,
}

impl Read {
    /// The read as a value of the kernel: `rows x` the window's or the row's columns.
    pub fn space(&self) -> (usize, usize) {
        (self.rows, self.window.map_or(self.cols, |w| w.1))
    }
}

/// How a row kernel reads node `o` from memory: its storage in `o`'s layout, or, for a
/// column window of a value (a [`NodeOp::Gather`] that keeps the rows), the source's rows
/// with the window.
pub fn read_of(g: &Graph, o: NodeId) -> Read {
    if let Some((src, start)) = g.col_window(o) {
        let (rows, cols) = g.node(src).layout();
        return Read { storage: g.storage(src), rows, cols, window: Some((start, g.node(o).layout().1)), piece: false };
    }
    whole_read(g, o)
}

/// Node `o`'s memory read whole in its own layout (an anchor's operand, or a value a row
/// kernel reads as it is stored).
fn whole_read(g: &Graph, o: NodeId) -> Read {
    let (rows, cols) = g.node(o).layout();
    Read { storage: g.storage(o), rows, cols, window: None, piece: false }
}

/// One kernel: compute nodes over the row space `rows x cols`.
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    pub nodes: Vec<NodeId>,
    pub rows: usize,
    pub cols: usize,
    /// Memory it reads, in first-use order.
    pub reads: Vec<Read>,
    /// Nodes it computes that are stored (read by a later kernel, or a live result).
    pub outputs: Vec<NodeId>,
    /// Whether it holds a row op (then `cols` is fixed: the rows it reduces).
    pub has_row_op: bool,
    /// Whether it holds a column sum (then `rows` is fixed, and the grid runs in order:
    /// the sum accumulates over the row blocks).
    pub has_col_sum: bool,
    /// Why the previous partition ended here (for dumps and stats).
    pub cut: String,
    /// The matmul or copy node this kernel is built around (its first node), if any: then
    /// `reads[..anchor_reads]` are its operands in order, each read whole, followed by each
    /// sibling's own operands.
    pub anchor: Option<NodeId>,
    pub anchor_reads: usize,
    /// Matmuls that compute over the anchor's output space beside it, sharing one of its
    /// operands or none ([`Shared`]), in the kernel's nodes too (rule 13).
    pub siblings: Vec<NodeId>,
    /// Which operand the anchor and its siblings share.
    pub shared: Shared,
}

/// The operand sibling matmuls share: `a` (`x @ w1`, `x @ w3`: the gate and up projections),
/// `b` (`g1^T @ x`, `g2^T @ x`: their weight gradients), or neither (independent products
/// of one shape: `dx = g_gate @ w1^T + g_up @ w3^T`, whose sum is then their epilogue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Shared {
    #[default]
    A,
    B,
    Neither,
}

impl Shared {
    /// The operand the siblings share: 0 (`a`), 1 (`b`) or none.
    pub fn arg(self) -> Option<usize> {
        match self {
            Shared::A => Some(0),
            Shared::B => Some(1),
            Shared::Neither => None,
        }
    }
}

/// Whether matmul `id` can join anchor partition `part` (number `at`) as a sibling: the
/// same kind of product over the same output space, one operand the same memory in the
/// same shape as the anchor's, the other of the same shape and dtype, and both ready when
/// the partition runs (an anchor reads its operands whole from memory, so neither may be
/// computed by it or after it).
fn sibling(g: &Graph, part: &Partition, id: NodeId, assigned: &[Option<usize>], at: usize) -> Option<Shared> {
    let anchor = part.anchor?;
    let (x, y) = (g.node(anchor), g.node(id));
    if !matches!(x.op, NodeOp::Matmul { .. }) || x.op != y.op || x.shape != y.shape || x.dtype != y.dtype || x.args.len() != y.args.len() || part.nodes.len() + 1 > MAX_NODES {
        return None;
    }
    let operand = |n: &super::graph::Node, i: usize| match n.args[i] {
        Operand::Node(o) => Some(o),
        Operand::Scalar(_) => None,
    };
    let same = |i: usize| -> Option<bool> {
        let (a, b) = (operand(x, i)?, operand(y, i)?);
        Some(g.storage(a) == g.storage(b) && g.node(a).shape == g.node(b).shape)
    };
    let alike = |i: usize| -> Option<bool> {
        let (a, b) = (g.node(operand(x, i)?), g.node(operand(y, i)?));
        Some(a.shape == b.shape && a.dtype == b.dtype)
    };
    let shared = match (same(0)?, same(1)?) {
        (true, false) if alike(1)? => Shared::A,
        (false, true) if alike(0)? => Shared::B,
        (false, false) if alike(0)? && alike(1)? => Shared::Neither,
        _ => return None,
    };
    if part.siblings.first().is_some_and(|_| part.shared != shared) {
        return None;
    }
    // The operands are ready when partition `at` runs: graph inputs, or computed before it.
    let ready = y.args.iter().all(|a| match *a {
        Operand::Node(o) => [g.storage(o), g.same_rows_source(o)].iter().all(|&s| assigned[s].is_none_or(|q| q < at)),
        Operand::Scalar(_) => true,
    });
    ready.then_some(shared)
}

/// Whether `op` is an anchor: a matmul, or a copy that moves elements between rows
/// (transpose, gather). Each starts its own kernel.
pub fn is_anchor(op: &NodeOp) -> bool {
    matches!(op, NodeOp::Matmul { .. } | NodeOp::Transpose | NodeOp::Gather(_))
}

/// How many kernels back a matmul looks for a sibling to join (rule 13): q, k and v
/// projections are a few copies apart (each head split is a transpose kernel).
pub const SIBLING_REACH: usize = 8;

/// A row op joins a matmul's epilogue only when the matmul's columns are one block (the
/// generator then takes `bn = n`): a row op over a tiled `n` would see part of its row.
pub const MAX_EPILOGUE_ROW: usize = 512;

/// Whether an epilogue read fits the matmul's output space: rows all of it, one, or one
/// batch's `m` (a `[m, n]` mask or bias shared by every batch); columns all or one.
fn fits_epilogue(g: &Graph, part: &Partition, r: &Read) -> bool {
    let out = &g.node(part.anchor.expect("a matmul partition")).shape;
    let m = out[out.len() - 2];
    r.window.is_none() && (r.rows == part.rows || r.rows == 1 || r.rows == m) && (r.cols == part.cols || r.cols == 1)
}

/// How `cat` reads piece `o` (always from memory): as [`read_of`], but a broadcast of one
/// element (the zeros of `slice_backward`) is that element, broadcast in the kernel, and a
/// negation (rotate_half's `-x[..., d/2:]`) is its operand, negated in the kernel.
pub fn cat_read_of(g: &Graph, o: NodeId) -> Read {
    let n = g.node(o);
    let r = match (&n.op, n.args.first()) {
        (NodeOp::Unary(super::graph::Unary::Neg), Some(&Operand::Node(x))) => read_of(g, x),
        (NodeOp::Expand, Some(&Operand::Node(src))) if g.node(src).shape.iter().product::<usize>() == 1 => Read { storage: g.storage(src), rows: 1, cols: 1, window: None, piece: false },
        _ => read_of(g, o),
    };
    Read { piece: true, ..r }
}

/// Whether a node of `op` reads a column window straight from its source's memory (row
/// kernels, `cat` among them; a matmul or gather reads the window's node).
fn reads_windows(op: &NodeOp) -> bool {
    !is_anchor(op)
}

/// Whether a node's space fits a matmul's epilogue: the output space, or (once a row op
/// has made the column block the whole row) one column of it, as RMSNorm's `mean + eps`.
fn epilogue_space(node: &super::graph::Node, space: (usize, usize), part: &Partition) -> bool {
    let full = (part.rows, part.cols);
    space == full || (part.has_row_op && !matches!(node.op, NodeOp::Row(_)) && fits(space, full) && fits(node.layout(), full))
}

/// Whether `op` may join a matmul's epilogue: pointwise in the matmul's output space.
fn is_epilogue(op: &NodeOp) -> bool {
    matches!(op, NodeOp::Unary(_) | NodeOp::Binary(_) | NodeOp::Compare(_) | NodeOp::Where | NodeOp::Clamp(..) | NodeOp::Cast(_))
}

#[derive(Clone, Debug, PartialEq)]
pub struct Partitioning {
    pub parts: Vec<Partition>,
    /// Partition of each compute node (`None`: inputs and views).
    pub assigned: Vec<Option<usize>>,
}

fn fits(layout: (usize, usize), space: (usize, usize)) -> bool {
    (layout.0 == space.0 || layout.0 == 1) && (layout.1 == space.1 || layout.1 == 1)
}

/// A memory read may also be periodic: rows dividing the space's (a `[b, n]` operand of an
/// `[a, b, n]` result, admitted by the graph builder), read at block index `i % (rows / bm)`.
fn read_fits(layout: (usize, usize), space: (usize, usize)) -> bool {
    fits(layout, space) || (layout.0 > 0 && space.0.is_multiple_of(layout.0) && (layout.1 == space.1 || layout.1 == 1))
}

/// The iteration space of a compute node: a row op runs over its input's rows.
fn space_of(g: &Graph, id: NodeId) -> (usize, usize) {
    let n = g.node(id);
    match (&n.op, n.args.first()) {
        (NodeOp::Row(_) | NodeOp::ColSum, Some(&Operand::Node(x))) => g.node(x).layout(),
        _ => n.layout(),
    }
}

/// What the greedy pass tracks of each partition for the space checks: the layouts of
/// the values it computes or reads, and the row length of its row ops and the rows of its
/// column sum, which fix its space.
#[derive(Clone, Debug, Default)]
struct Open {
    layouts: Vec<(usize, usize)>,
    row_op_cols: Option<usize>,
    col_sum_rows: Option<usize>,
}

/// How far back a node that cannot join the last kernel looks for an earlier one it fits
/// (rule 14): autograd records a matmul's backward between the pointwise nodes of the
/// gradient it consumes, so those nodes meet their kernel again a few kernels later.
pub const JOIN_REACH: usize = 8;

/// Whether node `id` can join partition `q`: `Ok` with the memory it then reads and the
/// grown space, or why not. A node joining a partition before the last one (`q < last`)
/// must find its operands ready there: computed by `q` itself (values in VMEM) or stored
/// by a kernel before it.
#[allow(clippy::too_many_arguments)]
fn join(g: &Graph, parts: &[Partition], open: &[Open], assigned: &[Option<usize>], q: usize, last: usize, id: NodeId, space: (usize, usize)) -> Result<(Vec<Read>, usize, usize), String> {
    let node = g.node(id);
    let part = &parts[q];
    let Open { layouts, row_op_cols, col_sum_rows } = &open[q];
    let cur = Some(q);
    // The memory this node reads if it joins `q`, and whether it needs a value `q`
    // computes in another layout (then it must wait for `q` to be stored).
    let mut reads = Vec::new();
    let mut needs_stored = None;
    let mut reads_col_sum = None;
    for a in &node.args {
        let Operand::Node(o) = *a else { continue };
        if matches!(node.op, NodeOp::CatCols) {
            // A piece is read from memory: stored first when the open kernel computes it.
            let r = cat_read_of(g, o);
            if assigned[r.storage] == cur {
                needs_stored = Some(o);
            }
            reads.push(r);
            continue;
        }
        if !is_anchor(&node.op) && g.col_window(o).is_some() {
            // From memory: a value in VMEM has no column slices.
            let r = read_of(g, o);
            if assigned[r.storage] == cur {
                needs_stored = Some(o);
            }
            reads.push(r);
            continue;
        }
        let s = g.same_rows_source(o);
        if assigned[s] == cur {
            if matches!(g.node(s).op, NodeOp::ColSum) {
                reads_col_sum = Some(s);
            }
            continue;
        }
        let r = whole_read(g, o);
        if assigned[r.storage] == cur {
            needs_stored = Some(o);
        }
        reads.push(r);
    }
    if q < last && reads.iter().any(|r| assigned[r.storage].is_some_and(|x| x > q)) {
        return Err(format!("node %{id} reads a value computed after kernel {q}"));
    }
    let m = part.rows.max(space.0);
    let n = part.cols.max(space.1);
    let mut new_reads: BTreeSet<Read> = part.reads.iter().copied().collect();
    new_reads.extend(reads.iter().copied());
    let is_row = matches!(node.op, NodeOp::Row(_));
    let is_col = matches!(node.op, NodeOp::ColSum);
    let anchor = part.anchor.map(|a| &g.node(a).op);
    let cut = if is_anchor(&node.op) {
        format!("node %{id} is a {}, which starts its own kernel", if matches!(node.op, NodeOp::Matmul { .. }) { "matmul" } else { "copy between rows" })
    } else if anchor.is_some_and(|a| !matches!(a, NodeOp::Matmul { .. })) {
        format!("node %{id} reads the result of a copy kernel")
    } else if anchor.is_some() && is_row && part.cols > MAX_EPILOGUE_ROW {
        format!("node %{id} is a row op over the matmul's {} columns, more than one column block ({MAX_EPILOGUE_ROW}) holds", part.cols)
    } else if anchor.is_some() && (!(is_epilogue(&node.op) || is_row) || !epilogue_space(node, space, part) || !reads.iter().all(|r| fits_epilogue(g, part, r)) || !layouts.iter().chain(&[node.layout()]).all(|&l| fits(l, (part.rows, part.cols)))) {
        format!("node %{id} is not pointwise or a row op in the matmul's {}x{} output space (an epilogue takes only those)", part.rows, part.cols)
    } else if let Some(o) = needs_stored {
        format!("node %{id} reads %{o}, a view in other rows of a value the previous kernel computes (it must be stored first)")
    } else if !layouts.iter().chain(&[space, node.layout()]).all(|&l| fits(l, (m, n))) || !part.reads[part.anchor_reads..].iter().chain(&reads).all(|r| r.piece || read_fits(r.space(), (m, n))) {
        format!("node %{id} runs over {}x{} rows, which the previous kernel's {}x{} values do not broadcast with", space.0, space.1, part.rows, part.cols)
    } else if let Some(c) = reads_col_sum {
        format!("node %{id} reads the column sum %{c}, complete only after the previous kernel's last block")
    } else if col_sum_rows.is_some_and(|r| r != m) || (is_col && space.0 != m) {
        format!("node %{id} changes the rows ({} vs {}) of a kernel with a column sum", space.0, m)
    } else if row_op_cols.is_some_and(|c| c != n) || (is_row && space.1 != n) {
        format!("node %{id} changes the row length ({} vs {}) of a kernel with a row op", space.1, n)
    } else if new_reads.len() > MAX_READS {
        format!("node %{id} would make the kernel read more than {MAX_READS} buffers")
    } else if part.nodes.len() >= MAX_NODES {
        format!("the previous kernel has {MAX_NODES} nodes")
    } else {
        return Ok((reads, m, n));
    };
    Err(cut)
}

/// Partitions `g`; `live` are the nodes whose values the caller takes.
pub fn partition(g: &Graph, live: &[NodeId]) -> Result<Partitioning, KernelError> {
    let mut parts: Vec<Partition> = Vec::new();
    let mut assigned: Vec<Option<usize>> = vec![None; g.len()];
    let mut open: Vec<Open> = Vec::new();
    // Only what the live results need is computed (dead nodes make no kernel).
    let mut needed = vec![false; g.len()];
    for &l in live {
        if let Some(n) = needed.get_mut(l) {
            *n = true;
        }
    }
    for id in (0..g.len()).rev() {
        if needed[id] {
            // (A view passes its source on whole: a row kernel reading the view of a window
            // reads the window's source itself, see `Graph::col_window`.)
            let row_kernel_node = reads_windows(&g.node(id).op) && !matches!(g.node(id).op, NodeOp::View);
            for a in &g.node(id).args {
                if let Operand::Node(o) = *a {
                    // A row kernel reads a column window from its source's memory.
                    let o = match g.col_window(o) {
                        Some((src, _)) if row_kernel_node => src,
                        _ if matches!(g.node(id).op, NodeOp::CatCols) => cat_read_of(g, o).storage,
                        _ => o,
                    };
                    if let Some(n) = needed.get_mut(o) {
                        *n = true;
                    }
                }
            }
        }
    }
    for id in 0..g.len() {
        let node = g.node(id);
        if !needed[id] || matches!(node.op, NodeOp::Input(_) | NodeOp::View) {
            continue;
        }
        let space = space_of(g, id);
        let mut cut = None;
        if let Some(p) = parts.len().checked_sub(1) {
            // Rule 13: a matmul sharing an operand with a recent kernel's anchor, or a
            // product of its shape with both operands ready there, joins it.
            let is_matmul = matches!(node.op, NodeOp::Matmul { .. });
            if let Some((q, shared, own)) = (p.saturating_sub(SIBLING_REACH)..=p).rev().filter(|_| is_matmul).find_map(|q| {
                let shared = sibling(g, &parts[q], id, &assigned, q)?;
                let own: Vec<Read> = node.args.iter().enumerate().filter(|&(i, _)| Some(i) != shared.arg()).filter_map(|(_, a)| match *a {
                    Operand::Node(o) => Some(whole_read(g, o)),
                    Operand::Scalar(_) => None,
                }).collect();
                let distinct: BTreeSet<Read> = parts[q].reads.iter().chain(&own).copied().collect();
                (distinct.len() <= MAX_READS).then_some((q, shared, own))
            }) {
                let part = &mut parts[q];
                let at = part.anchor_reads;
                part.reads.splice(at..at, own.iter().copied());
                part.anchor_reads += own.len();
                part.nodes.push(id);
                part.siblings.push(id);
                part.shared = shared;
                open[q].layouts.push(node.layout());
                assigned[id] = Some(q);
                continue;
            }
            // The last kernel, else (rule 14) the nearest earlier one the node fits with
            // its operands ready there; the last kernel's refusal is the recorded cut.
            let mut joined = None;
            for q in (p.saturating_sub(JOIN_REACH)..=p).rev() {
                match join(g, &parts, &open, &assigned, q, p, id, space) {
                    Ok(fit) => {
                        joined = Some((q, fit));
                        break;
                    }
                    Err(why) if q == p => cut = Some(why),
                    Err(_) => {}
                }
                if is_anchor(&node.op) {
                    break;
                }
            }
            if let Some((q, (reads, m, n))) = joined {
                let is_row = matches!(node.op, NodeOp::Row(_));
                let is_col = matches!(node.op, NodeOp::ColSum);
                let part = &mut parts[q];
                part.rows = m;
                part.cols = n;
                part.nodes.push(id);
                for r in reads {
                    if !part.reads[part.anchor_reads..].contains(&r) {
                        part.reads.push(r);
                    }
                }
                part.has_row_op |= is_row;
                part.has_col_sum |= is_col;
                let o = &mut open[q];
                if is_row {
                    o.row_op_cols = Some(n);
                }
                if is_col {
                    o.col_sum_rows = Some(m);
                }
                o.layouts.push(space);
                o.layouts.push(node.layout());
                assigned[id] = Some(q);
                continue;
            }
        }
        // A new partition. Reads of the previous one's values are now reads of memory (an
        // anchor's operands each once, in order, even when two are one buffer).
        let mut reads = Vec::new();
        let anchored = is_anchor(&node.op);
        for a in &node.args {
            let Operand::Node(o) = *a else { continue };
            let r = if matches!(node.op, NodeOp::CatCols) {
                cat_read_of(g, o)
            } else if anchored && !reads_windows(&node.op) {
                whole_read(g, o)
            } else {
                read_of(g, o)
            };
            if anchored || !reads.contains(&r) {
                reads.push(r);
            }
        }
        if anchored {
            let (rows, cols) = node.layout();
            open.push(Open { layouts: vec![(rows, cols)], row_op_cols: None, col_sum_rows: None });
            let anchor_reads = reads.len();
            parts.push(Partition { nodes: vec![id], rows, cols, reads, outputs: Vec::new(), has_row_op: false, has_col_sum: false, cut: cut.unwrap_or_else(|| "start".into()), anchor: Some(id), anchor_reads, siblings: Vec::new(), shared: Shared::A });
            assigned[id] = Some(parts.len() - 1);
            continue;
        }
        let is_row = matches!(node.op, NodeOp::Row(_));
        let is_col = matches!(node.op, NodeOp::ColSum);
        let layouts = vec![space, node.layout()];
        // A new partition's space must hold its reads too (a (1, n) op over a (m, 1) read).
        let (m, n) = layouts.iter().chain(reads.iter().filter(|r| !r.piece).map(Read::space).collect::<Vec<_>>().iter()).fold((1, 1), |(m, n), &(r, c)| (m.max(r), n.max(c)));
        if !layouts.iter().all(|&l| fits(l, (m, n))) || !reads.iter().all(|r| r.piece || read_fits(r.space(), (m, n))) {
            return Err(KernelError::new("fusion", format!("node %{id}"), "fusion-plan", "its operands do not share a row space", "report this as a Tessera bug: the graph builder checks broadcasts"));
        }
        open.push(Open { layouts, row_op_cols: is_row.then_some(space.1), col_sum_rows: is_col.then_some(space.0) });
        parts.push(Partition { nodes: vec![id], rows: m, cols: n, reads, outputs: Vec::new(), has_row_op: is_row, has_col_sum: is_col, cut: cut.unwrap_or_else(|| "start".into()), anchor: None, anchor_reads: 0, siblings: Vec::new(), shared: Shared::A });
        assigned[id] = Some(parts.len() - 1);
    }
    sink_into_consumers(g, live, &mut parts, &mut assigned);
    // What is stored: every compute node read from memory, and the live results.
    let mut stored: BTreeSet<NodeId> = parts.iter().flat_map(|p| p.reads.iter().map(|r| r.storage)).filter(|&s| assigned[s].is_some()).collect();
    for &l in live {
        if l >= g.len() {
            return Err(KernelError::new("fusion", format!("live node %{l}"), "fusion-operand", format!("the graph has {} nodes", g.len()), "name nodes of this graph"));
        }
        let s = g.storage(l);
        if assigned[s].is_none() {
            return Err(KernelError::new("fusion", format!("live node %{l}"), "fusion-output-alias", "its memory is a graph input's", "take graph inputs as they are; only computed nodes are results"));
        }
        stored.insert(s);
    }
    for s in stored {
        if let Some(p) = assigned[s] {
            parts[p].outputs.push(s);
        }
    }
    Ok(Partitioning { parts, assigned })
}

/// Sinks a pointwise row kernel into the one later row kernel that reads its results (the
/// greedy pass closes `q * cos` before RoPE's `cat`, whose consumer `.. + q * cos` runs over
/// the same rows): the values are then computed where they are used, never stored. Only
/// when no result is live or read by another kernel, both kernels have one row space, and
/// every read of the sunk kernel's results is its plain layout.
fn sink_into_consumers(g: &Graph, live: &[NodeId], parts: &mut Vec<Partition>, assigned: &mut [Option<usize>]) {
    let mut p = 0;
    while p < parts.len() {
        let src = &parts[p];
        let plain = src.anchor.is_none() && !src.has_row_op && !src.has_col_sum && src.nodes.iter().all(|&n| !live.iter().any(|&l| g.storage(l) == n));
        // The kernels that read any node of `p` from memory.
        let readers: BTreeSet<usize> = (p + 1..parts.len()).filter(|&q| parts[q].reads.iter().any(|r| assigned[r.storage] == Some(p))).collect();
        let target = match (plain, readers.len()) {
            (true, 1) => *readers.iter().next().expect("one reader"),
            _ => {
                p += 1;
                continue;
            }
        };
        let dst = &parts[target];
        // Every read of a sunk result must become its value: the read is its plain layout
        // and the reading node reaches it through rows-keeping views only.
        let reads_plain = dst.reads.iter().filter(|r| assigned[r.storage] == Some(p)).all(|r| !r.piece && r.window.is_none() && (r.rows, r.cols) == g.node(r.storage).layout())
            && dst.nodes.iter().flat_map(|&n| g.node(n).args.iter()).all(|a| match *a {
                Operand::Node(o) => assigned[read_of(g, o).storage] != Some(p) || read_of(g, o).window.is_some() || assigned[g.same_rows_source(o)] == Some(p),
                Operand::Scalar(_) => true,
            });
        let mut reads: Vec<Read> = parts[target].reads.iter().copied().filter(|r| assigned[r.storage] != Some(p)).collect();
        for r in &parts[p].reads {
            if !reads.contains(r) {
                reads.push(*r);
            }
        }
        let ok = dst.anchor.is_none() && !dst.has_col_sum && (dst.rows, dst.cols) == (src.rows, src.cols) && reads_plain && reads.len() <= MAX_READS && dst.nodes.len() + src.nodes.len() <= MAX_NODES;
        if !ok {
            p += 1;
            continue;
        }
        let src = parts.remove(p);
        let target = target - 1;
        let dst = &mut parts[target];
        let mut nodes = src.nodes.clone();
        nodes.extend(dst.nodes.iter().copied());
        dst.nodes = nodes;
        dst.reads = reads;
        for a in assigned.iter_mut() {
            *a = match *a {
                Some(x) if x == p => Some(target),
                Some(x) if x > p => Some(x - 1),
                other => other,
            };
        }
    }
}
