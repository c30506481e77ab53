//! The GEMMs behind `dot` in compiled code: `c[m, n] (+)= a[m, k] b[k, n]` with f32
//! accumulation, operands given by element strides (so transposes are free).
//!
//! On CPUs with AVX-512 a packed, register-tiled kernel (12 x 32 f32 tile, 24 zmm
//! accumulators; bf16 operands multiplied pairwise with `vdpbf16ps` where AVX512-BF16 is
//! present, which treats bf16 denormals as zero) runs on up to `threads` threads, splitting
//! the columns; elsewhere the `gemm` crate (f32; bf16 operands converted first). The order
//! of additions differs from the interpreter's `matrixmultiply` (blocks of 256 along k):
//! dots are compared with a tolerance (`dsl::interp` docs).

use half::bf16;

const MR: usize = 12;
const NR: usize = 32;
const KC: usize = 256;

/// Operand `x[r, c]` at `p + r * rs + c * cs`.
#[derive(Clone, Copy)]
pub struct Mat<T> {
    pub p: *const T,
    pub rs: isize,
    pub cs: isize,
}

// SAFETY: a read-only view shared between the threads of one GEMM, which all finish
// before the call that created it returns.
unsafe impl<T> Send for Mat<T> {}
unsafe impl<T> Sync for Mat<T> {}

#[derive(Clone, Copy)]
struct Out(*mut f32, usize);
// SAFETY: threads write disjoint column ranges of the output.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *F.get_or_init(|| std::is_x86_feature_detected!("avx512f") && std::env::var_os("TESSERA_NO_AVX512").is_none())
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *F.get_or_init(|| has_avx512() && std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Column ranges (multiples of `NR`) for `threads` workers.
fn column_split(n: usize, threads: usize) -> Vec<(usize, usize)> {
    let panels = n.div_ceil(NR);
    let t = threads.clamp(1, panels.max(1));
    (0..t).map(|i| (i * panels / t * NR, ((i + 1) * panels / t * NR).min(n))).filter(|(a, b)| a < b).collect()
}

fn run_split(n: usize, threads: usize, work: u64, f: &(dyn Fn(usize, usize) + Sync)) {
    let parts = if work >= 1 << 22 { column_split(n, threads) } else { vec![(0, n)] };
    if parts.len() <= 1 {
        f(0, n);
        return;
    }
    rayon::scope(|s| {
        for &(a, b) in &parts {
            s.spawn(move |_| f(a, b));
        }
    });
}

/// f32 GEMM.
///
/// # Safety
/// `a`, `b` hold the `m x k`, `k x n` boxes their strides describe; `c` holds `m x n` with
/// row stride `rsc` (column stride 1) and overlaps neither.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(m: usize, n: usize, k: usize, a: Mat<f32>, b: Mat<f32>, c: *mut f32, rsc: usize, accumulate: bool, threads: usize) {
    if m == 0 || n == 0 {
        return;
    }
    if !has_avx512() {
        let par = if threads > 1 && m * n * k >= 1 << 18 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
        // SAFETY: as this function's contract.
        unsafe { gemm::gemm(m, n, k, c, 1, rsc as isize, accumulate, a.p, a.cs, a.rs, b.p, b.cs, b.rs, 1.0f32, 1.0f32, false, false, false, par) };
        return;
    }
    let out = Out(c, rsc);
    run_split(n, threads, (m * n * k) as u64, &|j0, j1| {
        // Capture the whole `Out` (Send), not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let out = out;
        // SAFETY: the column range [j0, j1) of the operands and output (caller's contract).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx512::sgemm_cols(m, k, j0, j1, a, b, out.0, out.1, accumulate)
        };
    });
}

