//! The collectives of `kernels/src/collective.rs` (written with `#[tpu_kernel]`: ring
//! all-gather, ring reduce-scatter, all-gather matmul):
//!
//! - on the interpreter, every device of a 2-, 4- and 8-device ring simulated, against an
//!   independent reference computed here (the shards concatenated, the chunks summed);
//! - their broken variants (a missing wait, a wrong peer, a reused buffer), each caught
//!   with a named error that says which device and grid step;
//! - their Mosaic in the form Pallas writes for its ring (the reference lowered by JAX
//!   0.10.2 in `tests/fixtures/collective/`), and the multi-device StableHLO module;
//! - with `TESSERA_TPU_ORACLE=1`: libtpu compiles both for 4 chips of v5e 2x2, v6e 2x2 and
//!   tpu7x 2x2x1.

use tessera_codegen::lower;
use tessera_dsl::interp::{self, Array};
use tessera_dsl::{verify::verify, DType, Kernel, KernelError, Target};
use tessera_kernels::collective::{ring_all_gather, ring_reduce_scatter, Broken};
use tessera_tests::oracle;

const M: usize = 8;
const K: usize = 128;

/// Small integers, distinct per device and element: every sum of a few of them is exact in
/// f32 and in bf16, so the references compare exactly.
fn values(device: usize, len: usize) -> Vec<f32> {
    (0..len).map(|e| ((device * 7 + e * 13) % 17) as f32 - 8.0).collect()
}

fn run(k: &Kernel, per_device: &[Array]) -> Result<Vec<Array>, KernelError> {
    let args: Vec<Vec<&Array>> = per_device.iter().map(|a| vec![a]).collect();
    Ok(interp::run_devices(k, &args)?.into_iter().map(|mut o| o.remove(0)).collect())
}

fn gather(n: usize, dtype: DType, broken: Broken) -> Result<Vec<Array>, KernelError> {
    let k = ring_all_gather(n, M, K, dtype, broken)?;
    let shards: Vec<Array> = (0..n).map(|d| Array::from_f32_in(dtype, &[M, K], values(d, M * K))).collect();
    run(&k, &shards)
}

fn reduce_scatter(n: usize, dtype: DType, broken: Broken) -> Result<Vec<Array>, KernelError> {
    let k = ring_reduce_scatter(n, M, K, dtype, broken)?;
    let xs: Vec<Array> = (0..n).map(|d| Array::from_f32_in(dtype, &[n, M, K], values(d, n * M * K))).collect();
    run(&k, &xs)
}

#[test]
fn ring_all_gather_on_2_4_8_devices_is_the_concatenation() {
    for dtype in [DType::F32, DType::BF16] {
        for n in [2, 4, 8] {
            let outs = gather(n, dtype, Broken::No).unwrap_or_else(|e| panic!("{n} devices, {dtype}: {e}"));
            let want: Vec<f32> = (0..n).flat_map(|d| values(d, M * K)).collect();
            for (d, o) in outs.iter().enumerate() {
                assert_eq!(o.shape, [n, M, K]);
                assert_eq!(o.to_f32_vec(), want, "{n} devices, {dtype}: device {d}");
            }
        }
    }
}

#[test]
fn ring_reduce_scatter_on_2_4_8_devices_is_the_sum_of_each_chunk() {
    for dtype in [DType::F32, DType::BF16] {
        for n in [2, 4, 8] {
            let outs = reduce_scatter(n, dtype, Broken::No).unwrap_or_else(|e| panic!("{n} devices, {dtype}: {e}"));
            let inputs: Vec<Vec<f32>> = (0..n).map(|d| values(d, n * M * K)).collect();
            for (me, o) in outs.iter().enumerate() {
                // Device `me` gets chunk `me` summed over the devices, in f64 here.
                let want: Vec<f32> = (0..M * K).map(|e| inputs.iter().map(|x| x[me * M * K + e] as f64).sum::<f64>() as f32).collect();
                assert_eq!(o.shape, [M, K]);
                assert_eq!(o.to_f32_vec(), want, "{n} devices, {dtype}: device {me}");
            }
        }
    }
}

