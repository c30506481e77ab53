//! The pipeline half of the interpreter's machine, as plain data: the grid walk in
//! lexicographic order and, per grid step, the block index of every blocked operand. Both
//! compiled backends run the same [`Schedule`]; only the body of a grid step is compiled.
//!
//! The schedule is computed from the scalar-prefetch values before the grid runs (a
//! dynamic grid dim walks its run-time extent, `interp::run_extents`). Errors
//! an index map raises at some step (`index-out-of-bounds`, `prefetch-out-of-bounds`,
//! `index-map-eval`, `parallel-revisit`) are kept with that step and raised by the driver
//! when it gets there, so they come in the interpreter's order: after everything the
//! earlier steps did.

use std::collections::HashMap;

use tessera_dsl::interp::{parallel_revisit, run_extents, HostData, HostRef};
use tessera_dsl::verify::eval_index;
use tessera_dsl::{Kernel, KernelError, RefDecl, RefId, RefKind, Semantics};

/// The grid walk of one run.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub extents: Vec<usize>,
    /// Steps that run (all of them, or those before the first index-map error).
    pub steps: usize,
    /// The blocked operands (inputs and outputs with a block spec), in ref order.
    pub blocked: Vec<RefId>,
    /// Where each blocked operand's block index starts in a step's row of [`Schedule::index`].
    pub offsets: Vec<usize>,
    /// Sum of the blocked operands' ranks: the length of one step's row.
    pub row: usize,
    /// `steps * row` block indices.
    pub index: Vec<u32>,
    /// The first index-map error and the step at which it is raised.
    pub error: Option<(usize, KernelError)>,
    /// Per blocked operand: some block is entered again after the window left it (outputs
    /// only). Such an output cannot be written in place.
    pub revisits: Vec<bool>,
    /// Steps are split into `units` runs of `unit_len` consecutive steps that may run on
    /// different threads: one run per index of the grid's leading `parallel` dims.
    pub units: usize,
    pub unit_len: usize,
}

impl Schedule {
    /// The block index of blocked operand `b` (position in [`Schedule::blocked`]) at `step`.
    pub fn block(&self, step: usize, b: usize) -> &[u32] {
        let rank = if b + 1 < self.offsets.len() { self.offsets[b + 1] - self.offsets[b] } else { self.row - self.offsets[b] };
        let at = step * self.row + self.offsets[b];
        &self.index[at..at + rank]
    }

    /// The grid coordinates of `step` (lexicographic, last dim fastest).
    pub fn coords(&self, mut step: usize, out: &mut [i32]) {
        for d in (0..self.extents.len()).rev() {
            let e = self.extents[d].max(1);
            out[d] = (step % e) as i32;
            step /= e;
        }
    }
}

fn subject(decl: &RefDecl) -> String {
    format!("{} `{}`", decl.kind.name(), decl.name)
}