/// bf16 x bf16 GEMM with f32 accumulation and output.
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn bgemm(m: usize, n: usize, k: usize, a: Mat<bf16>, b: Mat<bf16>, c: *mut f32, rsc: usize, accumulate: bool, threads: usize) {
    if m == 0 || n == 0 {
        return;
    }
    if !has_avx512_bf16() {
        // Convert to contiguous f32 and use the f32 GEMM.
        let mut af = vec![0f32; m * k];
        let mut bfv = vec![0f32; k * n];
        for i in 0..m {
            for p in 0..k {
                // SAFETY: inside the operand box.
                af[i * k + p] = unsafe { *a.p.offset(i as isize * a.rs + p as isize * a.cs) }.to_f32();
            }
        }
        for p in 0..k {
            for j in 0..n {
                // SAFETY: inside the operand box.
                bfv[p * n + j] = unsafe { *b.p.offset(p as isize * b.rs + j as isize * b.cs) }.to_f32();
            }
        }
        let (am, bm) = (Mat { p: af.as_ptr(), rs: k as isize, cs: 1 }, Mat { p: bfv.as_ptr(), rs: n as isize, cs: 1 });
        // SAFETY: the copies are contiguous m x k and k x n.
        unsafe { sgemm(m, n, k, am, bm, c, rsc, accumulate, threads) };
        return;
    }
    let out = Out(c, rsc);
    run_split(n, threads, (m * n * k) as u64, &|j0, j1| {
        // Capture the whole `Out` (Send), not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let out = out;
        // SAFETY: the column range [j0, j1) of the operands and output (caller's contract).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx512::bgemm_cols(m, k, j0, j1, a, b, out.0, out.1, accumulate)
        };
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Columns `j0..j1` of `c (+)= a b` in f32.
    ///
    /// # Safety
    /// As [`super::sgemm`], for that column range; the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm_cols(m: usize, k: usize, j0: usize, j1: usize, a: Mat<f32>, b: Mat<f32>, c: *mut f32, rsc: usize, accumulate: bool) {
        let np = (j1 - j0).div_ceil(NR);
        let mut bp = vec![0f32; KC * NR * np];
        let mut ap = vec![0f32; KC * MR];
        let mut pc = 0;
        loop {
            let kc = KC.min(k - pc);
            // Pack B[pc.., j0..j1] into panels of NR columns, k-major.
            for q in 0..np {
                let jq = j0 + q * NR;
                let w = NR.min(j1 - jq);
                let panel = &mut bp[q * KC * NR..];
                for p in 0..kc {
                    let row = &mut panel[p * NR..p * NR + NR];
                    // SAFETY: inside B's box.
                    let src = unsafe { b.p.offset((pc + p) as isize * b.rs + jq as isize * b.cs) };
                    if b.cs == 1 {
                        // SAFETY: `w` contiguous elements of the row.
                        row[..w].copy_from_slice(unsafe { std::slice::from_raw_parts(src, w) });
                    } else {
                        for (j, r) in row[..w].iter_mut().enumerate() {
                            // SAFETY: inside B's box.
                            *r = unsafe { *src.offset(j as isize * b.cs) };
                        }
                    }
                    row[w..].fill(0.0);
                }
            }
            let acc = accumulate || pc > 0;
            let mut i0 = 0;
            while i0 < m {
                let h = MR.min(m - i0);
                for p in 0..kc {
                    for i in 0..MR {
                        ap[p * MR + i] = if i < h {
                            // SAFETY: inside A's box.
                            unsafe { *a.p.offset((i0 + i) as isize * a.rs + (pc + p) as isize * a.cs) }
                        } else {
                            0.0
                        };
                    }
                }
                for q in 0..np {
                    let jq = j0 + q * NR;
                    let w = NR.min(j1 - jq);
                    // SAFETY: the tile [i0, i0 + h) x [jq, jq + w) is inside C.
                    unsafe { tile_f32(kc, ap.as_ptr(), bp.as_ptr().add(q * KC * NR), c.add(i0 * rsc + jq), rsc, acc, h, w) };
                }
                i0 += MR;
            }
            pc += kc;
            if pc >= k {
                break;
            }
        }
        if k == 0 && !accumulate {
            for i in 0..m {
                // SAFETY: inside C.
                unsafe { std::ptr::write_bytes(c.add(i * rsc + j0), 0, j1 - j0) };
            }
        }
    }

    /// One `h x w` (at most `MR x NR`) tile over `kc` packed k steps.
    ///
    /// # Safety
    /// `a` holds `kc * MR`, `b` `kc * NR` floats; the tile is inside C.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_f32(kc: usize, a: *const f32, b: *const f32, c: *mut f32, rsc: usize, acc: bool, h: usize, w: usize) {
        let mut r = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kc {
            // SAFETY: inside the packed panels.
            let (b0, b1) = unsafe { (_mm512_loadu_ps(b.add(p * NR)), _mm512_loadu_ps(b.add(p * NR + 16))) };
            for (i, ri) in r.iter_mut().enumerate() {
                // SAFETY: inside the packed panel.
                let x = _mm512_set1_ps(unsafe { *a.add(p * MR + i) });
                ri[0] = _mm512_fmadd_ps(x, b0, ri[0]);
                ri[1] = _mm512_fmadd_ps(x, b1, ri[1]);
            }
        }
        // SAFETY: the tile is inside C (caller).
        unsafe { write_tile(r, c, rsc, acc, h, w) };
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn write_tile(r: [[__m512; 2]; MR], c: *mut f32, rsc: usize, acc: bool, h: usize, w: usize) {
        if w == NR {
            for (i, ri) in r.iter().enumerate().take(h) {
                // SAFETY: a full row of the tile, inside C.
                unsafe {
                    let row = c.add(i * rsc);
                    let (mut x0, mut x1) = (ri[0], ri[1]);
                    if acc {
                        x0 = _mm512_add_ps(_mm512_loadu_ps(row), x0);
                        x1 = _mm512_add_ps(_mm512_loadu_ps(row.add(16)), x1);
                    }
                    _mm512_storeu_ps(row, x0);
                    _mm512_storeu_ps(row.add(16), x1);
                }
            }
            return;
        }
        let mut tmp = [0f32; NR];
        for (i, ri) in r.iter().enumerate().take(h) {
            // SAFETY: `tmp` holds NR floats; the row's first `w` elements are inside C.
            unsafe {
                _mm512_storeu_ps(tmp.as_mut_ptr(), ri[0]);
                _mm512_storeu_ps(tmp.as_mut_ptr().add(16), ri[1]);
                let row = c.add(i * rsc);
                for (j, &t) in tmp.iter().enumerate().take(w) {
                    *row.add(j) = if acc { *row.add(j) + t } else { t };
                }
            }
        }
    }

    /// Columns `j0..j1` of `c (+)= a b` for bf16 operands, pairs along k through `vdpbf16ps`.
    ///
    /// # Safety
    /// As [`super::bgemm`], for that column range; the CPU has AVX-512F, -BW and -BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bgemm_cols(m: usize, k: usize, j0: usize, j1: usize, a: Mat<half::bf16>, b: Mat<half::bf16>, c: *mut f32, rsc: usize, accumulate: bool) {
        const KC2: usize = KC * 2; // bf16 elements per k block (KC pairs)
        let np = (j1 - j0).div_ceil(NR);
        // B panels: per pair p, per column j, (b[2p, j], b[2p+1, j]).
        let mut bp = vec![0u16; KC2 * NR * np];
        let mut ap = vec![0u32; KC * MR];
        let rd = |m: &Mat<half::bf16>, r: usize, col: usize| -> u16 {
            // SAFETY: callers index inside the operand's box.
            unsafe { (*m.p.offset(r as isize * m.rs + col as isize * m.cs)).to_bits() }
        };
        // Lane 2j of the interleave is r0[j], lane 2j + 1 is r1[j] (index 32 + j).
        let lanes: [i16; 64] = std::array::from_fn(|l| (l / 2 + (l % 2) * 32) as i16);
        // SAFETY: 64 i16 are two 512-bit vectors.
        let (interleave_lo, interleave_hi) = unsafe { (_mm512_loadu_si512(lanes.as_ptr() as *const _), _mm512_loadu_si512(lanes.as_ptr().add(32) as *const _)) };
        let mut pc = 0;
        loop {
            let kc = KC2.min(k - pc);
            let pairs = kc.div_ceil(2);
            for q in 0..np {
                let jq = j0 + q * NR;
                let w = NR.min(j1 - jq);
                let panel = &mut bp[q * KC2 * NR..];
                for p in 0..pairs {
                    let row = &mut panel[p * 2 * NR..(p + 1) * 2 * NR];
                    let (k0, k1) = (pc + 2 * p, pc + 2 * p + 1);
                    if b.cs == 1 && w == NR && k1 < pc + kc {
                        // Two contiguous rows of NR = 32 bf16 interleaved by two permutes
                        // (the common case; as a scalar loop it was a quarter of gmm's time).
                        // SAFETY: `NR` contiguous elements of rows k0 and k1 inside B's box;
                        // `row` holds 2 * NR u16.
                        unsafe {
                            let r0 = _mm512_loadu_si512(b.p.offset(k0 as isize * b.rs + jq as isize) as *const _);
                            let r1 = _mm512_loadu_si512(b.p.offset(k1 as isize * b.rs + jq as isize) as *const _);
                            _mm512_storeu_si512(row.as_mut_ptr() as *mut _, _mm512_permutex2var_epi16(r0, interleave_lo, r1));
                            _mm512_storeu_si512(row.as_mut_ptr().add(NR) as *mut _, _mm512_permutex2var_epi16(r0, interleave_hi, r1));
                        }
                        continue;
                    }
                    for j in 0..NR {
                        let (x, y) = if j < w { (rd(&b, k0, jq + j), if k1 < pc + kc { rd(&b, k1, jq + j) } else { 0 }) } else { (0, 0) };
                        row[2 * j] = x;
                        row[2 * j + 1] = y;
                    }
                }
            }
            let acc = accumulate || pc > 0;
            let mut i0 = 0;
            while i0 < m {
                let h = MR.min(m - i0);
                if a.cs == 1 && h == MR && kc.is_multiple_of(2) {
                    // Row-major A: a k pair is one u32 in memory; transpose rows into the panel.
                    for i in 0..MR {
                        // SAFETY: `kc` contiguous elements of row i0 + i inside A's box.
                        let src = unsafe { a.p.offset((i0 + i) as isize * a.rs + pc as isize) } as *const u32;
                        for p in 0..pairs {
                            // SAFETY: pair p of that row (unaligned: bf16 rows need not start at 4 bytes).
                            ap[p * MR + i] = unsafe { src.add(p).read_unaligned() };
                        }
                    }
                } else {
                    for p in 0..pairs {
                        let (k0, k1) = (pc + 2 * p, pc + 2 * p + 1);
                        for i in 0..MR {
                            ap[p * MR + i] = if i < h {
                                let x = rd(&a, i0 + i, k0) as u32;
                                let y = if k1 < pc + kc { rd(&a, i0 + i, k1) as u32 } else { 0 };
                                x | (y << 16)
                            } else {
                                0
                            };
                        }
                    }
                }
                for q in 0..np {
                    let jq = j0 + q * NR;
                    let w = NR.min(j1 - jq);
                    // SAFETY: the tile is inside C; the panels hold `pairs` steps.
                    unsafe { tile_bf16(pairs, ap.as_ptr(), bp.as_ptr().add(q * KC2 * NR), c.add(i0 * rsc + jq), rsc, acc, h, w) };
                }
                i0 += MR;
            }
            pc += kc;
            if pc >= k {
                break;
            }
        }
        if k == 0 && !accumulate {
            for i in 0..m {
                // SAFETY: inside C.
                unsafe { std::ptr::write_bytes(c.add(i * rsc + j0), 0, j1 - j0) };
            }
        }
    }

    /// One `h x w` (at most MR x 2 * NR) tile of C from `pairs` packed bf16 pairs.
    ///
    /// # Safety
    /// The CPU has avx512f and avx512bf16 (checked by the caller's dispatch); `a` holds
    /// `pairs * MR` u32 pairs, `b` `pairs * 2 * NR` u16 values, and `c` rows `0..h` of `w`
    /// lanes at stride `rsc` are valid for writes.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_bf16(pairs: usize, a: *const u32, b: *const u16, c: *mut f32, rsc: usize, acc: bool, h: usize, w: usize) {
        let mut r = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..pairs {
            // SAFETY: inside the packed panels (2 * NR bf16 per pair).
            let (b0, b1): (__m512bh, __m512bh) = unsafe { (std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(p * 2 * NR) as *const _)), std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(p * 2 * NR + NR) as *const _))) };
            for (i, ri) in r.iter_mut().enumerate() {
                // SAFETY: inside the packed panel.
                let x: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.add(p * MR + i) as i32)) };
                ri[0] = _mm512_dpbf16_ps(ri[0], x, b0);
                ri[1] = _mm512_dpbf16_ps(ri[1], x, b1);
            }
        }
        // SAFETY: the tile is inside C (caller).
        unsafe { write_tile(r, c, rsc, acc, h, w) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                for j in 0..n {
                    c[i * n + j] += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
            }
        }
        c
    }

    #[test]
    fn sgemm_and_bgemm_match_a_reference_on_odd_shapes() {
        for &(m, n, k) in &[(1, 1, 1), (13, 33, 7), (12, 32, 256), (25, 70, 300), (7, 5, 600), (40, 96, 513)] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 64.0).collect();
            let want = reference(m, n, k, &a, &b);
            for threads in [1, 3] {
                for acc in [false, true] {
                    let mut c = vec![1.0f32; m * n];
                    // SAFETY: contiguous operands of the stated shapes.
                    unsafe { sgemm(m, n, k, Mat { p: a.as_ptr(), rs: k as isize, cs: 1 }, Mat { p: b.as_ptr(), rs: n as isize, cs: 1 }, c.as_mut_ptr(), n, acc, threads) };
                    for (g, w) in c.iter().zip(&want) {
                        let w = if acc { w + 1.0 } else { *w };
                        assert!((*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "sgemm {m}x{n}x{k}: {g} vs {w}");
                    }
                    // bf16 operands: the values above are exact in bf16.
                    let ab: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
                    let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
                    let mut c = vec![1.0f32; m * n];
                    // SAFETY: as above; the transposed view of `bb` is k x n with strides (1, k)... use row-major.
                    unsafe { bgemm(m, n, k, Mat { p: ab.as_ptr(), rs: k as isize, cs: 1 }, Mat { p: bb.as_ptr(), rs: n as isize, cs: 1 }, c.as_mut_ptr(), n, acc, threads) };
                    for (g, w) in c.iter().zip(&want) {
                        let w = if acc { w + 1.0 } else { *w };
                        assert!((*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "bgemm {m}x{n}x{k}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    #[ignore]
    fn gemm_speed() {
        let (m, n, k) = (512, 1024, 512);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32).collect();
        let mut c = vec![0f32; m * n];
        for round in 0..3 {
            let t = std::time::Instant::now();
            // SAFETY: contiguous operands.
            unsafe { sgemm(m, n, k, Mat { p: a.as_ptr(), rs: k as isize, cs: 1 }, Mat { p: b.as_ptr(), rs: n as isize, cs: 1 }, c.as_mut_ptr(), n, false, 1) };
            let e = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            // SAFETY: contiguous operands.
            unsafe { gemm::gemm(m, n, k, c.as_mut_ptr(), 1, n as isize, false, a.as_ptr(), 1, k as isize, b.as_ptr(), 1, n as isize, 1.0f32, 1.0f32, false, false, false, gemm::Parallelism::None) };
            let g = t.elapsed().as_secs_f64();
            eprintln!("round {round}: ours {:.1} GFLOPS, gemm crate {:.1} GFLOPS", 2.0 * (m * n * k) as f64 / e / 1e9, 2.0 * (m * n * k) as f64 / g / 1e9);
        }
    }
}