fn expect(r: Result<Vec<Array>, KernelError>, rules: &[&str], what: &str) -> KernelError {
    let e = r.expect_err(what);
    assert!(rules.contains(&e.rule), "{what}: expected {rules:?}, got {e}");
    assert!(e.kernel.starts_with("ring_"), "{e}");
    assert!(e.to_string().contains("device"), "{what}: the error names the device: {e}");
    e
}

#[test]
fn a_missing_wait_is_caught() {
    for n in [2, 4, 8] {
        // The all-gather forwards a slot that has not arrived.
        // With two devices nothing is forwarded: the copy is simply never waited for.
        let want = if n == 2 { "dma-unwaited" } else { "remote-buffer-race" };
        let e = expect(gather(n, DType::F32, Broken::MissingWait), &[want], "all-gather without wait_recv");
        assert!(e.message.contains("grid step [0]"), "{e}");
        // The reduce-scatter adds a partial that has not arrived.
        expect(reduce_scatter(n, DType::F32, Broken::MissingWait), &["remote-buffer-race"], "reduce-scatter without wait_recv");
    }
}

#[test]
fn a_wrong_peer_is_caught() {
    for n in [2, 4, 8] {
        let e = expect(gather(n, DType::F32, Broken::WrongPeer), &["device-id-range"], "all-gather with me + 1 unwrapped");
        assert!(e.subject.starts_with(&format!("device {}:", n - 1)) && e.message.contains(&format!("names device {n}")), "{e}");
        expect(reduce_scatter(n, DType::BF16, Broken::WrongPeer), &["device-id-range"], "reduce-scatter with me + 1 unwrapped");
    }
}

#[test]
fn a_reused_buffer_is_caught() {
    // One receive slot without the hand-back: a fast left neighbour's next partial lands
    // in the slot before it is read. (Two devices take one step: nothing is reused.)
    for n in [4, 8] {
        let e = expect(reduce_scatter(n, DType::F32, Broken::ReusedBuffer), &["remote-buffer-race"], "reduce-scatter with one receive slot");
        assert!(e.message.contains("`recv_buf`"), "{e}");
        // The all-gather matmul without the hand-back of its two shard slots.
        let k = tessera_kernels::collective::all_gather_matmul(n, M, K, K, DType::F32, Broken::ReusedBuffer).unwrap();
        let w = Array::from_f32(&[K, K], values(99, K * K));
        let xs: Vec<Array> = (0..n).map(|d| Array::from_f32(&[M, K], values(d, M * K))).collect();
        let e = interp::run_devices(&k, &xs.iter().map(|x| vec![x, &w]).collect::<Vec<_>>()).expect_err("all-gather matmul without hand-back");
        assert_eq!(e.rule, "remote-buffer-race", "{e}");
        assert!(e.message.contains("`buf`"), "{e}");
    }
}

#[test]
fn the_collectives_verify_for_every_generation() {
    for t in [Target::V5E, Target::V6E, Target::TPU7X, Target::V5P] {
        for dtype in [DType::F32, DType::BF16] {
            verify(&ring_all_gather(4, M, K, dtype, Broken::No).unwrap(), &t).unwrap_or_else(|e| panic!("{t}: {e}"));
            verify(&ring_reduce_scatter(4, M, K, dtype, Broken::No).unwrap(), &t).unwrap_or_else(|e| panic!("{t}: {e}"));
        }
    }
}

/// The operation names with their operand segments, as they appear in a stable Mosaic text.
fn op_forms(mosaic: &str, op: &str) -> Vec<String> {
    mosaic
        .lines()
        .filter(|l| l.contains(&format!("\"stable_mosaic.{op}\"")))
        .map(|l| {
            let segs = l.find("operandSegmentSizes").map(|i| l[i..].split('>').next().unwrap_or("").to_string()).unwrap_or_default();
            format!("{op} {segs}")
        })
        .collect()
}

