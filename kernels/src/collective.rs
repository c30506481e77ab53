//! Collectives along one mesh axis, written with `#[tpu_kernel]` and remote DMA: every
//! device runs the same kernel on its own shard and talks to its peers.
//!
//! - [`ring_all_gather`]: `out[j]` = device `j`'s shard, on every device. Each device copies
//!   its shard into `out[me]` (HBM to HBM), then forwards slot `me - i` to its right
//!   neighbour for `i in 0..n-1`; the slot it forwards at step `i + 1` is the one that
//!   arrived from the left at step `i`, so each device waits for it first.
//! - [`ring_reduce_scatter`]: `out = sum_d x_d[me]`. At step `s` a device sends the partial
//!   sum of chunk `me - s - 1` to its right neighbour, which adds its own part of that chunk
//!   and forwards it; after `n - 1` steps chunk `me` has gone round the whole ring. Partials
//!   travel in f32 (bf16 inputs are added in f32 and rounded once); the receive buffer has
//!   two slots and a receiver hands a slot back (a `free` signal to its left neighbour)
//!   once it has read it, so a fast sender never overwrites a partial not yet added.
//! - [`all_gather_matmul`]: `all_gather(x) @ w` (collective matmul): the all-gather's ring
//!   runs under the matmuls, each step starting the copy of the shard it holds before its
//!   dot, with two shard slots handed back like the reduce-scatter's.
//! - [`ragged_all_to_all`]: MoE token dispatch / return (`lax.ragged_all_to_all`'s
//!   contract): variable rows per peer, the offsets and sizes as scalar prefetch, one
//!   remote copy per row (f32 / i32: packed rows cannot move singly).
//!
//! All start with the barrier handshake Pallas' ring uses (signal the neighbours, wait for
//! them; the all-to-all signals every peer): no device writes into a peer that has not
//! entered the kernel.
//!
//! `Broken` variants exist for the tests: each is a classic collective bug that the
//! interpreter's device simulation must name (see `tests/tests/collective.rs`).

use tessera_dsl::{DType, Kernel, KernelError, Type};
use tessera_macros::tpu_kernel;

/// A deliberate bug, for the tests that show the simulator catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broken {
    /// The kernel as it should be.
    No,
    /// A receive wait left out: data is forwarded (or added) before it has arrived.
    MissingWait,
    /// The right neighbour computed without wrapping around: the last device names a
    /// device outside the mesh.
    WrongPeer,
    /// One receive slot and no hand-back: the next partial lands before the last is read.
    ReusedBuffer,
}

#[tpu_kernel(
    grid = [1],
    semantics = [arbitrary],
    mesh = [(axis, n)],
    (send, recv, local) = semaphores(1),
)]
#[rustfmt::skip]
pub fn ring_all_gather_kernel(
    x: Any<m, k>, out: AnyOut<n, m, k>,
    send: Scratch, recv: Scratch, local: Scratch,
    axis: &'static str, broken: Broken,
) {
    let me = axis_index(axis);
    let left = (me + (n - 1)) % n;
    let right = if broken == Broken::WrongPeer { me + 1 } else { (me + 1) % n };
    dma_start(x, out[me], local[0]);
    dma_wait(x, out[me], local[0]);
    semaphore_signal(barrier_semaphore(), 1, left);
    semaphore_signal(barrier_semaphore(), 1, right);
    semaphore_wait(barrier_semaphore(), 2);
    for i in 0..n - 1 {
        let slot = (me - i + n) % n;
        remote_copy_start(out[slot], out[slot], send[0], recv[0], right);
        remote_copy_wait_send(out[slot], out[slot], send[0], recv[0], right);
        if broken != Broken::MissingWait {
            remote_copy_wait_recv(out[slot], out[slot], send[0], recv[0], right);
        }
    }
}

/// The ring all-gather of `n` shards of `[m, k]` along mesh axis `axis` (a mesh of that
/// one axis): each device's kernel takes its shard and returns all of them, `[n, m, k]`.
pub fn ring_all_gather(n: usize, m: usize, k: usize, dtype: DType, broken: Broken) -> Result<Kernel, KernelError> {
    ring_all_gather_kernel(Type::vector(dtype, &[m, k]), Type::vector(dtype, &[n, m, k]), "x", broken)
}

