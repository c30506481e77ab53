//! Several devices running one kernel: the copies and semaphore counts between them (the
//! [`Fabric`]) and the scheduler that steps the devices.
//!
//! # Model
//!
//! - Every device of the kernel's mesh runs the same kernel on its own operands, with its
//!   own windows, scratch and semaphores. Devices are stepped round-robin, each until it
//!   ends or blocks, so a run is deterministic (no threads).
//! - A copy (local or remote) is in flight from its start until it *lands*: its source box
//!   is read at the start (the snapshot is what lands), its destination is poisoned at the
//!   start and written when it lands, which is as late as the hardware allows: at the first
//!   wait on either end (the receiver's `wait_recv` / `dma_wait`, the sender's
//!   `wait_send`). So a receiver that reads its buffer before waiting reads poison.
//! - A receive wait takes the oldest copy on the device's semaphore; with none yet, it
//!   blocks (a peer may still send). A send wait with nothing in flight is an error: only
//!   the device itself starts its sends.
//! - Counting semaphores (`regular_semaphores`, the barrier) hold a count per device; a
//!   signal adds to this device's or a peer's, a wait blocks until its own count suffices.
//! - When no device can move: `device-deadlock` if two or more still run (each one's
//!   blocked wait is named), `wait-never-satisfied` if only one does.
//! - Races with remote copies are errors (`remote-buffer-race`), not poison: a load or store
//!   of elements a copy into this device has not been waited for, a store into the source
//!   of a copy still in flight, a copy into or out of such elements.
//! - At the end, every copy must have been waited for at both ends (`dma-unwaited`) and
//!   every counting semaphore must be back at 0 (`semaphore-unbalanced`).

use std::collections::HashMap;

use super::*;

/// Elements of one ref on one device: a box in the ref's memory layout.
#[derive(Clone, Debug)]
pub(super) struct Region {
    pub r: RefId,
    pub origin: Vec<usize>,
    pub lens: Vec<usize>,
}

impl Region {
    fn overlaps(&self, r: RefId, origin: &[usize], lens: &[usize]) -> bool {
        self.r == r && self.origin.iter().zip(&self.lens).zip(origin.iter().zip(lens)).all(|((&a, &la), (&b, &lb))| a < b + lb && b < a + la)
    }
}

/// A copy started and not yet waited for at both ends.
pub(super) struct Transfer {
    pub from: usize,
    pub to: usize,
    pub remote: bool,
    /// Signalled on `to` when the copy lands.
    pub recv_sem: (RefId, usize),
    /// Signalled on `from` once the source is read (remote copies).
    pub send_sem: Option<(RefId, usize)>,
    pub src: Region,
    pub dst: Region,
    /// The source box, read when the copy started.
    pub data: Buf,
    pub bytes: usize,
    /// `dma_start at ..., device d grid step [..]`: for errors.
    pub issued: String,
    pub landed: bool,
    pub recv_done: bool,
    pub send_done: bool,
}

/// A counting semaphore of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum SemKey {
    Array(RefId, usize),
    Barrier,
}

impl SemKey {
    pub fn name(self, k: &Kernel) -> String {
        match self {
            SemKey::Array(r, i) => format!("`{}[{i}]`", k.refs[r.index()].name),
            SemKey::Barrier => "`barrier`".to_string(),
        }
    }
}

/// Where a device stopped: the wait that cannot complete yet.
#[derive(Clone, Debug)]
pub(super) struct Blocked {
    /// What it waits for, e.g. "semaphore `ready[0]` to reach 1 (it holds 0)".
    pub what: String,
    /// The waiting instruction's name.
    pub wait: &'static str,
    pub loc: Option<SourceLoc>,
    pub grid: Vec<usize>,
}

impl Blocked {
    fn describe(&self, device: usize) -> String {
        let at = self.loc.as_ref().map_or_else(String::new, |l| format!(" at {l}"));
        format!("device {device} at grid step {:?} in {}{at}, waiting for {}", self.grid, self.wait, self.what)
    }
}

/// A write into another device's memory, applied before that device runs again.
struct RemoteWrite {
    device: usize,
    region: Region,
    data: Buf,
}

/// What the devices share: copies in flight, counting semaphores, writes to deliver.
pub(super) struct Fabric {
    pub devices: usize,
    /// Whether a wait may block (several devices) or must complete now (one).
    pub multi: bool,
    pub transfers: Vec<Transfer>,
    pub counts: HashMap<(usize, SemKey), i64>,
    writes: Vec<RemoteWrite>,
}

impl Fabric {
    pub fn new(devices: usize, multi: bool) -> Fabric {
        Fabric { devices, multi, transfers: Vec::new(), counts: HashMap::new(), writes: Vec::new() }
    }