#[test]
fn the_mosaic_has_the_form_pallas_writes_for_its_ring() {
    let reference = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/collective/ring_mesh.serialized.mlir")).unwrap();
    let lowered = lower(&ring_all_gather(4, M, K, DType::F32, Broken::No).unwrap(), &Target::V5E).unwrap();
    assert!(reference.contains("stable_mosaic.version = 11") && lowered.mosaic.contains("stable_mosaic.version = 11"));
    // The same spellings, operand segments included, for every communication op.
    for op in ["tpu.device_id", "tpu.sem_barrier", "tpu.sem_signal", "tpu.sem_wait", "tpu.enqueue_dma", "tpu.wait_dma2"] {
        let mut ours = op_forms(&lowered.mosaic, op);
        let mut theirs = op_forms(&reference, op);
        assert!(!ours.is_empty(), "{op} missing from our Mosaic");
        ours.sort();
        ours.dedup();
        theirs.sort();
        theirs.dedup();
        // The reference has no local copy; ours starts with one (x -> out[me]).
        ours.retain(|f| !f.ends_with("1, 0, 1, 1, 0, 0"));
        ours.retain(|f| !(op == "tpu.wait_dma2" && f.ends_with("1, 1, 1, 0, 0")));
        assert_eq!(ours, theirs, "{op}");
    }
    // The semaphore types and the backend_config facts.
    assert!(lowered.mosaic.contains("memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>"));
    let rs = lower(&ring_reduce_scatter(4, M, K, DType::BF16, Broken::No).unwrap(), &Target::V6E).unwrap();
    assert!(rs.mosaic.contains("memref<1x!tpu.semaphore, #tpu.memory_space<semaphore_mem>>"), "regular semaphores");
    for s in [&lowered.stablehlo, &rs.stablehlo] {
        assert!(s.contains("\\22has_communication\\22: true, \\22collective_id\\22: 0"), "{s}");
        assert!(s.contains("mhlo.num_partitions = 4 : i32") && s.contains("sdy.mesh @mesh = <[\"x\"=4]>") && s.contains("manual_axes={\"x\"}"), "{s}");
    }
    // The cost estimate counts what each device sends: n - 1 slots of [M, K] f32.
    assert_eq!(lowered.cost.remote_bytes_transferred, 3 * (M * K * 4) as u64);
    assert!(lowered.stablehlo.contains(&format!("\\22remote_bytes_transferred\\22: {}", 3 * M * K * 4)), "{}", lowered.stablehlo);
    // A kernel that talks to no peer says nothing of communication.
    let plain = lower(&tessera_kernels::matmul::matmul(&tessera_dsl::Type::vector(DType::F32, &[128, 128]), &tessera_dsl::Type::vector(DType::F32, &[128, 128]), &Target::V5E).unwrap(), &Target::V5E).unwrap();
    assert!(!plain.stablehlo.contains("has_communication") && !plain.stablehlo.contains("num_partitions"));
}

#[test]
fn libtpu_compiles_the_collectives_on_multi_chip_topologies() {
    if !oracle::enabled() {
        eprintln!("skipped: set TESSERA_TPU_ORACLE=1 (and the venv) for the libtpu tier");
        return;
    }
    let mut jobs = Vec::new();
    for (target, t) in [("v5e", Target::V5E), ("v6e", Target::V6E), ("tpu7x", Target::TPU7X)] {
        for dtype in [DType::F32, DType::BF16] {
            for (name, k) in [("ring_all_gather", ring_all_gather(4, M, K, dtype, Broken::No).unwrap()), ("ring_reduce_scatter", ring_reduce_scatter(4, M, K, dtype, Broken::No).unwrap())] {
                let l = lower(&k, &t).unwrap_or_else(|e| panic!("{name} on {target}: {e}"));
                jobs.push((format!("{name}/{dtype}/4-chips"), target.to_string(), l.stablehlo));
            }
        }
    }
    oracle::assert_all_accepted(&jobs);
}



