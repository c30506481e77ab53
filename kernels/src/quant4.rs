//! 4-bit weights dequantised in VMEM: `out[m, n] = x[m, k] @ W[k, n]` where `W` is stored
//! as 4-bit codes with one scale per `g` consecutive elements of K, in three formats:
//!
//! | op | code | scale (`[k / g, n]`) | `W[p, j]` |
//! |---|---|---|---|
//! | `matmul_int4` | signed int4, -8..7 | f32 or bf16, any `g` that is a multiple of 32 | `code * scale[p / g, j]` |
//! | `matmul_mxfp4` | FP4 E2M1 (OCP MX) | E8M0 bytes (`float8_e8m0fnu`: `2^(e - 127)`, 255 = NaN), `g = 32` | `fp4(code) * 2^(e - 127)` |
//! | `matmul_nvfp4` | FP4 E2M1 | float8_e4m3fn, `g = 16`, times one f32 `global_scale` | `fp4(code) * scale * global_scale` |
//!
//! E2M1's values are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. The scales are read in their checkpoint
//! formats (one byte per 32 or 16 weights for MXFP4/NVFP4), so HBM carries 4.25 or 4.5 bits
//! per weight; the kernel decodes them with integer ops (E8M0 by building the f32 bits).
//!
//! **Packing (the kernel's layout).** `w` is int8 `[k / 2, n]`, K-major (`W`'s rows are K, as
//! `x @ W`), two codes per byte in *nibble planes of 32 rows*: byte `(32 c + i, j)` holds
//! `W[64 c + i, j]` in its low nibble and `W[64 c + 32 + i, j]` in its high nibble. A
//! 32-row slice of the block unpacks, with a mask and a shift, into two 32-row slices of
//! `W` that are whole sublane tiles, so no lane or sublane shuffle is needed (checkpoints
//! pack consecutive K pairs into a byte; `tessera.quant4` in the torch package repacks them
//! once, at load time, as serving stacks repack for their kernels). `k % 64 == 0`.
//!
//! **The kernel.** Grid `(m / bm, n / bn, k / bk)`, the K axis last and `arbitrary`. Each step
//! decodes its scale block to f32 once, dequantises the `[bk / 2, bn]` int8 block into a
//! `[bk, bn]` VMEM tile of `x`'s dtype (32 rows of each nibble plane at a time), and
//! accumulates one MXU product `x_block @ tile` in f32 (the global scale is folded into the
//! step's scales, as torch dequantises first). A dequantised weight is rounded to `x`'s dtype once (exact in bf16 for MXFP4 and
//! NVFP4, whose products have at most 6 significant bits; int4 times a bf16 or f32 scale
//! rounds as torch's dequantise-then-cast does).

use rand::{rngs::StdRng, Rng};
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Kernel, KernelError, Target, Type};
use tessera_macros::{tpu_fn, tpu_kernel};

use crate::blocks::fit_blocks;
use crate::op::{Backward, Call, Case, Input, Kind, Op, Output};
use crate::plan::{host, single, Plan};

/// Rows of a nibble plane: packed rows `32c..32c+32` hold K `64c..64c+32` (low nibbles) and
/// `64c+32..64c+64` (high nibbles).
pub const PLANE: usize = 32;

/// The code and scale format of a 4-bit weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Signed int4 with f32 / bf16 group scales.
    Int4,
    /// OCP MXFP4: E2M1 codes, E8M0 scales per 32.
    Mxfp4,
    /// NVFP4: E2M1 codes, e4m3fn scales per 16, and a global f32 scale.
    Nvfp4,
}

impl Format {
    /// The group size the format fixes (int4's comes from the scale's shape).
    pub fn fixed_group(self) -> Option<usize> {
        match self {
            Format::Int4 => None,
            Format::Mxfp4 => Some(32),
            Format::Nvfp4 => Some(16),
        }
    }
}