#[tpu_kernel(
    grid = [1],
    semantics = [arbitrary],
    mesh = [(axis, n)],
    x = block([n, m, k], |_g| [0, 0, 0]),
    out = block([m, k], |_g| [0, 0]),
    send_buf = scratch([m, k], f32),
    recv_buf = scratch([2, m, k], f32),
    (send, recv) = semaphores(2),
    free = regular_semaphores(1),
)]
#[rustfmt::skip]
pub fn ring_reduce_scatter_kernel(
    x: In<n, m, k>, out: Out<m, k>,
    send_buf: Scratch, recv_buf: Scratch, send: Scratch, recv: Scratch, free: Scratch,
    axis: &'static str, broken: Broken,
) {
    let me = axis_index(axis);
    let left = (me + (n - 1)) % n;
    let right = if broken == Broken::WrongPeer { me + 1 } else { (me + 1) % n };
    semaphore_signal(barrier_semaphore(), 1, left);
    semaphore_signal(barrier_semaphore(), 1, right);
    semaphore_wait(barrier_semaphore(), 2);
    let first = (me + (n - 1)) % n;
    let mut acc = x[(first, .., ..)].reshape([m, k]).cast(f32);
    for s in 0..n - 1 {
        let slot = if broken == Broken::ReusedBuffer { 0 } else { s % 2 };
        // The right neighbour's slot is free once it has added what we sent there two
        // steps ago (it says so with a `free` signal).
        if broken != Broken::ReusedBuffer {
            if s >= 2 {
                semaphore_wait(free[0], 1);
            }
        }
        send_buf[..] = acc;
        remote_copy_start(send_buf, recv_buf[slot], send[slot], recv[slot], right);
        if broken != Broken::MissingWait {
            remote_copy_wait_recv(send_buf, recv_buf[slot], send[slot], recv[slot], right);
        }
        let chunk = (me + (2 * n - 2) - s) % n;
        acc = recv_buf[(slot, .., ..)].reshape([m, k]) + x[(chunk, .., ..)].reshape([m, k]).cast(f32);
        if broken != Broken::ReusedBuffer {
            semaphore_signal(free[0], 1, left);
        }
        remote_copy_wait_send(send_buf, recv_buf[slot], send[slot], recv[slot], right);
    }
    // Take the hand-backs not waited for in the loop (the last two steps'), so the
    // semaphore ends at 0.
    if broken != Broken::ReusedBuffer {
        semaphore_wait(free[0], if n > 2 { 2 } else { n - 1 });
    }
    out[..] = acc.cast(out.dtype);
}

/// The ring reduce-scatter along mesh axis `axis` of `n` devices: each device's kernel
/// takes its `[n, m, k]` contribution and returns `sum over devices of x[me]`, `[m, k]`.
pub fn ring_reduce_scatter(n: usize, m: usize, k: usize, dtype: DType, broken: Broken) -> Result<Kernel, KernelError> {
    ring_reduce_scatter_kernel(Type::vector(dtype, &[n, m, k]), Type::vector(dtype, &[m, k]), "x", broken)
}

#[tpu_kernel(
    grid = [1],
    semantics = [arbitrary],
    mesh = [(axis, nd)],
    x = block([m, k], |_g| [0, 0]),
    w = block([k, n], |_g| [0, 0]),
    out = block([nd, m, n], |_g| [0, 0, 0]),
    buf = scratch([2, m, k], x.dtype),
    (send, recv) = semaphores(2),
    free = regular_semaphores(1),
)]
#[rustfmt::skip]
pub fn all_gather_matmul_kernel(
    x: In<m, k>, w: In<k, n>, out: Out<nd, m, n>,
    buf: Scratch, send: Scratch, recv: Scratch, free: Scratch,
    axis: &'static str, broken: Broken,
) {
    let me = axis_index(axis);
    let left = (me + (nd - 1)) % nd;
    let right = (me + 1) % nd;
    buf[(0, .., ..)] = x[..].reshape([1, m, k]);
    semaphore_signal(barrier_semaphore(), 1, left);
    semaphore_signal(barrier_semaphore(), 1, right);
    semaphore_wait(barrier_semaphore(), 2);
    for i in 0..nd {
        let cur = i % 2;
        let nxt = 1 - cur;
        // The shard in `buf[cur]` came from device `me - i`.
        let slot = (me + nd - i) % nd;
        let more = i < nd - 1;
        if more {
            // The right neighbour's `buf[nxt]` is free once its previous dot and send are
            // done (it says so); then pass the current shard on before computing with it,
            // so the copy runs while the MXU works.
            if broken != Broken::ReusedBuffer {
                if i >= 1 {
                    semaphore_wait(free[0], 1);
                }
            }
            remote_copy_start(buf[cur], buf[nxt], send[cur], recv[nxt], right);
        }
        let part = dot(buf[(cur, .., ..)].reshape([m, k]), w[..]);
        out[(slot, .., ..)] = part.cast(out.dtype).reshape([1, m, n]);
        if more {
            remote_copy_wait_send(buf[cur], buf[nxt], send[cur], recv[nxt], right);
            remote_copy_wait_recv(buf[cur], buf[nxt], send[cur], recv[nxt], right);
            // `buf[cur]` is read (dot done, send done): the left neighbour may refill it.
            if broken != Broken::ReusedBuffer {
                if i + 2 < nd {
                    semaphore_signal(free[0], 1, left);
                }
            }
        }
    }
}