    /// `device d: ` in subjects when several devices run.
    pub fn device_prefix(&self, device: usize) -> String {
        if self.multi {
            format!("device {device}: ")
        } else {
            String::new()
        }
    }

    pub fn has_remote(&self) -> bool {
        self.transfers.iter().any(|t| t.remote)
    }

    /// The device id `v` names, checked against the mesh (`device-id-range`).
    pub fn device_id(&self, m: &Machine<'_, '_>, d: &InstData, v: Value) -> Result<usize> {
        let id = m.scalar_i32(v, d)?;
        if id < 0 || id as usize >= self.devices {
            return Err(m
                .err(
                    format!("{}instruction `{}`", self.device_prefix(m.device), d.inst.name()),
                    "device-id-range",
                    format!("at grid step {:?} device {} names device {id}, outside the mesh of {} device(s)", m.grid, m.device, self.devices),
                    "compute peer ids modulo the axis size, e.g. `(axis_index + 1) % n`",
                )
                .at(d.loc.clone()));
        }
        Ok(id as usize)
    }

    /// Queues `data` for `region` of `device` (not the running one).
    pub fn write_to(&mut self, device: usize, region: &Region, data: Buf) {
        self.writes.push(RemoteWrite { device, region: region.clone(), data });
    }

    /// The oldest copy a wait of `device` on `sem` completes: one landing there (`Recv`) or
    /// one it sent with that send semaphore (`Send`).
    pub fn oldest(&self, device: usize, side: DmaSide, sem: (RefId, usize)) -> Option<usize> {
        self.transfers.iter().position(|t| match side {
            DmaSide::Recv => t.to == device && t.recv_sem == sem && !t.recv_done,
            DmaSide::Send => t.from == device && t.send_sem == Some(sem) && !t.send_done,
        })
    }

    /// Completes one end of transfer `pos` for `m` (which waits): it lands if it has not.
    pub fn complete(&mut self, m: &mut Machine<'_, '_>, pos: usize, side: DmaSide) {
        let t = &mut self.transfers[pos];
        if !t.landed {
            t.landed = true;
            if t.to == m.device {
                m.write_dma(t.dst.r, &t.dst.origin, &t.dst.lens, &t.data);
            } else {
                let w = RemoteWrite { device: t.to, region: t.dst.clone(), data: t.data.clone() };
                self.writes.push(w);
            }
        }
        match side {
            DmaSide::Recv => t.recv_done = true,
            DmaSide::Send => t.send_done = true,
        }
        if t.recv_done && (t.send_sem.is_none() || t.send_done) {
            self.transfers.remove(pos);
        }
    }

    /// Delivers the queued writes into the devices' memories.
    fn deliver(&mut self, machines: &mut [Machine<'_, '_>]) {
        for w in self.writes.drain(..) {
            machines[w.device].write_dma(w.region.r, &w.region.origin, &w.region.lens, &w.data);
        }
    }

    fn race(&self, m: &Machine<'_, '_>, d: &InstData, message: String, help: &str) -> KernelError {
        m.err(format!("{}instruction `{}`", self.device_prefix(m.device), d.inst.name()), "remote-buffer-race", message, help).at(d.loc.clone())
    }

    /// A load or store by `m` of `r[origin..+lens]` against the remote copies in flight.
    pub fn check_access(&self, m: &Machine<'_, '_>, d: &InstData, what: &str, r: RefId, origin: &[usize], lens: &[usize]) -> Result<()> {
        let name = &m.k.refs[r.index()].name;
        for t in self.transfers.iter().filter(|t| t.remote) {
            if t.to == m.device && !t.recv_done && t.dst.overlaps(r, origin, lens) {
                return Err(self.race(
                    m,
                    d,
                    format!("at grid step {:?} device {} {what}s elements of `{name}` that a copy from device {} ({}) is writing, before waiting for it", m.grid, m.device, t.from, t.issued),
                    "wait for the copy (remote_copy_wait_recv with its descriptor) before touching its destination",
                ));
            }
            if what == "store" && t.from == m.device && !t.landed && t.src.overlaps(r, origin, lens) {
                return Err(self.race(
                    m,
                    d,
                    format!("at grid step {:?} device {} overwrites elements of `{name}` that its copy to device {} ({}) is still reading", m.grid, m.device, t.to, t.issued),
                    "wait until the copy has read its source (remote_copy_wait_send) before writing it, or write another buffer",
                ));
            }
        }
        Ok(())
    }