/// `out = x @ W` (grid `(m, n, k)`), or with `dx` the input gradient `dx = dy @ W^T` (grid
/// `(m, k, n)`, `dy` in `x`'s place): either way the contraction is the last, `arbitrary`
/// axis and each step dequantises one `[bk / 2, bn]` block of `w` into `wdq`.
#[tpu_kernel(
    grid = [m.div_ceil(bm), if dx { 2 * kh / bk } else { n.div_ceil(bn) }, if dx { n / bn } else { 2 * kh / bk }],
    semantics = [parallel, parallel, arbitrary],
    x = block([bm, if dx { bn } else { bk }], |i, a, c| [i, c]),
    w = block([bk / 2, bn], |i, a, c| [if dx { a } else { c }, if dx { c } else { a }]),
    scale = block([bk / g, bn], |i, a, c| [if dx { a } else { c }, if dx { c } else { a }]),
    global_scale = block([1, 1], |i, a, c| [0, 0]),
    out = block([bm, if dx { bk } else { bn }], |i, a, c| [i, a]),
    acc = scratch([bm, if dx { bk } else { bn }], f32),
    sdq = scratch([bk / g, bn], f32),
    wdq = scratch([bk, bn], x.dtype),
)]
#[rustfmt::skip]
pub fn matmul_4bit_kernel(
    x: In<m, _>, w: In<kh, n>, scale: In<ks, n>, global_scale: In<1, 1>, out: Out<m, _>, acc: Scratch, sdq: Scratch, wdq: Scratch,
    bm: usize, bn: usize, bk: usize, g: usize, format: Format, dx: bool,
) {
    if program_id(2) == 0 {
        acc[..] = zeros([bm, if dx { bk } else { bn }], f32);
    }
    // The step's scales in f32, times the global scale (1 but for NVFP4): applied to each
    // weight before the product, as torch's dequantise-first (an inf global scale makes a
    // zero code NaN). The FP4 formats' decode below gives twice the E2M1 value (an
    // integer), so their scales carry the 1/2 (exact).
    let global = global_scale[..];
    if format == Format::Int4 {
        sdq[..] = scale[..].cast(f32) * global;
    } else if format == Format::Mxfp4 {
        sdq[..] = e8m0_to_f32(scale[..].cast(i32) & 255) * 0.5 * global;
    } else {
        sdq[..] = scale[..].cast(f32) * 0.5 * global;
    }
    for c in 0..bk / 64 {
        let p = w[(ds(c * PLANE, PLANE), ..)].cast(i32);
        for h in 0..2 {
            // Low nibbles are K rows 64c..64c+32, high nibbles the next 32.
            let code = if format == Format::Int4 {
                if h == 0 { (p << 28) >> 28 } else { (p << 24) >> 28 }
            } else {
                e2m1_twice(if h == 0 { p & 15 } else { (p >> 4) & 15 })
            };
            let k0 = c * 64 + h * PLANE;
            let s = if g >= PLANE {
                sdq[(ds(k0 / g, 1), ..)].broadcast_to([PLANE, bn])
            } else {
                // Groups of 16: two scale rows per 32-row slice.
                let first = sdq[(ds(k0 / g, 1), ..)].broadcast_to([PLANE, bn]);
                let second = sdq[(ds(k0 / g + 1, 1), ..)].broadcast_to([PLANE, bn]);
                select(iota([PLANE, bn], 0) < 16, first, second)
            };
            wdq[(ds(k0, PLANE), ..)] = (code.cast(f32) * s).cast(wdq.dtype);
        }
    }
    if dx {
        acc[..] += dot_t(x[..], wdq[..]);
    } else {
        acc[..] += dot(x[..], wdq[..]);
    }
    if program_id(2) == num_programs(2) - 1 {
        out[..] = acc[..].cast(out.dtype);
    }
}

/// Twice an E2M1 code's value, as i32, from the code's 4 bits (sign, 2 exponent bits, 1
/// mantissa bit): magnitudes 0, 1 (subnormal 0.5) and `(2 + m) << (e - 1)` for `e >= 1`.
#[tpu_fn]
fn e2m1_twice(code: Value) -> Value {
    let mag = code & 7;
    let normal = (2 + (mag & 1)) << ((mag >> 1) - 1);
    let t = select(mag < 2, mag, normal);
    select((code & 8) != 0, 0 - t, t)
}

/// An E8M0 byte (0..255 as i32) as the f32 `2^(e - 127)`: the exponent field of an f32 for
/// `e` in 1..254, the subnormal `2^-127` for 0, NaN for 255 (the OCP MX encoding).
#[tpu_fn]
fn e8m0_to_f32(e: Value) -> Value {
    select(e == 0, 4194304, select(e == 255, 2143289344, e << 23)).bitcast(f32)
}