/// Reads `prefetch[at]` as the interpreter does, or says why not.
fn read_prefetch(k: &Kernel, inputs: &[HostRef<'_>], input_of: &[Option<usize>], array: RefId, at: &[i64]) -> Result<i64, String> {
    let decl = k.refs.get(array.index()).ok_or_else(|| format!("reads {array}, which does not exist"))?;
    let data = input_of.get(array.index()).copied().flatten().map(|i| inputs[i].data).filter(|_| decl.kind == RefKind::Prefetch);
    let Some(data) = data.filter(|d| matches!(d, HostData::I32(_) | HostData::I8(_))) else {
        return Err(format!("reads `{}`, which is not a scalar-prefetch operand", decl.name));
    };
    let inside = at.len() == decl.shape.len() && at.iter().zip(&decl.shape).all(|(&i, &n)| i >= 0 && (i as usize) < n);
    if !inside {
        return Err(format!("reads `{}`{at:?}, outside its shape {:?}", decl.name, decl.shape));
    }
    let mut flat = 0usize;
    for (&i, &n) in at.iter().zip(&decl.shape) {
        flat = flat * n + i as usize;
    }
    let v = match data {
        HostData::I32(v) => v.get(flat).map(|&x| x as i64),
        HostData::I8(v) => v.get(flat).map(|&x| x as i64),
        _ => None,
    };
    v.ok_or_else(|| format!("reads `{}`{at:?}, outside its data", decl.name))
}

/// Computes the schedule of `k` for these (already checked) inputs.
pub fn schedule(k: &Kernel, inputs: &[HostRef<'_>]) -> Schedule {
    // A dynamic dim runs to its run-time extent; a bad one is raised before the first step.
    let (extents, extent_error) = match run_extents(k, inputs) {
        Ok(e) => (e, None),
        Err(e) => (vec![0; k.grid.len()], Some((0, e))),
    };
    let total: usize = extents.iter().product();
    let mut input_of = vec![None; k.refs.len()];
    let mut next = 0;
    for (i, r) in k.refs.iter().enumerate() {
        if matches!(r.kind, RefKind::Prefetch | RefKind::Input) {
            input_of[i] = Some(next);
            next += 1;
        }
    }
    let blocked: Vec<RefId> = k.refs.iter().enumerate().filter(|(_, r)| r.block.is_some() && matches!(r.kind, RefKind::Input | RefKind::Output)).map(|(i, _)| RefId(i as u32)).collect();
    let mut offsets = Vec::with_capacity(blocked.len());
    let mut row = 0;
    for &r in &blocked {
        offsets.push(row);
        row += k.ref_decl(r).shape.len();
    }
    // Leading parallel dims: one unit per combination of their indices.
    let lead = k.grid.iter().take_while(|g| g.semantics == Semantics::Parallel).count();
    let units: usize = extents[..lead].iter().product();
    let unit_len: usize = extents[lead..].iter().product();
    let mut s = Schedule { extents: extents.clone(), steps: total, blocked, offsets, row, index: Vec::with_capacity(total * row), error: None, revisits: vec![false; 0], units: units.max(1), unit_len: unit_len.max(1) };
    s.revisits = vec![false; s.blocked.len()];
    s.error = extent_error;
    let mut first_visit: Vec<HashMap<Vec<usize>, Vec<usize>>> = vec![HashMap::new(); s.blocked.len()];
    let mut closed: Vec<std::collections::HashSet<Vec<usize>>> = vec![Default::default(); s.blocked.len()];
    let mut current: Vec<Option<Vec<usize>>> = vec![None; s.blocked.len()];
    let mut grid = vec![0usize; extents.len()];
    let mut grid_i64 = vec![0i64; extents.len()];
    'steps: for step in 0..total {
        if step > 0 {
            for d in (0..extents.len()).rev() {
                grid[d] += 1;
                if grid[d] < extents[d] {
                    break;
                }
                grid[d] = 0;
            }
        }
        for (g, &x) in grid_i64.iter_mut().zip(&grid) {
            *g = x as i64;
        }
        for (b, &r) in s.blocked.iter().enumerate() {
            let decl = k.ref_decl(r);
            let spec = decl.block.as_ref().expect("blocked operands have a block spec");
            let mut index = Vec::with_capacity(spec.index_map.len());
            for e in &spec.index_map {
                let mut prefetch_err = None;
                let v = eval_index(e, &grid_i64, &mut |array, at| match read_prefetch(k, inputs, &input_of, array, at) {
                    Ok(v) => Some(v),
                    Err(msg) => {
                        prefetch_err.get_or_insert(msg);
                        None
                    }
                });
                match (v, prefetch_err) {
                    (Some(v), _) => index.push(v),
                    (None, Some(msg)) => {
                        let e = KernelError::new(&k.name, subject(decl), "prefetch-out-of-bounds", format!("at grid step {grid:?} the index map {msg}"), "keep the values that index scalar-prefetch arrays inside them");
                        s.error = Some((step, e));
                        s.steps = step;
                        break 'steps;
                    }
                    (None, None) => {
                        let e = KernelError::new(&k.name, subject(decl), "index-map-eval", format!("at grid step {grid:?} the index map `{e}` divides by zero or reads a grid index the grid does not have"), "fix the index map");
                        s.error = Some((step, e));
                        s.steps = step;
                        break 'steps;
                    }
                }
            }
            let window = spec.window();
            let mut out = Vec::with_capacity(index.len());
            for (d, &i) in index.iter().enumerate() {
                let blocks = decl.shape[d].div_ceil(window[d]);
                if i < 0 || i as usize >= blocks {
                    let e = KernelError::new(
                        &k.name,
                        subject(decl),
                        "index-out-of-bounds",
                        format!("at grid step {grid:?} the index map gives block index {index:?}, but dim {d} has {blocks} blocks (array dim {} / block dim {})", decl.shape[d], window[d]),
                        "fix the index map, the grid or the scalar-prefetch values so block indices stay below the number of blocks",
                    );
                    s.error = Some((step, e));
                    s.steps = step;
                    break 'steps;
                }
                out.push(i as usize);
            }
            if decl.kind == RefKind::Output {
                let first = first_visit[b].entry(out.clone()).or_insert_with(|| grid.clone());
                if let Some(d) = (0..grid.len()).find(|&d| k.grid[d].semantics == Semantics::Parallel && first[d] != grid[d]) {
                    let first = first.clone();
                    s.error = Some((step, parallel_revisit(k, decl, &out, &first, &grid, d)));
                    s.steps = step;
                    break 'steps;
                }
                if current[b].as_ref() != Some(&out) {
                    if closed[b].contains(&out) {
                        s.revisits[b] = true;
                    }
                    if let Some(prev) = current[b].take() {
                        closed[b].insert(prev);
                    }
                    current[b] = Some(out.clone());
                }
            }
            s.index.extend(out.iter().map(|&x| x as u32));
        }
    }
    // A step whose row is incomplete (the error struck midway) is dropped.
    s.index.truncate(s.steps * s.row);
    s
}