    /// A copy `t` about to start from `m`, against the copies in flight (one of the two remote).
    pub fn check_start(&self, m: &Machine<'_, '_>, d: &InstData, t: &Transfer) -> Result<()> {
        let (src, dst) = (&m.k.refs[t.src.r.index()].name, &m.k.refs[t.dst.r.index()].name);
        for e in self.transfers.iter().filter(|e| e.remote || t.remote) {
            if e.to == t.to && !e.recv_done && e.dst.overlaps(t.dst.r, &t.dst.origin, &t.dst.lens) {
                return Err(self.race(
                    m,
                    d,
                    format!(
                        "at grid step {:?} device {} copies into `{dst}` of device {}, over elements a copy from device {} ({}) has filled or is filling and device {} has not waited for: its data would be overwritten before it is read",
                        m.grid, m.device, t.to, e.from, e.issued, t.to
                    ),
                    "give each copy in flight its own buffer or slot (double-buffer), or have the receiver signal (semaphore_signal to the sender) when its buffer is free and wait for that before sending",
                ));
            }
            if e.from == t.to && !e.landed && e.src.overlaps(t.dst.r, &t.dst.origin, &t.dst.lens) {
                return Err(self.race(
                    m,
                    d,
                    format!("at grid step {:?} device {} copies into `{dst}` of device {}, over elements that device's copy to device {} ({}) is still reading", m.grid, m.device, t.to, e.to, e.issued),
                    "let the peer's send complete (it waits for it with remote_copy_wait_send, then signals you) before overwriting its source",
                ));
            }
            if e.to == m.device && !e.recv_done && e.dst.overlaps(t.src.r, &t.src.origin, &t.src.lens) {
                return Err(self.race(
                    m,
                    d,
                    format!("at grid step {:?} device {} sends elements of `{src}` that a copy from device {} ({}) is writing, before waiting for it", m.grid, m.device, e.from, e.issued),
                    "wait for the incoming copy (remote_copy_wait_recv) before forwarding its data",
                ));
            }
        }
        Ok(())
    }

    /// The error for an error raised by `device` (its subject names the device).
    fn on_device(&self, mut e: KernelError, device: usize) -> KernelError {
        let prefix = self.device_prefix(device);
        if !e.subject.starts_with(&prefix) {
            e.subject = format!("{prefix}{}", e.subject);
        }
        e
    }

    /// What must hold when every device has ended: no copy left unwaited, every counting
    /// semaphore back at 0.
    fn check_end(&self, k: &Kernel) -> Result<()> {
        if let Some(t) = self.transfers.first() {
            let (end, dev, sem, wait) = if !t.recv_done { ("receiving", t.to, t.recv_sem, "remote_copy_wait_recv / dma_wait") } else { ("sending", t.from, t.send_sem.unwrap_or(t.recv_sem), "remote_copy_wait_send") };
            return Err(KernelError::new(
                &k.name,
                format!("{}semaphore `{}[{}]`", self.device_prefix(dev), k.refs[sem.0.index()].name, sem.1),
                "dma-unwaited",
                format!("the kernel ended on every device with a copy ({}) from device {} into `{}` of device {} never waited for at its {end} end", t.issued, t.from, k.refs[t.dst.r.index()].name, t.to),
                format!("wait for every copy at both ends ({wait}); on a TPU the semaphore keeps its count into the next kernel"),
            ));
        }
        let mut left: Vec<(&(usize, SemKey), &i64)> = self.counts.iter().filter(|(_, &c)| c != 0).collect();
        left.sort_by_key(|((dev, key), _)| (*dev, format!("{key:?}")));
        if let Some(((dev, key), count)) = left.first() {
            return Err(KernelError::new(
                &k.name,
                format!("{}semaphore {}", self.device_prefix(*dev), key.name(k)),
                "semaphore-unbalanced",
                format!("the kernel ended with the semaphore at {count} on device {dev}: it was signalled more than it was waited for"),
                "wait for every signal (semaphore_wait of the same total); a semaphore left non-zero corrupts the next kernel that uses it (the barrier is shared by every kernel of its collective_id)",
            ));
        }
        Ok(())
    }
}