/// Blocks of [`matmul_4bit_kernel`]: `bm`, `bn` up to 512 (partial edge blocks), `bk` the
/// largest multiple of 128 up to 1024 (or up to the smallest such step, for large groups)
/// that divides `k` and holds whole groups making a scale block of whole sublane tiles (8
/// rows of f32, 16 of bf16, 32 of the byte formats), else all of `k` (the scale block then
/// all of the scale's rows); then halved (bk, bn, bm) until the windows fit 3/4 of the
/// default scoped VMEM.
pub fn blocks(m: usize, k: usize, n: usize, g: usize, x: DType, scale: DType, dx: bool, target: &Target) -> (usize, usize, usize) {
    let scale_rows = target.native_tile(scale).0;
    // A K step of whole groups whose scale rows are whole tiles: a multiple of 128 and of
    // `g * scale_rows` (a step shorter than a group would have a scale block of 0 rows).
    let step = lcm(128, g * scale_rows);
    let fits = |bk: usize| k % bk == 0 && bk % step == 0;
    let mut bk = (1..=step.max(1024) / step).rev().map(|i| i * step).find(|&bk| bk <= k && fits(bk)).unwrap_or(k);
    // The forward's n blocks may be partial (garbage columns only reach garbage outputs);
    // `dx` contracts over n, so its n blocks divide n.
    let (mut bm, mut bn) = (m.min(512), if dx { crate::blocks::pick_block(n, 512, 128) } else { n.min(512) });
    let vmem = |bm: usize, bk: usize, bn: usize| {
        2 * (target.padded_bytes(x, &[bm, bk]) + target.padded_bytes(DType::I8, &[bk / 2, bn]) + target.padded_bytes(scale, &[bk / g, bn]) + target.padded_bytes(x, &[bm, bn]))
            + target.padded_bytes(DType::F32, &[bm, if dx { bk } else { bn }])
            + target.padded_bytes(x, &[bk, bn])
            + target.padded_bytes(DType::F32, &[bk / g, bn])
    };
    // Halving keeps bk dividing k but may break the scale tiling: only while it holds.
    let budget = target.default_scoped_vmem_bytes * 3 / 4;
    while vmem(bm, bk, bn) > budget && bk % 256 == 0 && fits(bk / 2) {
        bk /= 2;
    }
    if dx {
        fit_blocks(&mut [(&mut bm, m)], budget, |b| vmem(b[0], bk, bn));
    } else {
        fit_blocks(&mut [(&mut bn, n), (&mut bm, m)], budget, |b| vmem(b[1], bk, b[0]));
    }
    (bm, bn, bk)
}

/// The 4-bit matmul of `format` (with `dx`, its input gradient `dy @ W^T`) for the call's
/// target, from the operand types (the contract checked): the kernel and the types of its
/// four inputs (the last is the `[1, 1]` global scale).
pub fn matmul_4bit(c: &Call, format: Format, dx: bool) -> Result<(Kernel, [Type; 4])> {
    let op = c.op;
    let first = if dx { "dy" } else { "x" };
    let x = c.tensor(first)?.clone();
    let w = c.tensor("w")?.clone();
    let scale = c.tensor("scale")?.clone();
    let (m, n) = (x.shape[0], w.shape[1]);
    let k = if dx { 2 * w.shape[0] } else { x.shape[1] };
    if w.shape[0] * 2 != k {
        return Err(c.err("input `w`", "operand-shape", format!("x is {x}, so w must hold k / 2 = {} rows (two 4-bit codes per byte), but w is {w}", k / 2), format!("pack W [k, n] into int8 [{}, {n}] with tessera.quant4 (two codes per byte)", k / 2)));
    }
    if k % 64 != 0 {
        let subject = if dx { "input `w`" } else { "input `x`" };
        return Err(c.err(subject, "operand-shape", format!("k = {k} is not a multiple of 64 (the packed layout's 32-row nibble planes)"), "pad K to a multiple of 64 with zero weights and zero activations"));
    }
    let rows = scale.shape[0];
    let g = match format.fixed_group() {
        Some(g) if rows * g == k => g,
        Some(g) => return Err(c.err("input `scale`", "operand-shape", format!("{op} has one scale per {g} weights of K: scale must be [{}, {n}], got {scale}", k / g), format!("pass scale of shape [{}, {n}]", k / g))),
        None if rows > 0 && k % rows == 0 && (k / rows) % PLANE == 0 => k / rows,
        None => return Err(c.err("input `scale`", "operand-shape", format!("scale is {scale}: k = {k} rows of W in groups of k / {rows}, which must be a whole multiple of 32"), "pass scale [k / g, n] with a group size g that divides k and is a multiple of 32 (32, 64, 128, ...)")),
    };
    if format == Format::Nvfp4 && scale.dtype == DType::F8E5M2 {
        return Err(c.err("input `scale`", "operand-dtype", "NVFP4 scales are float8_e4m3fn, got float8_e5m2", "pass the checkpoint's float8_e4m3fn scales (or their float32 / bfloat16 values)"));
    }
    let (bm, bn, bk) = blocks(m, k, n, g, x.dtype, scale.dtype, dx, c.target);
    let global = Type::vector(DType::F32, &[1, 1]);
    let out = Type::vector(x.dtype, &[m, if dx { k } else { n }]);
    let kernel = matmul_4bit_kernel(x.clone(), w.clone(), scale.clone(), global.clone(), out, bm, bn, bk, g, format, dx)?;
    Ok((kernel, [x, w, scale, global]))
}

