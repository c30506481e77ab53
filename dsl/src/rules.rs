//! The rulebook: every rule a `KernelError` or a `Warning` can name, in one table.
//!
//! A rule id never changes meaning: tools and users match on it. Each rule checks one
//! thing, is checked by the builder, the verifier or the interpreter (some by more than
//! one, where each needs it), and is of one kind:
//!
//! - [`Kind::Tpu`]: libtpu judges it too. Its evidence is a pair of minimal kernels, one
//!   just inside the edge (libtpu accepts) and its near twin just outside (libtpu rejects),
//!   in `tests/src/rulebook/`, with libtpu's recorded verdicts in
//!   `tests/verdicts/libtpu.json`; the libtpu test tier fails if an upgrade moves an edge.
//! - [`Kind::Semantic`]: ours by design. libtpu cannot judge it (a wrong index map still
//!   compiles) or accepts what is certainly a bug (a zero-extent grid writes nothing);
//!   the evidence says which.
//! - [`Kind::Warning`]: libtpu compiles both sides; the kernel runs slower than it could.
//!
//! The principles (`tests/src/rulebook/README.md`) and a test that every rule id used in
//! `dsl/src` is listed here (`tests/tests/rulebook.rs`) keep the table honest.

/// Who checks a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checker {
    /// `KernelBuilder`, while the kernel is built (type errors of the IR).
    Builder,
    /// `verify::verify` (errors) or `verify::warnings` (warnings), per target.
    Verifier,
    /// `interp::run`, on the values it is given.
    Interpreter,
}

/// What a rule's evidence is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// libtpu judges it: an evidence pair.
    Tpu,
    /// Ours by design: libtpu cannot judge it, or accepts a certain bug.
    Semantic,
    /// A performance warning: libtpu compiles both sides.
    Warning,
}

/// One rule.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub id: &'static str,
    /// What must hold, in one line.
    pub statement: &'static str,
    pub checkers: &'static [Checker],
    pub kind: Kind,
    /// How the rule differs per generation (v5e, v5p, v6e, tpu7x).
    pub generations: &'static str,
    /// The evidence: the pair in `tests/src/rulebook/`, or why libtpu cannot judge it.
    pub evidence: &'static str,
}

use Checker::{Builder as B, Interpreter as I, Verifier as V};
use Kind::{Semantic, Tpu, Warning};

const SAME: &str = "same on all four";

macro_rules! rules {
    ($( $id:literal, $kind:expr, [$($c:expr),*], $gens:expr, $statement:literal, $evidence:literal; )*) => {
        /// Every rule, grouped as the verifier's modules are.
        pub const RULES: &[Rule] = &[$( Rule { id: $id, statement: $statement, checkers: &[$($c),*], kind: $kind, generations: $gens, evidence: $evidence } ),*];
    };
}

