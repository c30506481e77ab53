//! Remote copies between devices, built with `KernelBuilder`: the verifier's static rules,
//! the printed IR, and the interpreter running every device of the mesh (a ring all-gather
//! against a plain concatenation, and broken rings caught with a named error).

use tessera_dsl::interp::{self, Array};
use tessera_dsl::verify::verify;
use tessera_dsl::*;

const ROWS: usize = 8;
const D: usize = 128;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Ring {
    Correct,
    /// Forwards each slot without waiting for it to arrive (no wait_recv).
    NoRecvWait,
    /// The right neighbour is `me + 1` without the modulo: the last device names one past the mesh.
    PeerOutsideMesh,
    /// Sends to `min(me + 1, n - 1)`: the last device sends to itself, device 0 gets nothing.
    WrongPeer,
    /// No barrier handshake before the ring (the peer may not be in the kernel yet; not
    /// an error here, but the signals below must still balance).
    NoBarrier,
    /// Receives every step into one scratch buffer and forwards from it, with no
    /// handshake: the left neighbour's next copy lands before the buffer is consumed.
    ReusedBuffer,
    /// Signals the barrier of both neighbours but waits for only one signal.
    UnbalancedBarrier,
}

/// `out[j] = x of device j` on every device: the local shard is copied to `out[me]`, then
/// each device forwards slot `me - i` to its right neighbour for `i in 0..n-1`.
fn all_gather(n: usize, dtype: DType, v: Ring) -> Kernel {
    let mut b = KernelBuilder::new("ring_all_gather");
    b.mesh(&[("x", n)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", dtype, &[ROWS, D], MemorySpace::Any);
    let out = b.unblocked(RefKind::Output, "out", dtype, &[n, ROWS, D], MemorySpace::Any);
    let buf = b.scratch("buf", dtype, &[ROWS, D], MemorySpace::Vmem);
    let send = b.semaphores("send", 1);
    let recv = b.semaphores("recv", 1);
    let local = b.semaphores("local", 1);
    let me = b.axis_index("x");
    let next = b.add(me, 1);
    let right = match v {
        Ring::PeerOutsideMesh => next,
        Ring::WrongPeer => b.min(next, (n - 1) as i64),
        _ => b.binary(BinaryOp::Rem, next, n as i64),
    };
    let prev = b.add(me, (n - 1) as i64);
    let left = b.binary(BinaryOp::Rem, prev, n as i64);
    b.dma_start(x, &[], out, &[ds(me, 1)], local, 0);
    b.dma_wait(x, &[], out, &[ds(me, 1)], local, 0);
    if v != Ring::NoBarrier {
        b.semaphore_signal(Sem::Barrier, 1, Some(Arg::Val(left)));
        b.semaphore_signal(Sem::Barrier, 1, Some(Arg::Val(right)));
        b.semaphore_wait(Sem::Barrier, if v == Ring::UnbalancedBarrier { 1 } else { 2 });
    }
    b.for_range(0, (n - 1) as i64, 1, &[], |b, i, _| {
        let back = b.sub(me, i);
        let back = b.add(back, n as i64);
        let slot = b.binary(BinaryOp::Rem, back, n as i64);
        if v == Ring::ReusedBuffer {
            // Step 0 sends our own shard; later steps forward what arrived in `buf`.
            let first = b.cmp(CmpOp::Eq, i, 0);
            b.if_else(
                first,
                |b| {
                    let c = RemoteCopy { src: out, src_index: &[ds(slot, 1)], dst: buf, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: Arg::Val(right) };
                    b.remote_copy_start(&c);
                    b.remote_copy_wait_send(&c);
                    vec![]
                },
                |b| {
                    let c = RemoteCopy { src: buf, src_index: &[], dst: buf, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: Arg::Val(right) };
                    b.remote_copy_start(&c);
                    b.remote_copy_wait_send(&c);
                    vec![]
                },
            );
            let c = RemoteCopy { src: buf, src_index: &[], dst: buf, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: Arg::Val(right) };
            b.remote_copy_wait_recv(&c);
            // The slot that arrived: the left neighbour's `slot`.
            let from = b.add(slot, (n - 1) as i64);
            let from = b.binary(BinaryOp::Rem, from, n as i64);
            b.dma_start(buf, &[], out, &[ds(from, 1)], local, 0);
            b.dma_wait(buf, &[], out, &[ds(from, 1)], local, 0);
            return vec![];
        }
        let c = RemoteCopy { src: out, src_index: &[ds(slot, 1)], dst: out, dst_index: &[ds(slot, 1)], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: Arg::Val(right) };
        b.remote_copy_start(&c);
        b.remote_copy_wait_send(&c);
        if v != Ring::NoRecvWait {
            b.remote_copy_wait_recv(&c);
        }
        vec![]
    });
    b.finish().unwrap()
}

/// Device `j`'s shard: distinct values per device and element (exact in bf16).
fn shard(dtype: DType, j: usize) -> Array {
    let v: Vec<f32> = (0..ROWS * D).map(|e| (j * 1000 + e % 251) as f32).collect();
    Array::from_f32_in(dtype, &[ROWS, D], v)
}

fn run_ring(n: usize, dtype: DType, v: Ring) -> Result<Vec<Vec<Array>>> {
    let k = all_gather(n, dtype, v);
    let shards: Vec<Array> = (0..n).map(|j| shard(dtype, j)).collect();
    let args: Vec<Vec<&Array>> = shards.iter().map(|s| vec![s]).collect();
    interp::run_devices(&k, &args)
}

#[test]
fn ring_all_gather_concatenates_every_shard_on_every_device() {
    for dtype in [DType::F32, DType::BF16] {
        for n in [2, 4, 8] {
            let outs = run_ring(n, dtype, Ring::Correct).unwrap_or_else(|e| panic!("{n} devices {dtype}: {e}"));
            // The reference: the shards concatenated, computed here from the inputs.
            let want: Vec<f32> = (0..n).flat_map(|j| shard(dtype, j).to_f32_vec()).collect();
            for (dev, o) in outs.iter().enumerate() {
                assert_eq!(o[0].shape, vec![n, ROWS, D]);
                assert_eq!(o[0].to_f32_vec(), want, "{n} devices {dtype}: device {dev}");
            }
        }
    }
}

#[test]
fn a_forward_before_its_wait_is_a_race() {
    let e = run_ring(4, DType::F32, Ring::NoRecvWait).unwrap_err();
    assert_eq!(e.rule, "remote-buffer-race", "{e}");
    assert!(e.subject.starts_with("device ") && e.message.contains("before waiting for it") && e.message.contains("grid step [0]"), "{e}");
}

#[test]
fn a_peer_outside_the_mesh_is_named() {
    let e = run_ring(4, DType::F32, Ring::PeerOutsideMesh).unwrap_err();
    assert_eq!(e.rule, "device-id-range", "{e}");
    assert!(e.subject.starts_with("device 3:") && e.message.contains("names device 4, outside the mesh of 4"), "{e}");
}

#[test]
fn a_wrong_peer_leaves_a_wait_that_nothing_satisfies() {
    let e = run_ring(4, DType::F32, Ring::WrongPeer).unwrap_err();
    assert!(matches!(e.rule, "wait-never-satisfied" | "device-deadlock" | "remote-buffer-race"), "{e}");
    assert!(e.to_string().contains("device 0"), "device 0 gets no copy: {e}");
}

#[test]
fn a_reused_receive_buffer_is_a_race() {
    let e = run_ring(4, DType::F32, Ring::ReusedBuffer).unwrap_err();
    assert_eq!(e.rule, "remote-buffer-race", "{e}");
    assert!(e.message.contains("`buf`"), "{e}");
}

#[test]
fn an_unbalanced_barrier_is_reported_at_the_end() {
    let e = run_ring(4, DType::F32, Ring::UnbalancedBarrier).unwrap_err();
    assert_eq!(e.rule, "semaphore-unbalanced", "{e}");
    assert!(e.subject.contains("`barrier`"), "{e}");
    // Without the barrier the ring still gathers (the interpreter's devices all exist).
    run_ring(4, DType::F32, Ring::NoBarrier).unwrap();
}

/// Two devices that each wait for the other's signal before signalling: a deadlock.
#[test]
fn devices_waiting_on_each_other_deadlock() {
    let mut b = KernelBuilder::new("handshake");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.input("x", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let ready = b.regular_semaphores("ready", 1);
    let me = b.device_id();
    let peer = b.sub(1, me);
    b.semaphore_wait(Sem::at(ready, 0), 1);
    b.semaphore_signal(Sem::at(ready, 0), 1, Some(Arg::Val(peer)));
    let v = b.load(x, &[]);
    b.store(o, &[], v);
    let k = b.finish().unwrap();
    let xs = [Array::from_f32(&[8, 128], vec![1.0; 1024]), Array::from_f32(&[8, 128], vec![2.0; 1024])];
    let e = interp::run_devices(&k, &[vec![&xs[0]], vec![&xs[1]]]).unwrap_err();
    assert_eq!(e.rule, "device-deadlock", "{e}");
    assert!(e.message.contains("device 0 at grid step [0] in semaphore_wait") && e.message.contains("device 1 at grid step [0] in semaphore_wait"), "{e}");
    // Run on one device, the mesh is refused, not waited on forever.
    let e = interp::run(&k, &[&xs[0]]).unwrap_err();
    assert_eq!(e.rule, "mesh-run", "{e}");
}

#[test]
fn a_wait_no_other_device_will_satisfy() {
    let mut b = KernelBuilder::new("one_sided");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let ready = b.regular_semaphores("ready", 1);
    b.store(o, &[], 0.0);
    let me = b.device_id();
    let first = b.cmp(CmpOp::Eq, me, 0);
    b.when(first, |b| b.semaphore_wait(Sem::at(ready, 0), 1));
    let k = b.finish().unwrap();
    let e = interp::run_devices(&k, &[Vec::<&Array>::new(), Vec::new()]).unwrap_err();
    assert_eq!(e.rule, "wait-never-satisfied", "{e}");
    assert!(e.subject.starts_with("device 0") && e.message.contains("every other device has ended"), "{e}");
}

#[test]
fn the_verifier_checks_what_it_can_before_a_run() {
    let t = Target::V5E;
    verify(&all_gather(4, DType::F32, Ring::Correct), &t).unwrap();
    // A constant peer outside the mesh.
    let mut b = KernelBuilder::new("bad_peer");
    b.mesh(&[("x", 4)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[ROWS, D], MemorySpace::Any);
    let out = b.unblocked(RefKind::Output, "out", DType::F32, &[ROWS, D], MemorySpace::Any);
    let send = b.semaphores("send", 1);
    let recv = b.semaphores("recv", 1);
    let c = RemoteCopy { src: x, src_index: &[], dst: out, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: 4.into() };
    b.remote_copy_start(&c);
    b.remote_copy_wait_send(&c);
    b.remote_copy_wait_recv(&c);
    let k = b.finish().unwrap();
    let e = verify(&k, &t).unwrap_err();
    assert_eq!(e.rule, "device-id-range", "{e}");
    // The same copy in a kernel that declares no mesh.
    let mut k2 = k.clone();
    k2.collective = None;
    let e = verify(&k2, &t).unwrap_err();
    assert_eq!(e.rule, "collective-undeclared", "{e}");
    // Remote shapes and dtypes match, as for local copies.
    let mut b = KernelBuilder::new("bad_shape");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[ROWS, D], MemorySpace::Any);
    let out = b.unblocked(RefKind::Output, "out", DType::BF16, &[ROWS, D], MemorySpace::Any);
    let send = b.semaphores("send", 1);
    let recv = b.semaphores("recv", 1);
    b.remote_copy_start(&RemoteCopy { src: x, src_index: &[], dst: out, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: 1.into() });
    assert_eq!(b.finish().unwrap_err().rule, "dma-dtype");
    // A semaphore index outside its array, in hand-edited IR.
    let mut k3 = all_gather(2, DType::F32, Ring::Correct);
    let four = k3.values.len();
    k3.values.push(ValueData { ty: Type::scalar(DType::I32), def: ValueDef::Result(InstId(k3.insts.len() as u32), 0) });
    k3.insts.push(InstData { inst: Inst::Const(Scalar::Int(4)), results: vec![Value(four as u32)], loc: None });
    let body = k3.body;
    k3.blocks[body.index()].insts.insert(0, InstId(k3.insts.len() as u32 - 1));
    for d in &mut k3.insts {
        if let Inst::DmaStart { remote: Some(r), .. } = &mut d.inst {
            r.send_index = Value(four as u32);
        }
    }
    let e = verify(&k3, &t).unwrap_err();
    assert_eq!(e.rule, "semaphore-index", "{e}");
    // Counting-semaphore ops on a DMA semaphore are refused by the builder.
    let mut b = KernelBuilder::new("wrong_kind");
    b.grid(&[(1, Semantics::Arbitrary)]);
    let s = b.semaphores("s", 1);
    b.semaphore_signal(Sem::at(s, 0), 1, None);
    assert_eq!(b.finish().unwrap_err().rule, "semaphore-kind");
    // A mesh axis the kernel does not declare.
    let mut b = KernelBuilder::new("no_axis");
    b.mesh(&[("x", 2)], 0);
    b.axis_index("y");
    assert_eq!(b.finish().unwrap_err().rule, "mesh-axis");
}

#[test]
fn printed_ir_shows_the_mesh_and_the_remote_copies() {
    let text = format!("{}", all_gather(4, DType::F32, Ring::Correct));
    for want in ["mesh [x=4] collective_id 0", "device_id", "semaphore_signal barrier += ", "on device %", "semaphore_wait barrier -= ", "-> device %", "send @3[", "dma_wait_send device %", "dma_wait_recv device %"] {
        assert!(text.contains(want), "`{want}` missing from:\n{text}");
    }
}


/// A 2x2 mesh: a ring of 2 along axis `y` inside each row `x`, the peer named by its mesh
/// coordinates. Each device ends with its row's two shards; logical ids are row-major.
#[test]
fn a_ring_along_the_minor_axis_of_a_2d_mesh() {
    let mut b = KernelBuilder::new("row_all_gather");
    b.mesh(&[("x", 2), ("y", 2)], 1);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[ROWS, D], MemorySpace::Any);
    let out = b.unblocked(RefKind::Output, "out", DType::F32, &[2, ROWS, D], MemorySpace::Any);
    let send = b.semaphores("send", 1);
    let recv = b.semaphores("recv", 1);
    let local = b.semaphores("local", 1);
    let row = b.axis_index("x");
    let col = b.axis_index("y");
    let other = b.sub(1, col);
    let peer = b.mesh_device(&[Arg::Val(row), Arg::Val(other)]);
    b.dma_start(x, &[], out, &[ds(col, 1)], local, 0);
    b.dma_wait(x, &[], out, &[ds(col, 1)], local, 0);
    b.semaphore_signal(Sem::Barrier, 1, Some(Arg::Val(peer)));
    b.semaphore_wait(Sem::Barrier, 1);
    let c = RemoteCopy { src: out, src_index: &[ds(col, 1)], dst: out, dst_index: &[ds(col, 1)], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: Arg::Val(peer) };
    b.remote_copy_start(&c);
    b.remote_copy_wait_send(&c);
    b.remote_copy_wait_recv(&c);
    let k = b.finish().unwrap();
    verify(&k, &Target::V6E).unwrap();
    let shards: Vec<Array> = (0..4).map(|j| shard(DType::F32, j)).collect();
    let outs = interp::run_devices(&k, &shards.iter().map(|s| vec![s]).collect::<Vec<_>>()).unwrap();
    for (dev, o) in outs.iter().enumerate() {
        let r = dev / 2;
        let want: Vec<f32> = [2 * r, 2 * r + 1].iter().flat_map(|&j| shard(DType::F32, j).to_f32_vec()).collect();
        assert_eq!(o[0].to_f32_vec(), want, "device {dev} (row {r})");
    }
}

/// Bad input to the collective API is a named error, never a panic or a hang.
#[test]
fn misuse_is_a_named_error() {
    // Operands for the wrong number of devices.
    let k = all_gather(4, DType::F32, Ring::Correct);
    let s = shard(DType::F32, 0);
    let e = interp::run_devices(&k, &[vec![&s], vec![&s]]).unwrap_err();
    assert_eq!(e.rule, "mesh-run", "{e}");
    // A mesh with an empty axis, and one with a repeated name.
    for axes in [&[("x", 0)][..], &[("x", 2), ("x", 2)][..], &[][..]] {
        let mut k = all_gather(2, DType::F32, Ring::Correct);
        k.collective.as_mut().unwrap().mesh = axes.iter().map(|&(name, size)| MeshAxis { name: name.into(), size }).collect();
        let e = verify(&k, &Target::V5E).unwrap_err();
        assert_eq!(e.rule, "mesh-shape", "{axes:?}: {e}");
    }
    // A float device id, a negative amount (static, then computed at run time).
    let mut b = KernelBuilder::new("bad_args");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let ready = b.regular_semaphores("ready", 1);
    b.semaphore_signal(Sem::at(ready, 0), 1, Some(Arg::Float(1.0)));
    assert_eq!(b.finish().unwrap_err().rule, "index-type");
    let mut b = KernelBuilder::new("negative");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let ready = b.regular_semaphores("ready", 1);
    b.store(o, &[], 0.0);
    b.semaphore_signal(Sem::at(ready, 0), -1, None);
    let k = b.finish().unwrap();
    assert_eq!(verify(&k, &Target::V5E).unwrap_err().rule, "semaphore-amount");
    let mut b = KernelBuilder::new("negative_at_run_time");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let o = b.output("o", DType::F32, &[8, 128], BlockSpec { block_shape: vec![Some(8), Some(128)], index_map: vec![0.into(), 0.into()] });
    let ready = b.regular_semaphores("ready", 1);
    b.store(o, &[], 0.0);
    let me = b.device_id();
    let amount = b.sub(me, 1);
    b.semaphore_signal(Sem::at(ready, 0), amount, None);
    let k = b.finish().unwrap();
    let e = interp::run_devices(&k, &[Vec::<&Array>::new(), Vec::new()]).unwrap_err();
    assert_eq!(e.rule, "semaphore-amount", "{e}");
    assert!(e.subject.starts_with("device 0:"), "{e}");
    // A remote copy with a counting semaphore where a DMA semaphore belongs.
    let mut b = KernelBuilder::new("wrong_sem");
    b.mesh(&[("x", 2)], 0);
    b.grid(&[(1, Semantics::Arbitrary)]);
    let x = b.unblocked(RefKind::Input, "x", DType::F32, &[ROWS, D], MemorySpace::Any);
    let out = b.unblocked(RefKind::Output, "out", DType::F32, &[ROWS, D], MemorySpace::Any);
    let send = b.regular_semaphores("send", 1);
    let recv = b.semaphores("recv", 1);
    b.remote_copy_start(&RemoteCopy { src: x, src_index: &[], dst: out, dst_index: &[], send_sem: (send, 0.into()), recv_sem: (recv, 0.into()), device: 1.into() });
    assert_eq!(b.finish().unwrap_err().rule, "dma-semaphore");
    // Semaphores cannot be loaded.
    let mut b = KernelBuilder::new("load_sem");
    b.grid(&[(1, Semantics::Arbitrary)]);
    let s = b.regular_semaphores("s", 1);
    b.load(s, &[]);
    assert_eq!(b.finish().unwrap_err().rule, "semaphore-access");
    // The single-device entry points refuse a mesh kernel; the JIT-free Executor path too.
    let k = all_gather(2, DType::F32, Ring::Correct);
    let x0 = shard(DType::F32, 0);
    let e = tessera_dsl::exec::run(&Interpreter, &k, &[&x0]).unwrap_err();
    assert_eq!(e.rule, "mesh-run", "{e}");
}
