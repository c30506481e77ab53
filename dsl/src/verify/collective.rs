//! Kernels that talk to other devices: the mesh they declare, and what can be known about
//! their remote copies and semaphores before they run (constant device ids inside the
//! mesh, semaphores of the right kind and in range). What depends on run-time values (a
//! computed peer id, the order of signals and waits) the interpreter checks when it runs
//! every device (`interp::run_devices`).

use super::Verifier;
use crate::error::Result;
use crate::ir::*;
use crate::types::MemorySpace;

/// More devices than any TPU slice has; a mesh beyond it is a mistake (and its device
/// count could overflow the i32 ids Mosaic uses).
pub const MAX_MESH_DEVICES: usize = 1 << 16;

impl Verifier<'_> {
    pub(super) fn collective(&self) -> Result<()> {
        let k = self.k;
        if let Some(c) = &k.collective {
            self.mesh(c)?;
        } else if k.communicates() {
            let mut first = None;
            k.walk(k.body, &mut |_, d| {
                if first.is_none() && d.inst.communicates() {
                    first = Some(d.clone());
                }
            });
            let d = first.expect("communicates() found one");
            return Err(self
                .err(
                    format!("instruction `{}`", d.inst.name()),
                    "collective-undeclared",
                    "the kernel talks to other devices (a remote copy, a signal to a peer or the barrier semaphore) and declares no mesh",
                    "declare the mesh and collective_id (`mesh(&[(\"x\", n)], id)`, #[tpu_kernel(mesh = ...)]): Mosaic needs has_communication and collective_id, and the interpreter the device count",
                )
                .at(d.loc.clone()));
        }
        let devices = k.collective.as_ref().map_or(1, Collective::devices);
        let mut result = Ok(());
        k.walk(k.body, &mut |_, d| {
            if result.is_ok() {
                result = self.communication(d, devices).map_err(|e| e.or_at(&d.loc));
            }
        });
        result
    }

    fn mesh(&self, c: &Collective) -> Result<()> {
        let bad = |message: String| Err(self.err("mesh", "mesh-shape", message, "declare each mesh axis once, with a name and a size of at least 1"));
        if c.mesh.is_empty() {
            return bad("the mesh has no axes".into());
        }
        for (i, a) in c.mesh.iter().enumerate() {
            if a.size == 0 {
                return bad(format!("axis `{}` has size 0", a.name));
            }
            if a.name.is_empty() || c.mesh[..i].iter().any(|b| b.name == a.name) {
                return bad(format!("axis {i} is named `{}`, which is empty or repeats an earlier axis", a.name));
            }
        }
        let devices = c.mesh.iter().try_fold(1usize, |n, a| n.checked_mul(a.size));
        if devices.is_none_or(|n| n > MAX_MESH_DEVICES) {
            return bad(format!("the mesh has more than {MAX_MESH_DEVICES} devices"));
        }
        Ok(())
    }

    fn const_int(&self, v: Value) -> Option<i64> {
        match self.k.as_const(v) {
            Some(Scalar::Int(i)) => Some(i),
            _ => None,
        }
    }

    fn device_in_mesh(&self, what: &str, v: Value, devices: usize) -> Result<()> {
        match self.const_int(v) {
            Some(i) if i < 0 || i as usize >= devices => Err(self.err(
                format!("instruction `{what}`"),
                "device-id-range",
                format!("device id {i}, outside the mesh of {devices} device(s)"),
                "name a device of the mesh: compute peers modulo the axis size, e.g. `(axis_index + 1) % n`",
            )),
            _ => Ok(()),
        }
    }

    /// A semaphore `sem[index]` of the expected kind, with a constant index in range.
    fn semaphore_of(&self, what: &str, sem: RefId, index: Value, kind: MemorySpace) -> Result<()> {
        let decl = self.k.ref_decl(sem);
        if decl.memory != kind {
            let (rule, help) = if kind == MemorySpace::Semaphore {
                ("dma-semaphore", "copies signal DMA semaphores: declare them with `semaphores(n)`")
            } else {
                ("semaphore-kind", "signal and wait on counting semaphores (`regular_semaphores(n)`) or the barrier; DMA semaphores are signalled by copies")
            };
            return Err(self.err(format!("instruction `{what}`"), rule, format!("`{}` is in {}, not {}", decl.name, decl.memory.name(), kind.name()), help));
        }
        let n: usize = decl.shape.iter().product();
        match self.const_int(index) {
            Some(i) if i < 0 || i as usize >= n => {
                Err(self.err(format!("instruction `{what}`"), "semaphore-index", format!("semaphore {i} of `{}`, which has {n}", decl.name), "size the semaphore array for every copy or signal in flight, and index inside it"))
            }
            _ => Ok(()),
        }
    }

    fn communication(&self, d: &InstData, devices: usize) -> Result<()> {
        let what = d.inst.name();
        match &d.inst {
            Inst::DmaStart { sem, sem_index, remote: Some(r), .. } => {
                self.semaphore_of(what, *sem, *sem_index, MemorySpace::Semaphore)?;
                self.semaphore_of(what, r.send_sem, r.send_index, MemorySpace::Semaphore)?;
                self.device_in_mesh(what, r.device, devices)
            }
            Inst::DmaWait { sem, sem_index, remote: Some(r), .. } => {
                self.semaphore_of(what, *sem, *sem_index, MemorySpace::Semaphore)?;
                self.device_in_mesh(what, r.device, devices)
            }
            Inst::SemSignal { sem, amount, device } => {
                self.counting(what, sem, *amount)?;
                device.map_or(Ok(()), |v| self.device_in_mesh(what, v, devices))
            }
            Inst::SemWait { sem, amount } => self.counting(what, sem, *amount),
            _ => Ok(()),
        }
    }

    fn counting(&self, what: &str, sem: &SemaphoreRef, amount: Value) -> Result<()> {
        if let SemaphoreRef::Array { sem, index } = sem {
            self.semaphore_of(what, *sem, *index, MemorySpace::RegularSemaphore)?;
        }
        match self.const_int(amount) {
            Some(a) if a < 0 => Err(self.err(format!("instruction `{what}`"), "semaphore-amount", format!("the amount is {a}"), "signal and wait with amounts of at least 0")),
            _ => Ok(()),
        }
    }
}