rules! {
    // ---- grid (verify/grid.rs) ----
    "grid-rank", Semantic, [V], SAME, "the grid has at least one dimension",
        "semantic: a kernel of Tessera always has a grid (Pallas' grid=() is grid=[1])";
    "grid-extent", Semantic, [V], SAME, "every grid extent is at least 1",
        "semantic: libtpu compiles a zero-extent grid (probe grid/zero), but the body never runs and every output stays uninitialised";
    "grid-extent-range", Tpu, [V], SAME, "every grid extent is at most 2^31 - 130",
        "pair grid-extent-range: 2^31 - 130 accepted; 2^31 - 129 rejected (libtpu takes it for a dynamic extent: `Wrong number of window_params`); 2^31 and up: `iteration_bounds should be between 0 and 2147483646`";
    "grid-steps", Tpu, [V], SAME, "the grid has at most 2^31 - 128 steps in all",
        "pair grid-steps: [2, 2^30 - 64] accepted; [2, 2^30] rejected (`count < int32 max: Iteration bounds are too large`). Between, libtpu hangs or aborts ([2, 2^30 - 1]: `Check failed: index_space_.start <= index_space_.limit`), so the rule stops at the last measured success";
    "grid-dynamic-extent", Semantic, [V, I], SAME, "a dynamic grid dim's extent is an int32 [1] scalar-prefetch operand whose run-time value is in 0..=bound, and num_programs of the dim reads it",
        "semantic: the operand's form is ours (the emitter reshapes it into the leading `tensor<i32>` custom-call operand Mosaic takes for an INT64_MIN bound); the value is known only at run time, where a TPU would run past the bound its windows and budgets were checked for";

    // ---- operands (verify/operand.rs) ----
    "kernel-outputs", Tpu, [V], SAME, "a kernel has at least one output",
        "pair kernel-outputs: a copy into an output accepted; the same copy into a VMEM scratch, the kernel's only other operand, rejected (`expected named operation to have at least 1 result`)";
    "operand-shape", Semantic, [V], SAME, "every operand has rank >= 1 and no zero dim",
        "semantic: an empty operand is a host-side mistake (libtpu would compile a zero-sized tensor)";
    "shape-overflow", Semantic, [V], SAME, "an operand's element and byte counts fit a 64-bit count",
        "semantic: the arithmetic would overflow before any compiler sees the shape";
    "hbm-budget", Tpu, [V], "usable per device: v6e 31.24 GiB and tpu7x 94.74 GiB (libtpu's figures; 32 and 2 x 96 GiB per chip), v5e 16 GiB and v5p 95 GiB (compile-only libtpu does not check these two)", "the operands fit together in the HBM one device can use",
        "pair hbm-budget (v6e, tpu7x): operands of half the usable HBM accepted, of 9/8 of the chip's HBM rejected (E1000 `CompileTimeHbmOom: Ran out of memory on HBM`); on v5e and v5p libtpu compiles both, the rule is ours there";
    "value-size", Semantic, [V], "v5e, v6e 128 MiB; v5p, tpu7x 64 MiB", "every vector value fits the core's VMEM",
        "semantic: such a value cannot exist on the chip; Mosaic may drop an unused one, but every CPU backend would materialise it";
    "prefetch-dtype", Semantic, [V], SAME, "scalar-prefetch operands are int32 arrays in SMEM",
        "semantic: the builder only makes such prefetch operands; the check guards hand-built IR";
    "semaphore-decl", Semantic, [V], SAME, "DMA semaphores are rank-1 scratch arrays without a block spec",
        "semantic: guards hand-built IR; `semaphores(n)` makes them right";
    "blocked-memory-space", Semantic, [V, I], SAME, "only VMEM operands have a block spec",
        "semantic: a block spec on an ANY/SMEM operand has no meaning in the Pallas model";
    "block-rank", Semantic, [V, I], SAME, "a block shape has one dim per array dim",
        "semantic: the index map and the window must describe the same array";
    "index-map-arity", Tpu, [V], SAME, "an index map returns one block index per array dim",
        "pair index-map-arity: a 2-result map for a rank-2 operand accepted, a 1-result map rejected";
    "index-map-operand", Semantic, [V], SAME, "an index map reads only grid indices and scalar-prefetch operands",
        "semantic: guards hand-built IR (the macro only writes such maps)";
    "block-shape", Semantic, [V, I], SAME, "every block dim is at least 1",
        "semantic: a zero block dim has no windows. A block larger than its array compiles (probes block-over-array/*: 16x128 of an 8x128 array) and is accepted, its excess is padding";
    "block-tiling", Tpu, [V], "same on all four: 8 x 128 for every dtype (the packed 16/32-row tiles are a performance matter, see block-native-tiling)", "a block's last dim is a multiple of 128 or the whole dim, its second-to-last a multiple of 8 or the whole dim",
        "pair block-tiling: [8, 128] (f32, bf16, i8) and [32, 256] accepted; [12, 128], [4, 128] and [32, 192] rejected (E2002 `block shape is not divisible by tiling`)";
    "block-tiling-1d", Tpu, [V], SAME, "a rank-1 block is a multiple of 128 * (32 / bits) elements (128 f32, 256 bf16, 512 int8) or the whole dim",
        "pair block-tiling-1d: bf16 [256] of [4096] accepted; bf16 [128] rejected (E2002 `has tiling (256)`); i8 [512] accepted, [256] rejected";
    "index-out-of-bounds", Semantic, [V, I], SAME, "every block index the grid produces is inside the array",
        "semantic: libtpu compiles an index map that runs past the array (broken kernel grid_overruns_array); on a device it reads or writes out of bounds";
    "index-map-division", Semantic, [V], SAME, "an index map never divides by zero",
        "semantic: the map is evaluated per grid step; libtpu cannot know the values";
    "memory-dtype", Semantic, [V], SAME, "arrays in memory (inputs, outputs, scratch) are not bool: masks are values, stored as int8 or int32",
        "semantic: the Mosaic emitter has no i1 memref form (Pallas stores bool refs as int32 too); the CPU backends refuse what no TPU lowering takes, so a CPU result is reproducible";
    "kernel-name", Semantic, [V], SAME, "a kernel's name is an identifier (ASCII letters, digits, `_`, not starting with a digit)",
        "semantic: the name is an MLIR symbol and the stem of emitted files; `../x` would write outside the output directory, an empty name a hidden file";
    "output-coverage", Semantic, [V], SAME, "the grid writes every block of every output",
        "semantic: libtpu compiles a grid that leaves output blocks unwritten (broken kernel output_not_covered); they hold garbage";
    "reduction-axis-semantics", Semantic, [V], SAME, "a grid dim the output's index map ignores (a reduction axis) is `arbitrary`",
        "semantic: libtpu compiles it (broken kernel parallel_reduction_axis); with megacore the steps race";
    "reduction-axis-order", Semantic, [V], SAME, "reduction (arbitrary) grid dims come after every dim the output's index map uses",
        "semantic: libtpu compiles it (broken kernel reduction_axis_first); each output block is written back several times and loses the earlier partial results";

    // ---- budgets (verify/budget.rs) ----
    "vmem-limit", Semantic, [V], "v5e 128 MiB, v5p 64 MiB, v6e 128 MiB, tpu7x 64 MiB per core", "the requested scoped VMEM limit is at most the core's VMEM",
        "semantic: compile-only libtpu accepts a limit beyond the core (probe vmem-limit/over-core); a device cannot honour it";
    "vmem-budget", Tpu, [V], "one model, with the f32 matmul's staged result per generation (1/4 v5e/v5p, 1/2 v6e, all on tpu7x); default scoped limits 16 MiB v5e/v5p, 32 MiB v6e/tpu7x; tpu7x sometimes single-buffers, where the estimate is high", "buffers (blocked operands twice, scratch once, padded to the memory tile) plus Mosaic's internal scratch (held vector values, matmuls, lane iotas, loaded-column broadcasts) plus a 128 KiB margin for kernels that compute fit the scoped VMEM limit",
        "pair vmem-budget: a copy at 100% of the limit accepted, at 103% rejected (E1001); a bf16 matmul with an f32 accumulator at 100% by our count accepted, 103% rejected. The internal-scratch model and the margin are calibrated against libtpu's measured need of 360 kernels (tests/verdicts/vmem.md: largest under-estimate 88 KiB)";
    "smem-budget", Tpu, [V], "libtpu reserves 3 KiB on v5e, v5p, v6e; 2 KiB plus 512 bytes per further prefetch table on tpu7x", "SMEM arrays (32-bit words, padded to 128 words; rank >= 2: [8, 128] tiles) plus libtpu's reservation fit 1 MiB",
        "pair smem-budget: a prefetch table of 1 MiB - 3 KiB accepted, 1 MiB - 3 KiB + 4 bytes rejected (`Ran out of memory in memory space smem`); on tpu7x 1 MiB - 2 KiB accepted, 1 MiB - 1.75 KiB rejected";

    // ---- the body (verify/body.rs) ----
    "strided-access", Tpu, [V], SAME, "a strided load or store strides only non-lane dims of a window at most 128 lanes wide; a strided store is of 32-bit data; a strided load of bf16/i8 has static starts and reads a window whose second-to-last dim is a multiple of 2/4",
        "pair strided-access: an f32 load of 8 rows at stride 2 accepted, the same stride on the lanes rejected (`Stride on last dim is not 1` / `The last dim size is not 128`); pair strided-store: a strided f32 store accepted, bf16 rejected (`Strided store with non 32-bit data`); a 256- or 512-lane window rejected for every dtype, 64 and 128 accepted (`The last dim size is not 128 in original base memref`); a dynamic bf16 start rejected (`Only static indices are supported for packed types`), dynamic f32 starts accepted unaligned; a bf16/i8 load from a 17-row window rejected (`second-minor dimension of base memref (17) must be a multiple of packing factor 2`; Pallas-written sweep of f32/bf16/i32/i8 x stride 2/3/4/8 x sublane/lane/leading dims, load and store, identical on v5e/v6e/tpu7x)";
    "prng-seed-count", Tpu, [V], SAME, "prng_seed takes at most 2 seeds",
        "pair prng-seed-count: prng_seed(a, b) accepted, prng_seed(a, b, c) rejected (`Setting seed with more than 2 values is not supported`, every generation)";
    "matmul-dtype", Tpu, [V], "f32, bf16 native everywhere; int8 native on v5e/v5p/v6e, compiles on tpu7x (warning matmul-emulated); fp8 native on tpu7x, compiles on v5e/v5p/v6e (warning matmul-emulated); int32 nowhere", "a dot's operands are of a dtype the generation's compiler multiplies",
        "pair matmul-dtype: int8 x int8 accepted, int32 x int32 rejected (`Bad lhs/rhs type`); bf16 x f32 accepted";
    "fp8-op", Tpu, [V], SAME, "fp8 values (float8_e4m3fn, float8_e5m2) take no arithmetic, comparison or reduction (loads, stores, casts to/from f32 and bf16, selects, broadcasts, transposes, reshapes and dots are fine)",
        "pair fp8-op: an fp8 -> f32 -> fp8 cast round trip accepted, an fp8 add rejected (`failed to legalize operation 'arith.addf'`); probes op-dtype/fp8-*: fp8 compares `Target does not support this comparison`, fp8 max reductions `Unsupported element type for the selected reduction`, negations `failed to legalize arith.subf`, scalar fp8 adds (an SMEM table) likewise, on v5e, v5p, v6e and tpu7x alike; fp8 reshapes, selects, transposes, 8-row blocks and SMEM scalar loads compile";
    "vector-op-dtype", Tpu, [V], SAME, "int8 vectors take no arithmetic (add, sub, mul, div, rem, min, max, neg, abs, min/max-selects; bitwise ops, shifts, compares, selects and casts are fine); bf16 vectors take no `rem`",
        "pair vector-op-dtype: int8 xor accepted, int8 add rejected (`Only vector<i16> and vector<i32> are supported`); int8 max: `failed to legalize arith.maxsi`; bf16 rem: `failed to legalize arith.remf` (probe op-all/rem-bf16), f32 rem compiles; pair int8-shift: an int8 shift compiles, an int8 mul is rejected (probes op-more/*-i8 shift every way)";
    "reduce-dtype", Tpu, [V], SAME, "reductions take 32-bit and 16-bit vectors, not int8; bools take max and min (any, all), not sum",
        "pair reduce-dtype: an i32 row sum accepted, an int8 row sum rejected (`Unsupported element type for the selected reduction`)";
    "vector-offset-align", Tpu, [V], SAME, "a dynamic offset of a vector load or store is provably aligned: last dim to 128, second-to-last to 8 (int8: 32; 32-bit types in a ref one lane tile wide or one row: any), rank 1 to 128 * (32 / bits)",
        "pair vector-offset-align: a bf16 load at row program_id * 8 accepted, at program_id * 3 rejected (E2003 `cannot statically prove that index in dimension 0 is a multiple of 8`); lanes at program_id * 128 accepted, * 64 rejected";
    "hbm-direct-access", Semantic, [B, V, I], SAME, "operands in HBM (memory space ANY) are moved by DMA only, never loaded or stored",
        "semantic: the IR has no HBM vector loads (Mosaic would need a DMA); guards hand-built IR";
    "semaphore-access", Semantic, [B, V], SAME, "semaphores are used only by copies (DMA semaphores) and signals / waits (counting semaphores), never loaded or stored",
        "semantic: a semaphore holds no data";

    // ---- DMAs (verify/dma.rs) ----
    "dma-semaphore", Semantic, [B, V], SAME, "a copy signals a DMA semaphore array",
        "semantic: the builder types it; guards hand-built IR";
    "dma-destination", Semantic, [B, V, I], SAME, "a copy writes a scratch buffer or an output, not an input",
        "semantic: inputs are read-only in the Pallas model";
    "dma-dtype", Semantic, [B, V], SAME, "a copy's source and destination have the same dtype",
        "semantic: a DMA moves bytes; a dtype change would reinterpret them";
    "dma-shape", Semantic, [B, V], SAME, "a copy's source and destination boxes have the same shape (up to leading 1s)",
        "semantic: the box is one descriptor";
    "dma-out-of-bounds", Semantic, [V], SAME, "a copy's static slices are inside their arrays",
        "semantic: out-of-bounds copies compile and corrupt memory";
    "dma-align", Tpu, [V], "rows the same on all four; lane offsets a multiple of 128 on v5e and tpu7x, of 8 on v6e and v5p", "a copy slice starts at a proven tile boundary: second-to-last dim a multiple of the packing (1, 2, 4) for slices of at most 8 rows, else of 8 (int8: 32); last dim per generation",
        "pair dma-align: an f32 row slice at program_id * 8 accepted, at program_id * 3 rejected (`Offsets along tiled dimensions must be aligned to tiles`); a bf16 slice at static row 1 rejected; lanes at 128 accepted, at 5 rejected (all four), at 64 accepted on v6e/v5p only";
    "dma-slice-size", Tpu, [V], "rows the same on all four; lanes a multiple of 128 on v5e, of 8 on v6e, v5p and tpu7x", "a copy slice spans whole tiles: rows at most 8 (a multiple of the packing) or a multiple of 8, lanes per generation, or the whole dim",
        "pair dma-slice-size: 16 rows accepted, 12 rows rejected (`Slice sizes along tiled dimensions must be aligned to tiles`); 64 of 256 lanes accepted on v6e/v5p/tpu7x, rejected on v5e (`contiguous inner slice ... divisible by 512 bytes`)";

    // ---- collectives (verify/collective.rs; the interpreter's devices) ----
    "collective-undeclared", Semantic, [B, V], SAME, "a kernel with remote copies, signals to a peer or the barrier semaphore declares its mesh and collective_id",
        "semantic: the emitter writes has_communication and collective_id into the backend_config from the mesh (libtpu 0.0.52 rejects a remote op without them: `Remote op used, but has_communication not specified`); without a mesh no device id can be checked and the interpreter cannot know how many devices to run";
    "mesh-shape", Semantic, [V], SAME, "the mesh has at least one axis, each named once and of size at least 1, and at most 2^16 devices",
        "semantic: the mesh is ours (Mosaic sees only logical device ids); guards hand-built IR";
    "mesh-axis", Semantic, [B], SAME, "axis_index / axis_size / mesh_device name axes of the declared mesh (one coordinate per axis)", "semantic: an IR type error";
    "device-id-range", Semantic, [V, I], SAME, "a remote copy's or signal's device id is inside the mesh (checked when constant, and at run time)",
        "semantic: libtpu compiles any i32 device id; on a device an id outside the mesh addresses no chip (or the wrong one)";
    "semaphore-kind", Semantic, [B, V], SAME, "semaphore_signal / semaphore_wait name a counting semaphore (regular_semaphores or the barrier), not a DMA semaphore",
        "semantic: Mosaic types the two (`!tpu.semaphore` vs `!tpu.dma_semaphore`); the builder keeps them apart, this guards hand-built IR";
    "semaphore-index", Semantic, [V], SAME, "a constant semaphore index of a remote copy, signal or wait is inside its array",
        "semantic: hand-built IR; the builder reports the same as static-out-of-bounds, the interpreter dynamic indices as slice-out-of-bounds";
    "semaphore-amount", Semantic, [V, I], SAME, "a semaphore signal or wait amount is at least 0", "semantic: a negative count has no meaning on the device";
    "mesh-run", Semantic, [I], SAME, "a kernel on a mesh of n devices runs on n devices (interp::run_devices, one set of operands per device)",
        "semantic: host-side; a collective run on one device would wait forever for its peers";
    "device-deadlock", Semantic, [I], SAME, "the devices never all block: some running device can always move (each wait has a signal or copy that comes)",
        "semantic: on the devices the kernel hangs; the interpreter steps every device until none can move and names each one's wait";
    "wait-never-satisfied", Semantic, [I], SAME, "a wait is satisfied before every other device has ended (or, run alone, by the device itself)",
        "semantic: on the device the wait hangs after its peers have finished";
    "remote-buffer-race", Semantic, [I], SAME, "no device touches elements that a remote copy is still writing (before its wait) or overwrites a remote copy's source before it is read, and no copy lands over one not yet waited for",
        "semantic: on the devices the data is silently corrupt or stale; the interpreter lands copies as late as the hardware allows, so an unsafe order shows";
    "semaphore-unbalanced", Semantic, [I], SAME, "every counting semaphore is back at 0 when the kernel ends on every device",
        "semantic: a semaphore is hardware state that outlives the kernel: a leftover count (the barrier's is shared by every kernel of its collective_id) lets a later wait pass too early";

    // ---- performance warnings (verify/warn.rs) ----
    "block-native-tiling", Warning, [V], SAME, "a packed dtype's block rows are a multiple of its native tile (16 bf16, 32 int8) or the whole dim",
        "warning: libtpu compiles int8 blocks of 8, 16, 24 rows and bf16 blocks of 8, 24 rows (probes tiling-rows/*, all four generations); vregs are then partly empty";
    "input-unread", Semantic, [V], SAME, "the grid reads an input's last block along every dim (static index maps); a warning, not an error",
        "semantic (a warning): legal, and libtpu compiles it, but a grid of `k / bk` steps for a `k` that is not a multiple of `bk` silently drops the end of a contraction";
    "matmul-emulated", Warning, [V], "tpu7x: int8 x int8 (its MXU has fp8, not int8); v5e/v5p/v6e: fp8 x fp8 (their MXUs have no fp8 mode)", "a dot's dtype is native to the generation's MXU",
        "warning: libtpu 0.0.52 compiles int8 x int8 for tpu7x (probe op-dtype/dot-i8@tpu7x) and fp8 x fp8 (both formats, and fp8 x bf16) on all four (pair fp8-op's inside kernel and probe op-dtype/dot-fp8-*); compile-only cannot tell whether it is emulated";

    // ---- the builder (builder.rs): type errors of the IR ----
    "duplicate-operand", Semantic, [B], SAME, "operand names are unique", "semantic: names are how errors and the host bind operands";
    "operand-order", Semantic, [B], SAME, "operands are declared prefetch, inputs, outputs, scratch", "semantic: Mosaic's argument order; the emitter relies on it";
    "pipeline-operand", Semantic, [B], SAME, "a nested pipeline (emit_pipeline) streams ANY inputs and outputs in sub-blocks of their rank, 1..=the array dim each, over 1..=2^31 - 1 steps",
        "semantic: the pipeline is ours (it expands to scratch, semaphores and DMA the verifier then checks for the target: dma-slice-size / dma-align for the sub-block tiling, the VMEM budget for the buffers); a VMEM operand has no HBM side to stream";
    "grid-axis", Semantic, [B], SAME, "program_id / num_programs name an existing grid axis", "semantic: an IR type error";
    "constant-type", Semantic, [B], SAME, "a float literal is not used as an integer", "semantic: an IR type error";
    "literal-range", Semantic, [B], SAME, "a literal fits its dtype: integers without wrapping (i8: 300 would be 44), finite floats without rounding to infinity (1e39 as f32)",
        "semantic: Pallas rejects such weak literals when it traces (JAX: `OverflowError: Python int too large to convert`); Mosaic would compile the wrapped or infinite constant";
    "index-rank", Semantic, [B, V], SAME, "an access gives one index per dim of the ref's view", "semantic: an IR type error";
    "index-type", Semantic, [B], SAME, "indices are i32 scalars", "semantic: an IR type error";
    "static-out-of-bounds", Semantic, [B], SAME, "static slices (and semaphore indices) are inside the block", "semantic: Mosaic compiles some out-of-bounds static slices; they read garbage";
    "slice-length", Semantic, [B], SAME, "a slice length is between 1 and the block dim", "semantic: an IR type error";
    "smem-scalar-access", Semantic, [B], SAME, "SMEM refs are read and written one scalar at a time", "semantic: SMEM is scalar memory";
    "store-to-input", Semantic, [B, I], SAME, "inputs are never written", "semantic: inputs are read-only in the Pallas model";
    "store-dtype", Semantic, [B], SAME, "a stored value has the ref's dtype", "semantic: an IR type error";
    "store-shape", Semantic, [B], SAME, "a stored value has the slice's shape (a scalar fills it)",
        "semantic: Pallas rejects the store when it traces (`swap` shape mismatch); the implicit broadcast of a [bm, 1] value into a [bm, n] block hid missing reductions";
    "broadcast-shape", Semantic, [B], SAME, "broadcasts follow numpy rules from a scalar or a same-rank vector with 1s", "semantic: an IR type error";
    "dtype-mismatch", Semantic, [B], SAME, "binary ops take operands of one dtype (a dot may mix bf16 and f32)", "semantic: an IR type error; the mixed bf16 x f32 dot compiles (probe op-dtype/dot-bf16-f32) and promotes to f32";
    "op-dtype", Semantic, [B], SAME, "an op is defined for its operands' dtype class (no float `not`, no int `exp`)", "semantic: an IR type error";
    "slice-stride", Semantic, [B], SAME, "a slice's stride is at least 1", "semantic: a zero stride names one element len times";
    "dma-stride", Semantic, [B, V], SAME, "a DMA copies contiguous boxes (no strided side)", "semantic: Tessera's copy descriptor has no strides (Pallas' strided copies are not modelled); strided data is taken from VMEM with a strided load";
    "cumsum-axis", Semantic, [V], SAME, "a cumsum scans one of the last two axes", "semantic: Tessera lowers cumsum as lane or sublane rotations (Mosaic has no scan op; Pallas 0.10.2 does not lower lax.cumsum at all); the interpreter scans any axis";
    "prng-seed", Semantic, [B], SAME, "prng_seed takes one or more i32 scalars", "semantic: an IR type error (`tpu.prng_set_seed_32` takes i32 scalars)";
    "prng-shape", Semantic, [B], SAME, "prng_random_bits draws a vector of rank >= 2 with no zero dim", "semantic: Mosaic vectors are at least 2-D; reshape afterwards";
    "prng-unseeded", Semantic, [I], SAME, "random bits are drawn only after a prng_seed in the same grid step", "semantic: a TPU's generator state before a seed is unspecified, and grid steps may run on different cores, so each step seeds its own stream";
    "select-condition", Semantic, [B], SAME, "a select's condition is a bool", "semantic: an IR type error";
    "iota-dtype", Semantic, [B], SAME, "an iota is an integer vector (i32 or i8)", "semantic: libtpu compiles i32 and i8 iotas (probes op-dtype/iota-*); float iotas are a cast away";
    "iota-dim", Semantic, [B], SAME, "an iota counts along one of its dims", "semantic: an IR type error";
    "reduce-axis", Semantic, [B], SAME, "a reduction's axis exists", "semantic: an IR type error";
    "dot-rank", Semantic, [B], SAME, "a dot multiplies two rank-2 values", "semantic: the IR's dot is a matrix product";
    "dot-contraction", Semantic, [B], SAME, "a dot's contracted dims are equal", "semantic: an IR type error";
    "transpose-rank", Semantic, [B], SAME, "a transpose has at least two dims", "semantic: an IR type error";
    "reshape-size", Semantic, [B], SAME, "a reshape keeps the element count", "semantic: an IR type error";
    "item-operand", Semantic, [B], SAME, "`item` takes an f32 or i32 vector whose dims are all 1", "semantic: an IR type error; Mosaic moves one 32-bit element of a vector to a scalar register (cast bool, bf16 or int8 to i32 or f32 before reducing)";
    "bitcast-dtype", Semantic, [B], SAME, "a bitcast reads i32 bits as f32 or f32 bits as i32 (equal widths, both unpacked)", "semantic: an IR type error; the narrower pairs (bf16 <-> i16, fp8 <-> i8) have no IR dtype on one side";
    "concat-parts", Semantic, [B], SAME, "a concat joins one or more parts of one dtype and rank, equal but on the joined axis", "semantic: an IR type error";
    "concat-axis", Semantic, [B], SAME, "a concat joins along one of its parts' dims", "semantic: an IR type error";
    "if-condition", Semantic, [B], SAME, "an `if` branches on a scalar bool", "semantic: an IR type error";
    "if-branch-types", Semantic, [B], SAME, "both branches of an `if` yield the same types", "semantic: an IR type error";
    "loop-bounds", Semantic, [B], SAME, "loop bounds are i32 scalars", "semantic: an IR type error";
    "loop-step", Semantic, [B, I], SAME, "a loop step is positive", "semantic: an IR type error";
    "loop-carry-types", Semantic, [B], SAME, "a loop-carried value keeps its type", "semantic: an IR type error";

    // ---- the interpreter (interp.rs): what a run is given ----
    "malformed-ir", Semantic, [V, I], SAME, "the IR is well formed and well typed (ids exist, accesses agree with their refs)", "semantic: IR not made by KernelBuilder, or edited after it";
    "argument-count", Semantic, [I], SAME, "a run gets one array per prefetch and input operand", "semantic: host-side";
    "output-count", Semantic, [I], SAME, "a run gets one buffer per output", "semantic: host-side";
    "argument-dtype", Semantic, [I], SAME, "an argument has its operand's dtype", "semantic: host-side";
    "argument-shape", Semantic, [I], SAME, "an argument has its operand's shape", "semantic: host-side";
    "output-dtype", Semantic, [I], SAME, "an output buffer has its operand's dtype", "semantic: host-side";
    "output-shape", Semantic, [I], SAME, "an output buffer has its operand's shape", "semantic: host-side";
    "prefetch-out-of-bounds", Semantic, [I], SAME, "index maps read scalar-prefetch arrays inside their shape", "semantic: data-dependent, known only at run time";
    "index-map-eval", Semantic, [I], SAME, "an index map evaluates at every grid step", "semantic: data-dependent, known only at run time";
    "slice-out-of-bounds", Semantic, [I], SAME, "dynamic slices and semaphore indices are inside their arrays at run time", "semantic: data-dependent, known only at run time";
    "dma-wait-without-start", Semantic, [I], SAME, "a dma_wait (or remote_copy_wait_send) completes a started copy", "semantic: on a device the wait hangs";
    "dma-wait-mismatch", Semantic, [I], SAME, "a dma_wait's descriptor moves as many bytes as the copy it completes", "semantic: on a device the semaphore count goes wrong";
    "parallel-revisit", Semantic, [V, I], SAME, "no output block is written by two grid steps that differ in a `parallel` dim",
        "semantic: libtpu compiles the race; the verifier walks index maps without scalar prefetch (grids up to 2^13 steps), the interpreter and compiled backends the rest at run time; such steps may run on different cores (megacore) or CPU threads and race";
    "host-memory", Semantic, [I], SAME, "a run's outputs fit the host's memory",
        "semantic: host-side; the allocation is fallible, so a too-large shape is this error, never an abort";
    "dma-unwaited", Semantic, [I], SAME, "every started copy is waited for (by the end of its grid step unless every grid dim is arbitrary); a remote copy at both ends", "semantic: on a device the copy races the next step";
}

