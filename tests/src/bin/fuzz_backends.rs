//! Long fuzz runs of the compiled CPU backends against the interpreter:
//!
//! `cargo run --release -p tessera-tests --bin fuzz_backends -- [--count N] [--start S]
//!  [--backend jit|llvm] [--mode exact|fast|both] [--threads T]`
//!
//! Each case is a random kernel (`tessera_tests::conformance::random_case`) checked bit for
//! bit in exact mode and within the fast-mode tolerance; a panic anywhere counts as a
//! failure. Prints the count, the time and the first failures; exits non-zero on any.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use tessera_codegen::cpu::{Backend, Compiled};
use tessera_tests::conformance::{check_case, random_case, GenOptions, Tolerance};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let count: u64 = arg("--count").and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let start: u64 = arg("--start").and_then(|s| s.parse().ok()).unwrap_or(1 << 32);
    let backend = arg("--backend").and_then(|s| Backend::parse(&s)).unwrap_or(Backend::Jit);
    let mode = arg("--mode").unwrap_or_else(|| "both".into());
    let threads: usize = arg("--threads").and_then(|s| s.parse().ok()).unwrap_or(2);
    if !backend.available() {
        eprintln!("backend {backend} is not in this build");
        std::process::exit(2);
    }
    // Kernels are small: keep their grids on one thread each and run cases in parallel.
    let exact = Compiled { backend, exact: true, threads: Some(1) };
    let fast = Compiled { backend, exact: false, threads: Some(1) };
    let modes: Vec<(bool, &str)> = match mode.as_str() {
        "exact" => vec![(true, "exact")],
        "fast" => vec![(false, "fast")],
        _ => vec![(true, "exact"), (false, "fast")],
    };
    tessera_codegen::cpu::set_cache_capacity(64);
    let t0 = Instant::now();
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    std::panic::set_hook(Box::new(|_| {}));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let seed = start.wrapping_add(i);
                for &(is_exact, name) in &modes {
                    let r = std::panic::catch_unwind(|| {
                        let case = random_case(seed, GenOptions { smooth: !is_exact });
                        let (e, tol) = if is_exact { (&exact, Tolerance::Exact) } else { (&fast, Tolerance::Abs(1.0 / 64.0)) };
                        check_case(e, &case, tol)
                    });
                    let msg = match r {
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => Some(e),
                        Err(p) => Some(format!("panic: {}", p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default())),
                    };
                    if let Some(m) = msg {
                        let mut f = failures.lock().unwrap();
                        if f.len() < 5 {
                            eprintln!("FAIL seed {seed:#x} ({name}): {}", m.lines().next().unwrap_or(""));
                        }
                        f.push(format!("seed {seed:#x} ({name}): {m}"));
                    }
                }
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                if d.is_multiple_of(100_000) {
                    eprintln!("{d} programs, {:.0} s", t0.elapsed().as_secs_f64());
                }
            });
        }
    });
    let f = failures.into_inner().unwrap();
    let programs = count * modes.len() as u64;
    println!("fuzz_backends: backend {backend}, mode {mode}, {count} seeds from {start:#x}, {programs} programs, {:.1} s, {} failures", t0.elapsed().as_secs_f64(), f.len());
    if let Some(first) = f.first() {
        println!("first failure: {first}");
        std::process::exit(1);
    }
}