/// The IR, Mosaic and StableHLO of both collectives, as reviewed snapshots.
#[test]
fn snapshots_of_the_collectives() {
    let kernels = [("ring_all_gather_f32_4", ring_all_gather(4, M, K, DType::F32, Broken::No).unwrap()), ("ring_reduce_scatter_bf16_4", ring_reduce_scatter(4, M, K, DType::BF16, Broken::No).unwrap())];
    for (name, k) in kernels {
        let lowered = lower(&k, &Target::V5E).unwrap();
        insta::assert_snapshot!(format!("{name}_ir"), k.to_string());
        insta::assert_snapshot!(format!("{name}_mosaic"), lowered.mosaic);
        assert_eq!(tessera_codegen::stablehlo::decode_body(&lowered.stablehlo).as_deref(), Some(lowered.mosaic.as_str()));
        insta::assert_snapshot!(format!("{name}_stablehlo"), tessera_codegen::stablehlo::redact_body(&lowered.stablehlo).unwrap());
    }
}

/// A one-device "ring" needs no peer: every CPU backend runs it (the compiled ones hand
/// communication to the interpreter) and returns the shard.
#[test]
fn a_one_device_mesh_runs_on_every_cpu_backend() {
    let k = ring_all_gather(1, M, K, DType::F32, Broken::No).unwrap();
    let x = Array::from_f32(&[M, K], values(0, M * K));
    for b in [tessera_codegen::cpu::Backend::Interp, tessera_codegen::cpu::Backend::Jit] {
        let out = tessera_dsl::exec::run(b.executor(), &k, &[&x]).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        assert_eq!(out[0].to_f32_vec(), values(0, M * K), "{b:?}");
    }
}

