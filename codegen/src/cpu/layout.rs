//! What compiled code knows about memory: per ref, how the driver provides it in a grid
//! step and how the body indexes it; plus the static descriptions of the places where
//! compiled code can fail at run time (the driver formats their errors exactly as the
//! interpreter does).

use tessera_dsl::{DType, Kernel, MemorySpace, RefId, RefKind, SourceLoc};

/// How the driver provides a ref's memory in a grid step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemMode {
    /// A blocked operand read or written in place in the caller's array (full blocks only;
    /// for outputs also: no block is entered twice).
    Direct,
    /// A blocked operand copied through a window buffer (the interpreter's way).
    Window,
    /// An unblocked operand: the caller's whole array.
    Whole,
    /// A scratch buffer (per thread, poisoned at the start).
    Scratch,
    /// DMA semaphores: no memory.
    Semaphore,
}

/// One ref's memory as the body sees it: row-major-ish `view` with element `strides`
/// (the last one is always 1) of `dtype` elements stored natively (bf16 as 2 bytes, bool
/// as one byte 0/1, i8 as one byte).
#[derive(Clone, Debug, PartialEq)]
pub struct RefLayout {
    pub dtype: DType,
    pub mode: MemMode,
    pub view: Vec<usize>,
    pub strides: Vec<usize>,
}

pub fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Whether blocked operand `decl` may be read in place: every block is whole (the array
/// dims are multiples of the block dims) and the last dim is not squeezed.
pub fn direct_capable(decl: &tessera_dsl::RefDecl) -> bool {
    let Some(b) = &decl.block else { return false };
    matches!(b.block_shape.last(), Some(Some(_))) && b.window().iter().zip(&decl.shape).all(|(w, n)| n % w == 0)
}

/// The layout of every ref of `k` for the memory modes `modes` (one per ref).
pub fn layouts(k: &Kernel, modes: &[MemMode]) -> Vec<RefLayout> {
    k.refs
        .iter()
        .zip(modes)
        .map(|(decl, &mode)| {
            let view = decl.view();
            let strides = match (mode, &decl.block) {
                (MemMode::Direct, Some(b)) => {
                    let full = row_major(&decl.shape);
                    b.block_shape.iter().zip(full).filter(|(d, _)| d.is_some()).map(|(_, s)| s).collect()
                }
                _ => row_major(&view),
            };
            RefLayout { dtype: decl.dtype, mode, view, strides }
        })
        .collect()
}

/// The default memory mode of every ref: in place where the operand allows it. Outputs
/// that re-enter a block need [`MemMode::Window`] (the driver decides per run).
pub fn default_modes(k: &Kernel, revisiting_outputs: &[RefId]) -> Vec<MemMode> {
    k.refs
        .iter()
        .enumerate()
        .map(|(i, decl)| match decl.kind {
            RefKind::Scratch if decl.memory == MemorySpace::Semaphore => MemMode::Semaphore,
            RefKind::Scratch => MemMode::Scratch,
            _ if decl.block.is_none() => MemMode::Whole,
            RefKind::Output if revisiting_outputs.contains(&RefId(i as u32)) => MemMode::Window,
            _ if direct_capable(decl) => MemMode::Direct,
            _ => MemMode::Window,
        })
        .collect()
}

/// A dynamic slice the compiled code bounds-checks: `start .. start + len` of `extent`
/// along `dim`.
#[derive(Clone, Debug)]
pub struct SliceSite {
    /// `load of input `x`` etc., as the interpreter names it.
    pub subject: String,
    pub dim: usize,
    pub len: usize,
    /// The slice's stride (1 unless strided).
    pub stride: usize,
    pub extent: usize,
    pub loc: Option<SourceLoc>,
}

/// A `dma_start` or `dma_wait`, run by the driver's DMA simulation.
#[derive(Clone, Debug)]
pub struct DmaSite {
    pub start: bool,
    pub src: RefId,
    pub src_lens: Vec<usize>,
    pub dst: RefId,
    pub dst_lens: Vec<usize>,
    pub sem: RefId,
    pub loc: Option<SourceLoc>,
}

/// Every place compiled code calls back into the driver with an error or a DMA.
#[derive(Clone, Debug, Default)]
pub struct Sites {
    pub slices: Vec<SliceSite>,
    pub dmas: Vec<DmaSite>,
}