/// Runs `machines` (one per device, each started) to the end, round-robin.
pub(super) fn run_machines(k: &Kernel, machines: &mut [Machine<'_, '_>], fab: &mut Fabric) -> Result<()> {
    let n = machines.len();
    let mut done = vec![false; n];
    let mut blocked: Vec<Option<Blocked>> = vec![None; n];
    while done.iter().any(|d| !d) {
        let mut progressed = false;
        for dev in 0..n {
            if done[dev] {
                continue;
            }
            let before = machines[dev].executed;
            let flow = machines[dev].run(fab);
            fab.deliver(machines);
            let flow = flow.map_err(|e| fab.on_device(e, dev))?;
            progressed |= machines[dev].executed != before;
            match flow {
                Flow::Done => {
                    done[dev] = true;
                    blocked[dev] = None;
                    progressed = true;
                }
                Flow::Blocked(b) => blocked[dev] = Some(b),
            }
        }
        if progressed {
            continue;
        }
        let live: Vec<(usize, &Blocked)> = blocked.iter().enumerate().filter(|(d, _)| !done[*d]).filter_map(|(d, b)| b.as_ref().map(|b| (d, b))).collect();
        if let [(dev, b)] = live.as_slice() {
            return Err(KernelError::new(
                &k.name,
                format!("device {dev}: instruction `{}`", b.wait),
                "wait-never-satisfied",
                format!("{}, and every other device has ended: nothing can complete the wait", b.describe(*dev)),
                "match every wait with a signal or copy from a peer that really sends it (check the peer ids and the number of steps)",
            )
            .at(b.loc.clone()));
        }
        let devs: Vec<String> = live.iter().map(|(d, _)| d.to_string()).collect();
        let each: Vec<String> = live.iter().map(|(d, b)| b.describe(*d)).collect();
        return Err(KernelError::new(
            &k.name,
            format!("devices {}", devs.join(", ")),
            "device-deadlock",
            format!("every running device is blocked: {}", each.join("; ")),
            "each wait needs a peer that signals or sends to it before waiting itself: check the order of starts, signals and waits around the ring",
        ));
    }
    fab.check_end(k)
}

/// Runs `kernel` on every device of its mesh: `inputs[d]` and `outputs[d]` are device `d`'s
/// operands (as [`run_into`] takes them), `d` its logical id. Errors name the device.
pub fn run_devices_into(kernel: &Kernel, inputs: &[Vec<HostRef<'_>>], outputs: &mut [Vec<HostMut<'_>>]) -> Result<Vec<RunStats>> {
    crate::verify::runnable(kernel)?;
    run_devices_host(kernel, inputs, outputs, OutputState::Unknown)
}

/// [`run_devices_into`] on `Array`s: `args[d]` are device `d`'s prefetch and input operands;
/// returns each device's outputs.
pub fn run_devices(kernel: &Kernel, args: &[Vec<&Array>]) -> Result<Vec<Vec<Array>>> {
    crate::verify::runnable(kernel)?;
    let mut outputs = Vec::with_capacity(args.len());
    for _ in args {
        let mut mine = Vec::new();
        for d in outputs_of(kernel) {
            let a = Array::try_filled(d.dtype, &d.shape, Fill::Poison).map_err(|e| KernelError::new(&kernel.name, format!("output `{}`", d.name), "host-memory", e.to_string(), "run a smaller shape, or on a machine with more memory"))?;
            mine.push(a);
        }
        outputs.push(mine);
    }
    let inputs: Vec<Vec<HostRef<'_>>> = args.iter().map(|a| a.iter().map(|x| x.as_host()).collect()).collect();
    let mut views: Vec<Vec<HostMut<'_>>> = outputs.iter_mut().map(|o| o.iter_mut().map(Array::as_host_mut).collect()).collect();
    run_devices_host(kernel, &inputs, &mut views, OutputState::Poisoned)?;
    drop(views);
    Ok(outputs)
}

fn run_devices_host(kernel: &Kernel, inputs: &[Vec<HostRef<'_>>], outputs: &mut [Vec<HostMut<'_>>], state: OutputState) -> Result<Vec<RunStats>> {
    let start = Instant::now();
    let n = kernel.collective.as_ref().map_or(1, Collective::devices);
    if inputs.len() != n || outputs.len() != n {
        return Err(KernelError::new(
            &kernel.name,
            "mesh",
            "mesh-run",
            format!("operands for {} device(s) and outputs for {}, the mesh has {n}", inputs.len(), outputs.len()),
            "pass one set of operands and outputs per device of the mesh, in logical-id order",
        ));
    }
    let mut machines = Vec::with_capacity(n);
    for (dev, (ins, outs)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
        let fab = Fabric::new(n, true);
        let mut m = Machine::new(kernel, ins, outs, state).map_err(|e| fab.on_device(e, dev))?;
        m.device = dev;
        m.start(run_extents(kernel, ins).map_err(|e| fab.on_device(e, dev))?);
        machines.push(m);
    }
    let mut fab = Fabric::new(n, true);
    run_machines(kernel, &mut machines, &mut fab)?;
    Ok(machines
        .into_iter()
        .map(|m| {
            let mut s = m.stats;
            s.elapsed = start.elapsed();
            s
        })
        .collect())
}
