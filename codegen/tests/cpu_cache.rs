//! The CPU backends' compile cache: a kernel compiles once, the cache is bounded (LRU) and
//! reports its size; a refused kernel falls back to the interpreter with identical results.

use tessera_codegen::cpu::{self, Backend};
use tessera_dsl::interp::Array;
use tessera_dsl::{exec, BlockSpec, DType, IndexExpr, Kernel, KernelBuilder, Semantics};

/// The cache and its counters are process-wide: tests that read them take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn scale_kernel(name: &str, factor: f64) -> Kernel {
    let mut b = KernelBuilder::new(name);
    b.grid(&[(2, Semantics::Parallel)]);
    let spec = BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
    let x = b.input("x", DType::F32, &[16, 128], spec.clone());
    let o = b.output("o", DType::F32, &[16, 128], spec);
    let v = b.load(x, &[]);
    let r = b.mul(v, factor);
    b.store(o, &[], r);
    b.finish().unwrap()
}

#[test]
fn compiles_once_is_bounded_and_evicts_least_recently_used() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    cpu::set_cache_capacity(2);
    let x = Array::from_f32(&[16, 128], (0..2048).map(|i| i as f32).collect());
    let jit = Backend::Jit.executor();
    let (a, b, c) = (scale_kernel("a", 2.0), scale_kernel("b", 3.0), scale_kernel("c", 4.0));
    let s0 = cpu::cache_stats();
    for _ in 0..3 {
        let out = exec::run(jit, &a, &[&x]).unwrap();
        assert_eq!(out[0], tessera_dsl::interp::run(&a, &[&x]).unwrap()[0]);
    }
    let s1 = cpu::cache_stats();
    assert_eq!(s1.misses - s0.misses, 1, "a kernel compiles once: {s1:?}");
    assert!(s1.hits - s0.hits >= 2);
    exec::run(jit, &b, &[&x]).unwrap();
    exec::run(jit, &a, &[&x]).unwrap(); // a is now more recent than b
    exec::run(jit, &c, &[&x]).unwrap(); // evicts b
    let s2 = cpu::cache_stats();
    assert_eq!((s2.entries, s2.capacity), (2, 2), "{s2:?}");
    exec::run(jit, &a, &[&x]).unwrap();
    assert_eq!(cpu::cache_stats().misses, s2.misses, "a stayed cached");
    exec::run(jit, &b, &[&x]).unwrap();
    assert_eq!(cpu::cache_stats().misses, s2.misses + 1, "b was evicted and compiles again");
    assert!(cpu::cache_stats().compile_time > std::time::Duration::ZERO);
}

#[test]
fn a_kernel_holding_a_nan_constant_is_rebuilt_and_still_compiles_once() {
    // Masking kernels hold NaN and infinite constants; the cache matches a rebuilt kernel
    // by `==`, which must be structural (a NaN constant equals itself), or every call
    // recompiles (0.3 s per call of flash attention under LLVM before this held).
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    cpu::set_cache_capacity(8);
    let x = Array::from_f32(&[16, 128], (0..2048).map(|i| i as f32).collect());
    let jit = Backend::Jit.executor();
    let s0 = cpu::cache_stats();
    for _ in 0..3 {
        let k = scale_kernel("nan_const", f64::NAN);
        assert_eq!(k, scale_kernel("nan_const", f64::NAN));
        assert_ne!(scale_kernel("zero", 0.0), scale_kernel("zero", -0.0), "-0.0 is another constant");
        let out = exec::run(jit, &k, &[&x]).unwrap();
        assert!(out[0].to_f64_vec().iter().all(|v| v.is_nan()));
    }
    assert_eq!(cpu::cache_stats().misses - s0.misses, 1, "{:?}", cpu::cache_stats());
}

#[test]
fn backend_names_and_environment() {
    assert_eq!(Backend::parse("jit"), Some(Backend::Jit));
    assert_eq!(Backend::parse("Cranelift"), Some(Backend::Jit));
    assert_eq!(Backend::parse("interp"), Some(Backend::Interp));
    assert_eq!(Backend::parse("llvm"), Some(Backend::Llvm));
    assert_eq!(Backend::parse("gpu"), None);
    for b in Backend::ALL {
        assert_eq!(b.executor().name(), b.name());
    }
    if !Backend::Llvm.available() {
        let k = scale_kernel("no_llvm", 1.0);
        let x = Array::from_f32(&[16, 128], vec![1.0; 2048]);
        let e = exec::run(Backend::Llvm.executor(), &k, &[&x]).unwrap_err();
        assert_eq!(e.rule, "backend-unavailable");
    }
}

#[test]
fn refused_kernels_fall_back_to_the_interpreter() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // A loop step the builder would reject (hand-edited IR): the compiler refuses it and
    // the kernel runs on the interpreter, with the interpreter's error.
    let mut b = KernelBuilder::new("bad_step");
    b.grid(&[(1, Semantics::Arbitrary)]);
    let spec = BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![IndexExpr::grid(0), IndexExpr::Const(0)] };
    let o = b.output("o", DType::F32, &[8, 128], spec);
    let lo = b.i32(0);
    let hi = b.i32(4);
    let z = b.zeros(&[8, 128], DType::F32);
    let r = b.for_range(lo, hi, 1, &[z], |b, _, c| vec![b.add(c[0], 1.0)]);
    b.store(o, &[], r[0]);
    let mut k = b.finish().unwrap();
    for d in &mut k.insts {
        if let tessera_dsl::Inst::For { step, .. } = &mut d.inst {
            *step = -1;
        }
    }
    let before = cpu::cache_stats().fallbacks;
    let want = tessera_dsl::interp::run(&k, &[]).unwrap_err();
    let got = exec::run(Backend::Jit.executor(), &k, &[]).unwrap_err();
    assert_eq!(got.to_string(), want.to_string());
    assert!(cpu::fallback_reason(Backend::Jit, &k).is_some());
    assert!(cpu::cache_stats().fallbacks > before);
}