/// Rules libtpu judges on some generations only: elsewhere they are ours.
pub const JUDGED_ONLY_ON: &[(&str, &[&str])] = &[("hbm-budget", &["v6e", "tpu7x"])];

impl Rule {
    /// Whether libtpu judges this rule for `target` (`v5e`, `v5p`, `v6e`, `tpu7x`): a
    /// disagreement there is ours to fix; elsewhere the rule is ours by design.
    pub fn libtpu_judges(&self, target: &str) -> bool {
        self.kind == Kind::Tpu && JUDGED_ONLY_ON.iter().find(|(id, _)| *id == self.id).is_none_or(|(_, on)| on.contains(&target))
    }
}

/// Rule ids that were used once and are no longer produced. An id is never reused.
pub const RETIRED: &[(&str, &str)] = &[
    ("vector-rank", "rank-1 vector values compile with libtpu 0.0.52 (probes rank1/*-vector)"),
    ("vmem-rank", "rank-1 VMEM scratch compiles with libtpu 0.0.52 (probes rank1/*-scratch)"),
    ("iota", "split into iota-dtype and iota-dim (one rule, one thing); int8 iotas are now allowed"),
];

/// The rule with this id.
pub fn find(id: &str) -> Option<&'static Rule> {
    RULES.iter().find(|r| r.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_kebab_case_and_never_retired() {
        let mut seen = std::collections::HashSet::new();
        for r in RULES {
            assert!(seen.insert(r.id), "duplicate rule id {}", r.id);
            assert!(r.id.split('-').all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())), "{} is not kebab-case", r.id);
            assert!(r.id.contains('-'), "{}: ids have at least two words, so a test can find them in the sources", r.id);
            assert!(!RETIRED.iter().any(|(id, _)| *id == r.id), "{} is retired", r.id);
            assert!(!r.statement.is_empty() && !r.evidence.is_empty() && !r.checkers.is_empty());
            let says = match r.kind {
                Kind::Tpu => "pair ",
                Kind::Semantic => "semantic",
                Kind::Warning => "warning",
            };
            assert!(r.evidence.starts_with(says), "{}: evidence should start with `{says}`", r.id);
        }
    }
}
