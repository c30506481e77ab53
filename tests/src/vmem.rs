//! libtpu's own VMEM figure for a kernel, to calibrate the verifier's estimate.
//!
//! How: compile the kernel under a scoped limit `L` it cannot meet. libtpu allocates the
//! scoped buffers in order and fails at the first one that does not fit:
//! `E1001 ... Scoped allocation with size X and limit L exceeded scoped vmem limit by E`,
//! so `L + E` is what the buffers up to that one need. Raising the limit to `L + E` (plus
//! the message's rounding) and compiling again walks through the allocations; the first
//! limit that compiles is libtpu's need, to about 100 bytes (`E` is printed to 0.1K under
//! 1M). This needs no dump flags and no successful compile. (The `--xla_mosaic_dump_to`
//! dumps show our windows but not Mosaic's internal scratch.)

use tessera_dsl::{Kernel, Target};

use crate::oracle;

/// Parses `16.38M`, `384.0K`, `140B` (XLA's 1024-based human-readable bytes).
fn bytes(s: &str) -> Option<f64> {
    let s = s.trim().trim_end_matches(['.', ',']);
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
    let scale = match unit {
        "B" => 1.0,
        "K" => 1024.0,
        "M" => 1024.0 * 1024.0,
        "G" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(num.parse::<f64>().ok()? * scale)
}

/// `(size, limit, excess)` from an E1001 message.
pub fn parse_e1001(error: &str) -> Option<(f64, f64, f64)> {
    let after = |key: &str| error.split(key).nth(1).and_then(|t| t.split_whitespace().next());
    Some((bytes(after("Scoped allocation with size ")?)?, bytes(after(" and limit ")?)?, bytes(after("exceeded scoped vmem limit by ")?)?))
}

/// One kernel to measure: its name and target.
pub struct Job {
    pub name: String,
    pub target: Target,
    pub kernel: Kernel,
}

fn with_limit(k: &Kernel, limit: usize) -> Kernel {
    let mut k = k.clone();
    k.vmem_limit_bytes = Some(limit);
    k
}

/// libtpu's scoped VMEM need of each job, in bytes: the smallest limit (to ~100 bytes)
/// under which it compiles. None where that could not be read (the kernel fails for
/// another reason, or needs more than the core has).
pub fn measure(jobs: &[Job]) -> Vec<Option<usize>> {
    // Start well below our own estimate; every failure moves the limit up to what the
    // allocations so far need.
    let mut limit: Vec<Option<usize>> = jobs.iter().map(|j| Some((tessera_dsl::verify::vmem_bytes(&j.kernel, &j.target) / 2).max(64 << 10) / 1024 * 1024)).collect();
    let mut done: Vec<Option<usize>> = vec![None; jobs.len()];
    // Whether the last failure's excess was printed coarsely (0.01M): a success after it
    // may overshoot by 10 KiB, so step back once and read the excess finely.
    let mut coarse = vec![true; jobs.len()];
    for _ in 0..24 {
        let mut modules = Vec::new();
        let mut idx = Vec::new();
        for (i, (j, l)) in jobs.iter().zip(&limit).enumerate() {
            if let (Some(l), None) = (l, done[i]) {
                if let Ok(text) = tessera_codegen::stablehlo::emit(&with_limit(&j.kernel, *l), &j.target) {
                    modules.push((j.name.clone(), j.target.name.to_string(), text));
                    idx.push(i);
                }
            }
        }
        if modules.is_empty() {
            break;
        }
        for (i, v) in idx.into_iter().zip(oracle::compile_cached(&modules)) {
            let l = limit[i].unwrap();
            if v.ok && !coarse[i] {
                done[i] = Some(l);
            } else if v.ok {
                limit[i] = Some(l.saturating_sub(24 << 10));
                coarse[i] = false;
            } else {
                // Round the excess up past the message's precision (0.1K, or 0.01M).
                limit[i] = parse_e1001(&v.error).map(|(_, _, e)| {
                    coarse[i] = e >= 1048576.0;
                    let step = if coarse[i] { 10486.0 } else { 103.0 };
                    (l + (e + step) as usize).next_multiple_of(256)
                }).filter(|&n| n <= jobs[i].target.vmem_bytes);
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_the_e1001_message() {
        let msg = "Scoped allocation with size 16.38M and limit 16.00M exceeded scoped vmem limit by 384.0K. It should";
        let (s, l, e) = super::parse_e1001(msg).unwrap();
        assert_eq!(l, 16.0 * 1048576.0);
        assert_eq!(e, 384.0 * 1024.0);
        assert!((s - 16.38 * 1048576.0).abs() < 1.0);
    }
}