#[test]
fn all_gather_matmul_on_2_4_8_devices_is_the_gathered_product() {
    let (kd, n) = (128, 128);
    for dtype in [DType::F32, DType::BF16] {
        for nd in [1, 2, 4, 8] {
            let k = tessera_kernels::collective::all_gather_matmul(nd, M, kd, n, dtype, Broken::No).unwrap();
            let xs: Vec<Vec<f32>> = (0..nd).map(|d| values(d, M * kd)).collect();
            let wv: Vec<f32> = values(99, kd * n).iter().map(|v| v / 4.0).collect();
            let w = Array::from_f32_in(dtype, &[kd, n], wv.clone());
            let xa: Vec<Array> = xs.iter().map(|x| Array::from_f32_in(dtype, &[M, kd], x.clone())).collect();
            let args: Vec<Vec<&Array>> = xa.iter().map(|x| vec![x, &w]).collect();
            let outs = interp::run_devices(&k, &args).unwrap_or_else(|e| panic!("{nd} devices, {dtype}: {e}"));
            // Reference: every shard times w, in f64 (the inputs are exact in bf16).
            let want: Vec<f64> = xs.iter().flat_map(|x| (0..M).flat_map(|r| (0..n).map(|c| (0..kd).map(|j| x[r * kd + j] as f64 * wv[j * n + c] as f64).sum::<f64>()).collect::<Vec<_>>())).collect();
            for (d, o) in outs.iter().enumerate() {
                assert_eq!(o[0].shape, [nd, M, n]);
                for (g, w) in o[0].to_f64_vec().iter().zip(&want) {
                    let tol = if dtype == DType::BF16 { w.abs() / 128.0 + 1e-6 } else { 1e-3 };
                    assert!((g - w).abs() <= tol, "{nd} devices, {dtype}, device {d}: {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn all_gather_matmul_starts_the_next_copy_before_the_current_dot() {
    let k = tessera_kernels::collective::all_gather_matmul(4, M, 128, 128, DType::BF16, Broken::No).unwrap();
    for (target, t) in [("v5e", Target::V5E), ("v6e", Target::V6E), ("tpu7x", Target::TPU7X)] {
        let l = lower(&k, &t).unwrap_or_else(|e| panic!("{target}: {e}"));
        // In the ring loop's body: the remote copy is enqueued, then the matmul, then the waits.
        let body = &l.mosaic[l.mosaic.find("stable_mosaic.scf.for").expect("a ring loop")..];
        let (start, dot, wait) = (body.find("tpu.enqueue_dma").unwrap(), body.find("tpu.matmul").unwrap(), body.find("tpu.wait_dma2").unwrap());
        assert!(start < dot && dot < wait, "{target}: copy at {start}, dot at {dot}, wait at {wait}");
        // The estimate counts the copy under `if more` as taken on all 4 steps (an `if`
        // costs its costlier branch): an upper bound of the 3 a device sends.
        assert!(l.cost.remote_bytes_transferred == 4 * (M * 128 * 2) as u64 && l.cost.flops >= 4 * 2 * (M * 128 * 128) as u64, "{target}: {:?}", l.cost);
    }
    if oracle::enabled() {
        let jobs: Vec<(String, String, String)> = [("v5e", Target::V5E), ("v6e", Target::V6E), ("tpu7x", Target::TPU7X)]
            .into_iter()
            .flat_map(|(name, t)| [DType::F32, DType::BF16].map(|dt| (format!("all_gather_matmul/{dt}/4-chips"), name.to_string(), lower(&tessera_kernels::collective::all_gather_matmul(4, M, 128, 128, dt, Broken::No).unwrap(), &t).unwrap().stablehlo)))
            .collect();
        oracle::assert_all_accepted(&jobs);
    }
}

/// The all-gather matmul's step time per generation, from the spec sheets: each step copies
/// one shard over one ICI link while the MXU multiplies the one it holds. At a shard of
/// 1024 x 8192 and `w` of 8192 x 8192 (bf16), v5e is compute-bound and the faster chips
/// wait for the link. The printed table is the README's.
#[test]
fn all_gather_matmul_step_time_per_generation() {
    let (nd, m, k, n) = (4, 1024, 8192, 8192);
    let kernel = tessera_kernels::collective::all_gather_matmul(nd, m, k, n, DType::BF16, Broken::No).unwrap();
    let cost = tessera_codegen::estimate(&kernel);
    // Per step: one [m, k] shard sent (the estimate counts the copy on every step), one dot.
    let (bytes, flops) = (cost.remote_bytes_transferred / nd as u64, 2 * (m * k * n) as u64);
    assert_eq!(bytes, (m * k * 2) as u64);
    assert!(cost.flops / nd as u64 >= flops);
    eprintln!("| target | ICI link GB/s (one way) | copy us | dot us | step us | bound |");
    let mut bounds = Vec::new();
    for t in [Target::V5E, Target::V6E, Target::TPU7X] {
        let s = tessera_codegen::ring_step(bytes, flops, &t);
        eprintln!("| {} | {:.0} | {:.0} | {:.0} | {:.0} | {} |", t.name, t.ici_link_gbps(), s.copy_us, s.compute_us, s.step_us, s.bound);
        assert_eq!(s.step_us, s.copy_us.max(s.compute_us));
        bounds.push(s.bound);
    }
    assert_eq!(bounds, ["compute", "ici", "ici"]);
}

/// Per sender `d` and receiver `p`: how many rows `d` sends `p` (a fixed pseudo-random
/// matrix, zeros included), and the four metadata arrays of each device.
fn ragged_plan(nd: usize, seed: usize) -> (Vec<Vec<usize>>, Vec<[Vec<i32>; 4]>) {
    let sizes: Vec<Vec<usize>> = (0..nd).map(|d| (0..nd).map(|p| (d * 5 + p * 3 + seed) % 4).collect()).collect();
    let meta = (0..nd)
        .map(|d| {
            let input_offsets = (0..nd).map(|p| sizes[d][..p].iter().sum::<usize>() as i32).collect();
            let send = (0..nd).map(|p| sizes[d][p] as i32).collect();
            // Receiver `p` stacks what it gets by sender: `d`'s rows follow those of `0..d`.
            let output_offsets = (0..nd).map(|p| (0..d).map(|s| sizes[s][p]).sum::<usize>() as i32).collect();
            let recv = (0..nd).map(|p| sizes[p][d] as i32).collect();
            [input_offsets, send, output_offsets, recv]
        })
        .collect();
    (sizes, meta)
}

#[test]
fn ragged_all_to_all_on_2_4_8_devices_delivers_every_row() {
    let h = 128;
    for nd in [2, 4, 8] {
        for seed in 0..3 {
            let (sizes, meta) = ragged_plan(nd, seed);
            let t = 4 * nd;
            let k = tessera_kernels::collective::ragged_all_to_all(nd, t, t, h, DType::F32).unwrap();
            verify(&k, &Target::V5E).unwrap();
            let xs: Vec<Vec<f32>> = (0..nd).map(|d| values(d, t * h)).collect();
            let arrays: Vec<Vec<Array>> = (0..nd)
                .map(|d| {
                    let mut a: Vec<Array> = meta[d].iter().map(|m| Array::from_i32(&[nd], m.clone())).collect();
                    a.push(Array::from_f32(&[t, h], xs[d].clone()));
                    a
                })
                .collect();
            let args: Vec<Vec<&Array>> = arrays.iter().map(|a| a.iter().collect()).collect();
            let outs = interp::run_devices(&k, &args).unwrap_or_else(|e| panic!("{nd} devices, seed {seed}: {e}"));
            for (p, o) in outs.iter().enumerate() {
                // Reference: sender by sender, the rows each sent to `p`, stacked.
                let mut want = Vec::new();
                for d in 0..nd {
                    let from = sizes[d][..p].iter().sum::<usize>();
                    want.extend_from_slice(&xs[d][from * h..(from + sizes[d][p]) * h]);
                }
                let got = o[0].to_f32_vec();
                assert_eq!(&got[..want.len()], &want[..], "{nd} devices, seed {seed}: device {p}");
                assert!(got[want.len()..].iter().all(|v| v.is_nan()), "rows nobody sent stay poison");
            }
        }
    }
}

#[test]
fn ragged_all_to_all_with_overlapping_offsets_is_a_race() {
    let (nd, h) = (4, 128);
    let (_, mut meta) = ragged_plan(nd, 1);
    // Device 1 sends its rows to where device 0's rows go, on every receiver.
    meta[1][2] = meta[0][2].clone();
    let t = 4 * nd;
    let k = tessera_kernels::collective::ragged_all_to_all(nd, t, t, h, DType::F32).unwrap();
    let arrays: Vec<Vec<Array>> = (0..nd)
        .map(|d| {
            let mut a: Vec<Array> = meta[d].iter().map(|m| Array::from_i32(&[nd], m.clone())).collect();
            a.push(Array::from_f32(&[t, h], values(d, t * h)));
            a
        })
        .collect();
    let args: Vec<Vec<&Array>> = arrays.iter().map(|a| a.iter().collect()).collect();
    let e = interp::run_devices(&k, &args).expect_err("overlapping output offsets");
    assert_eq!(e.rule, "remote-buffer-race", "{e}");
    assert!(e.subject.starts_with("device 1:") && e.message.contains("copies into `out` of device") && e.message.contains("a copy from device 0"), "{e}");
}

#[test]
fn ragged_all_to_all_compiles_on_multi_chip_topologies() {
    let k = tessera_kernels::collective::ragged_all_to_all(4, 64, 64, 128, DType::F32).unwrap();
    // Packed rows cannot move one at a time: the verifier says so before libtpu does.
    let bf16 = tessera_kernels::collective::ragged_all_to_all(4, 64, 64, 128, DType::BF16).unwrap();
    assert_eq!(verify(&bf16, &Target::V5E).unwrap_err().rule, "dma-slice-size");
    let jobs: Vec<(String, String, String)> = [("v5e", Target::V5E), ("v6e", Target::V6E), ("tpu7x", Target::TPU7X)]
        .into_iter()
        .map(|(name, t)| ("ragged_all_to_all/f32/4-chips".to_string(), name.to_string(), lower(&k, &t).unwrap_or_else(|e| panic!("{name}: {e}")).stablehlo))
        .collect();
    if oracle::enabled() {
        oracle::assert_all_accepted(&jobs);
    }
}
