//! Flash attention (forward and backward) against PyTorch's
//! `scaled_dot_product_attention` and autograd, where they apply: causal or not, GQA,
//! sequence lengths that are not block multiples. Enabled by `TESSERA_TORCH=1` (set by
//! `scripts/test.sh`, whose venv has torch); torch runs in a child process on the same
//! inputs, in float64.

use std::path::{Path, PathBuf};
use std::process::Command;

use rand::{rngs::StdRng, SeedableRng};
use tessera_dsl::Interpreter;
use tessera_dsl::interp::Array;
use tessera_dsl::{DType, Target};
use tessera_kernels::attention::{flash_attention, flash_attention_bwd, AttentionParams};
use tessera_kernels::harness::uniform;

struct Case {
    name: &'static str,
    b: usize,
    h: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    d: usize,
    causal: bool,
    dtype: DType,
}

fn random(shape: &[usize], dtype: DType, rng: &mut StdRng) -> Array {
    Array::from_f32_in(dtype, shape, uniform(shape.iter().product(), 1.0, rng))
}

fn write(dir: &Path, file: String, a: &Array) {
    let bytes: Vec<u8> = a.to_f32_vec().iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join(file), bytes).unwrap();
}

#[test]
fn flash_attention_matches_torch_sdpa() {
    if std::env::var("TESSERA_TORCH").as_deref() != Ok("1") {
        eprintln!("skipped: set TESSERA_TORCH=1 (scripts/test.sh does) to compare with torch SDPA");
        return;
    }
    let cases = [
        Case { name: "mha_causal_f32", b: 1, h: 2, hkv: 2, sq: 256, skv: 256, d: 128, causal: true, dtype: DType::F32 },
        Case { name: "gqa4_noncausal_f32", b: 2, h: 8, hkv: 2, sq: 200, skv: 200, d: 64, causal: false, dtype: DType::F32 },
        Case { name: "gqa8_causal_ragged_f32", b: 1, h: 8, hkv: 1, sq: 300, skv: 300, d: 128, causal: true, dtype: DType::F32 },
        Case { name: "cross_len_noncausal_f32", b: 1, h: 4, hkv: 4, sq: 128, skv: 384, d: 128, causal: false, dtype: DType::F32 },
        Case { name: "gqa4_causal_bf16", b: 1, h: 4, hkv: 1, sq: 256, skv: 256, d: 128, causal: true, dtype: DType::BF16 },
    ];
    let dir = std::env::temp_dir().join(format!("tessera-sdpa-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut manifest = Vec::new();
    let mut rng = StdRng::seed_from_u64(7);
    for c in &cases {
        let q = random(&[c.b, c.h, c.sq, c.d], c.dtype, &mut rng);
        let k = random(&[c.b, c.hkv, c.skv, c.d], c.dtype, &mut rng);
        let v = random(&[c.b, c.hkv, c.skv, c.d], c.dtype, &mut rng);
        let dout = random(&[c.b, c.h, c.sq, c.d], c.dtype, &mut rng);
        let params = AttentionParams::new(c.d, c.causal);
        let (o, lse) = flash_attention(&Interpreter, &q, &k, &v, None, &params, &Target::V6E).unwrap();
        let (dq, dk, dv) = flash_attention_bwd(&Interpreter, &q, &k, &v, &o, &lse, &dout, None, &params, &Target::V6E).unwrap();
        for (what, a) in [("q", &q), ("k", &k), ("v", &v), ("dout", &dout), ("o", &o), ("dq", &dq), ("dk", &dk), ("dv", &dv)] {
            write(&dir, format!("{}.{what}", c.name), a);
        }
        let tolerance = if c.dtype == DType::BF16 { 3e-2 } else { 1e-5 };
        manifest.push(serde_json::json!({"name": c.name, "q_shape": [c.b, c.h, c.sq, c.d], "kv": [c.hkv, c.skv], "causal": c.causal, "sm_scale": params.sm_scale, "tolerance": tolerance}));
    }
    std::fs::write(dir.join("manifest.json"), serde_json::json!({ "cases": manifest }).to_string()).unwrap();
    let root: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = std::env::var_os("TESSERA_PYTHON").map(PathBuf::from).unwrap_or_else(|| root.join(".venv/bin/python"));
    let out = Command::new(python).arg(root.join("tests/python/sdpa_check.py")).arg(&dir).output().expect("run sdpa_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "torch SDPA disagrees (or failed):\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().filter(|l| l.starts_with('{')).count(), cases.len());
}