type Result<T> = std::result::Result<T, KernelError>;

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// The plan of the forward (`dx` false) or the input gradient: one launch, the global scale
/// an input for NVFP4 and a host 1.0 for the others.
fn plan_4bit(c: &Call, format: Format, dx: bool) -> Result<Plan> {
    let (kernel, [x, w, scale, global]) = matmul_4bit(c, format, dx)?;
    let mut args = vec![c.input(if dx { "dy" } else { "x" }, x)?, c.input("w", w)?, c.input("scale", scale)?];
    if format == Format::Nvfp4 {
        args.push(c.input("global_scale", global)?);
        return Ok(single(c, kernel, args, &[]));
    }
    args.push(host(0, global));
    Ok(single(c, kernel, args, &[]).with_host(vec![Array::from_f32(&[1, 1], vec![1.0])]))
}

// ---- the reference (f64: decode, dequantise, multiply) ------------------------------------------

/// E2M1's value of a 4-bit code.
pub fn e2m1_value(code: u8) -> f64 {
    const MAG: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = MAG[(code & 7) as usize];
    if code & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The code of `W[p, j]` in the packed `w [k / 2, n]` (bytes as i8 values).
pub fn code_at(w: &[f64], n: usize, p: usize, j: usize) -> u8 {
    let (c, r) = (p / 64, p % 64);
    let byte = w[(c * PLANE + r % PLANE) * n + j] as i64 as u8;
    if r < PLANE {
        byte & 15
    } else {
        byte >> 4
    }
}

/// `W [k, n]` decoded and dequantised in f64 from the packed `w [k / 2, n]` (`scale` holds
/// the scale values: int4 and NVFP4 scales as numbers, MXFP4's as E8M0 bytes read as i8).
pub fn dequantize(format: Format, w: &[f64], scale: &[f64], global: f64, k: usize, n: usize) -> Vec<f64> {
    let g = format.fixed_group().unwrap_or(k / (scale.len() / n));
    (0..k * n)
        .map(|e| {
            let (p, j) = (e / n, e % n);
            let code = code_at(w, n, p, j);
            let s = scale[(p / g) * n + j];
            match format {
                Format::Int4 => ((code << 4) as i8 >> 4) as f64 * s,
                Format::Mxfp4 => {
                    let byte = s as i64 as u8;
                    let s = if byte == 255 { f64::NAN } else { 2f64.powi(byte as i32 - 127) };
                    e2m1_value(code) * s
                }
                Format::Nvfp4 => e2m1_value(code) * s * global,
            }
        })
        .collect()
}

/// The f64 reference of the forward (`x @ W`) or, with `dx`, of the input gradient
/// (`dy @ W^T`), from the op's input arrays.
fn reference_of(format: Format, dx: bool, a: &[Array]) -> Vec<Vec<f64>> {
    let (m, n) = (a[0].shape[0], a[1].shape[1]);
    let k = 2 * a[1].shape[0];
    let global = if format == Format::Nvfp4 { a[3].to_f64_vec()[0] } else { 1.0 };
    let deq = dequantize(format, &a[1].to_f64_vec(), &a[2].to_f64_vec(), global, k, n);
    if dx {
        let deq_t: Vec<f64> = (0..n * k).map(|e| deq[(e % k) * n + e / k]).collect();
        vec![crate::reference::matmul(&a[0].to_f64_vec(), &deq_t, m, n, k)]
    } else {
        vec![crate::reference::matmul(&a[0].to_f64_vec(), &deq, m, k, n)]
    }
}

// ---- random inputs -------------------------------------------------------------------------------

fn random_inputs(format: Format, shapes: &[Vec<usize>], dtype: DType, rng: &mut StdRng) -> Vec<Array> {
    let count = |s: &[usize]| s.iter().product::<usize>();
    let x: Vec<f32> = (0..count(&shapes[0])).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let w: Vec<i8> = (0..count(&shapes[1])).map(|_| rng.gen::<u8>() as i8).collect();
    let s = &shapes[2];
    let scale = match format {
        Format::Int4 => Array::from_f32_in(dtype, s, (0..count(s)).map(|_| rng.gen_range(0.005f32..0.05)).collect()),
        // Exponents 2^-8 .. 2^2, and now and then the extreme finite codes (2^-127, 2^127 is
        // avoided: it overflows the sum).
        Format::Mxfp4 => Array::from_i8(s, (0..count(s)).map(|_| if rng.gen_ratio(1, 64) { 0 } else { rng.gen_range(119u8..=129) as i8 }).collect()),
        Format::Nvfp4 => Array::from_f32_as_fp8(DType::F8E4M3FN, s, &(0..count(s)).map(|_| rng.gen_range(0.02f32..4.0)).collect::<Vec<_>>()),
    };
    let mut out = vec![Array::from_f32_in(dtype, &shapes[0], x), Array::from_i8(&shapes[1], w), scale];
    if format == Format::Nvfp4 {
        out.push(Array::from_f32(&shapes[3], vec![rng.gen_range(0.001f32..0.01)]));
    }
    out
}

/// `x`'s (or `dy`'s) input spec: the run's float dtype.
const X: Input = Input { name: "x", dims: "[m, k]", kind: Kind::Float };
const DY: Input = Input { name: "dy", dims: "[m, n]", kind: Kind::Float };
const W: Input = Input { name: "w", dims: "[kh, n]", kind: Kind::Int8 };
const GLOBAL: Input = Input { name: "global_scale", dims: "[1]", kind: Kind::Float32 };

#[rustfmt::skip]
pub const OPS: &[Op] = &[
    Op {
        name: "matmul_int4", doc: "x [m, k] @ W with W int4 (-8..7) in the nibble-plane packing (int8 w [k/2, n], see tessera.quant4) and f32 / bf16 group scales [k/g, n] (g a multiple of 32): dequantised in VMEM, f32 accumulation, x's dtype out; k % 64 == 0",
        schema: "(Tensor x, Tensor w, Tensor scale) -> Tensor", plan: |c| plan_4bit(c, Format::Int4, false),
        reference: Some(|a, _| reference_of(Format::Int4, false, a)),
        inputs: &[X, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::Float }],
        outputs: &[Output { name: "out", shape: "[x.0, w.1]", dtype: "x" }],
        backward: Some(Backward { op: "matmul_int4_dx", args: "d_out, w, scale", grads: &["x"] }),
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 2048], &[1024, 1536], &[16, 1536]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 192], &[96, 200], &[6, 200]] },
            Case { name: "group_64", statics: "", shapes: &[&[40, 2880], &[1440, 640], &[45, 640]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Int4, s, d, r)), ..Op::EMPTY
    },
    Op {
        name: "matmul_int4_dx", doc: "matmul_int4's input gradient: dy [m, n] @ W^T, W dequantised in VMEM as the forward does, f32 accumulation over n (w and scale get no gradient)",
        schema: "(Tensor dy, Tensor w, Tensor scale) -> Tensor", plan: |c| plan_4bit(c, Format::Int4, true),
        reference: Some(|a, _| reference_of(Format::Int4, true, a)),
        inputs: &[DY, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::Float }],
        outputs: &[Output { name: "dx", shape: "[dy.0, w.0 * 2]", dtype: "dy" }],
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 1536], &[1024, 1536], &[16, 1536]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 200], &[96, 200], &[6, 200]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Int4, s, d, r)), ..Op::EMPTY
    },
    Op {
        name: "matmul_mxfp4", doc: "x [m, k] @ W with W in OCP MXFP4 (E2M1 codes in the nibble-plane packing, int8 w [k/2, n], see tessera.quant4; E8M0 scale bytes [k/32, n] as int8 bits): dequantised in VMEM, f32 accumulation, x's dtype out; k % 64 == 0",
        schema: "(Tensor x, Tensor w, Tensor scale) -> Tensor", plan: |c| plan_4bit(c, Format::Mxfp4, false),
        reference: Some(|a, _| reference_of(Format::Mxfp4, false, a)),
        inputs: &[X, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::Int8 }],
        outputs: &[Output { name: "out", shape: "[x.0, w.1]", dtype: "x" }],
        backward: Some(Backward { op: "matmul_mxfp4_dx", args: "d_out, w, scale", grads: &["x"] }),
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 2048], &[1024, 1536], &[64, 1536]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 192], &[96, 200], &[6, 200]] },
            Case { name: "gpt_oss", statics: "", shapes: &[&[40, 2880], &[1440, 640], &[90, 640]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Mxfp4, s, d, r)), ..Op::EMPTY
    },
    Op {
        name: "matmul_mxfp4_dx", doc: "matmul_mxfp4's input gradient: dy [m, n] @ W^T, W dequantised in VMEM as the forward does, f32 accumulation over n (w and scale get no gradient)",
        schema: "(Tensor dy, Tensor w, Tensor scale) -> Tensor", plan: |c| plan_4bit(c, Format::Mxfp4, true),
        reference: Some(|a, _| reference_of(Format::Mxfp4, true, a)),
        inputs: &[DY, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::Int8 }],
        outputs: &[Output { name: "dx", shape: "[dy.0, w.0 * 2]", dtype: "dy" }],
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 1536], &[1024, 1536], &[64, 1536]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 200], &[96, 200], &[6, 200]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Mxfp4, s, d, r)), ..Op::EMPTY
    },
    Op {
        name: "matmul_nvfp4", doc: "x [m, k] @ W with W in NVFP4 (E2M1 codes in the nibble-plane packing, int8 w [k/2, n], see tessera.quant4; float8_e4m3fn scales [k/16, n]; one float32 global_scale [1]): dequantised in VMEM, f32 accumulation, x's dtype out; k % 64 == 0",
        schema: "(Tensor x, Tensor w, Tensor scale, Tensor global_scale) -> Tensor", plan: |c| plan_4bit(c, Format::Nvfp4, false),
        reference: Some(|a, _| reference_of(Format::Nvfp4, false, a)),
        inputs: &[X, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::AnyFloat }, GLOBAL],
        outputs: &[Output { name: "out", shape: "[x.0, w.1]", dtype: "x" }],
        backward: Some(Backward { op: "matmul_nvfp4_dx", args: "d_out, w, scale, global_scale", grads: &["x"] }),
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 2048], &[1024, 1536], &[128, 1536], &[1]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 192], &[96, 200], &[12, 200], &[1]] },
            Case { name: "wide_k", statics: "", shapes: &[&[40, 2880], &[1440, 640], &[180, 640], &[1]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Nvfp4, s, d, r)), ..Op::EMPTY
    },
    Op {
        name: "matmul_nvfp4_dx", doc: "matmul_nvfp4's input gradient: dy [m, n] @ W^T (global scale included), W dequantised in VMEM as the forward does, f32 accumulation over n (w and the scales get no gradient)",
        schema: "(Tensor dy, Tensor w, Tensor scale, Tensor global_scale) -> Tensor", plan: |c| plan_4bit(c, Format::Nvfp4, true),
        reference: Some(|a, _| reference_of(Format::Nvfp4, true, a)),
        inputs: &[DY, W, Input { name: "scale", dims: "[ks, n]", kind: Kind::AnyFloat }, GLOBAL],
        outputs: &[Output { name: "dx", shape: "[dy.0, w.0 * 2]", dtype: "dy" }],
        cases: &[
            Case { name: "default", statics: "", shapes: &[&[256, 1536], &[1024, 1536], &[128, 1536], &[1]] },
            Case { name: "edges", statics: "", shapes: &[&[5, 200], &[96, 200], &[12, 200], &[1]] },
        ],
        random: Some(|s, d, _, r| random_inputs(Format::Nvfp4, s, d, r)), ..Op::EMPTY
    },
];