/// All-gather matmul (collective matmul) along mesh axis `"x"` of `nd` devices: each device
/// holds `x`, a `[m, k]` row shard, and the whole `w: [k, n]`; every device returns
/// `all_gather(x) @ w` as `[nd, m, n]` (block `j` = device `j`'s shard times `w`). The ring
/// of the all-gather runs under the matmuls: each step starts the copy of the shard it holds
/// to its right neighbour, then multiplies that shard (f32 accumulation), then waits.
/// (`Broken::ReusedBuffer` drops the hand-back of the two shard slots.)
pub fn all_gather_matmul(nd: usize, m: usize, k: usize, n: usize, dtype: DType, broken: Broken) -> Result<Kernel, KernelError> {
    all_gather_matmul_kernel(Type::vector(dtype, &[m, k]), Type::vector(dtype, &[k, n]), Type::vector(dtype, &[nd, m, n]), "x", broken)
}

#[tpu_kernel(
    grid = [1],
    semantics = [arbitrary],
    mesh = [(axis, nd)],
    (send, recv) = semaphores(1),
)]
#[rustfmt::skip]
pub fn ragged_all_to_all_kernel(
    input_offsets: Prefetch<nd>, send_sizes: Prefetch<nd>, output_offsets: Prefetch<nd>, recv_sizes: Prefetch<nd>,
    x: Any<t, h>, out: AnyOut<tout, h>,
    send: Scratch, recv: Scratch,
    axis: &'static str,
) {
    let me = axis_index(axis);
    // Every device writes into every other: all of them must be in the kernel first.
    for p in 0..nd {
        if p != me {
            semaphore_signal(barrier_semaphore(), 1, p);
        }
    }
    semaphore_wait(barrier_semaphore(), nd - 1);
    // One copy per row: `send_sizes[p]` rows from `input_offsets[p]` land at
    // `output_offsets[p]` of device `p` (its own copy too, through the same path).
    for p in 0..nd {
        let src = input_offsets[p];
        let dst = output_offsets[p];
        for r in 0..send_sizes[p] {
            remote_copy_start(x[ds(src + r, 1)], out[ds(dst + r, 1)], send[0], recv[0], p);
        }
    }
    for p in 0..nd {
        for _r in 0..send_sizes[p] {
            remote_copy_wait_send(x[ds(0, 1)], out[ds(0, 1)], send[0], recv[0], p);
        }
    }
    // Every copy signals our receive semaphore once per row, whoever sent it.
    for p in 0..nd {
        for _r in 0..recv_sizes[p] {
            remote_copy_wait_recv(x[ds(0, 1)], out[ds(0, 1)], send[0], recv[0], p);
        }
    }
}

/// Ragged all-to-all along mesh axis `"x"` of `nd` devices (MoE token dispatch and return,
/// `jax.lax.ragged_all_to_all`'s contract): device `d` sends rows
/// `input_offsets[p] .. + send_sizes[p]` of its `x: [t, h]` to device `p`, where they land at
/// `output_offsets[p]` of `p`'s `out: [tout, h]`; `recv_sizes[p]` is how many rows device `p`
/// sends to `d`. The four int32 `[nd]` arrays are scalar prefetch (host metadata). Rows
/// move one by one, so any row offset is aligned for 32-bit dtypes; packed dtypes (bf16)
/// would need row pairs, which the verifier refuses (`dma-slice-size`). Rows of `out` no one
/// writes stay as they were (uninitialised on a TPU, poison here).
pub fn ragged_all_to_all(nd: usize, t: usize, tout: usize, h: usize, dtype: DType) -> Result<Kernel, KernelError> {
    let meta = Type::vector(DType::I32, &[nd]);
    ragged_all_to_all_kernel(meta.clone(), meta.clone(), meta.clone(), meta, Type::vector(dtype, &[t, h]), Type::vector(dtype, &[tout, h]), "x")
}
