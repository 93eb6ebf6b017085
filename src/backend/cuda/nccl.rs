//! NCCL communicators for CUDA tensor-parallel ranks: one communicator per rank, all ranks in one
//! process (one thread per GPU), created together with `ncclCommInitAll` and implementing
//! [`DeviceCollective`] on device memory, enqueued on each rank's own stream (so the collectives
//! order with the rank's kernels and can be captured into its CUDA graphs).
//!
//! NVLink multicast (NVLS) must stay off on shared hosts: a group is refused unless
//! `NCCL_NVLS_ENABLE=0` is set in the environment. A failing rank aborts every communicator of
//! the group, which releases the ranks blocked in a collective with an error instead of a hang.

use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use parking_lot::Mutex;

use crate::parallel::{CollectiveError, DeviceCollective};

/// The raw communicators of one group; destroyed once, or aborted once on a rank's failure.
struct Group {
    comms: Mutex<Option<Vec<CommHandle>>>,
    aborted: Mutex<Option<String>>,
}

#[derive(Clone, Copy)]
struct CommHandle(nccl_sys::ncclComm_t);

// SAFETY: an NCCL communicator is an opaque handle; NCCL allows using each one from one thread at
// a time (a rank's thread) and `ncclCommAbort` from any thread, which is all this module does.
unsafe impl Send for CommHandle {}
unsafe impl Sync for CommHandle {}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(comms) = self.comms.lock().take() {
            for c in comms {
                // SAFETY: each handle came from ncclCommInitAll and is released exactly once.
                let _ = unsafe { nccl::comm_destroy(c.0) };
            }
        }
    }
}

/// Whether NVLink multicast is switched off as this project requires on shared hosts.
pub fn nvls_disabled(value: Option<&str>) -> bool {
    value.map(str::trim) == Some("0")
}

/// One rank's handle: its communicator and the stream its collectives are enqueued on.
pub struct NcclComm {
    rank: usize,
    world: usize,
    ordinal: usize,
    comm: CommHandle,
    /// Null until [`NcclComm::bind_stream`].
    stream: CUstream,
    group: Arc<Group>,
}

// SAFETY: `stream` is the rank backend's stream handle (a driver handle valid from any thread
// with its context current); collectives are issued only by the rank's own thread (`&self`
// methods are called from the thread that runs the rank's forward pass).
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// One communicator per device, rank `i` on `ordinals[i]`. Each rank binds the stream it
    /// issues on ([`NcclComm::bind_stream`]) once its device is open, on its own thread.
    pub fn group(ordinals: &[usize]) -> Result<Vec<NcclComm>, CollectiveError> {
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if ordinals.is_empty() || seen.len() != ordinals.len() {
            return Err(CollectiveError::Invalid(format!(
                "an NCCL group needs one distinct device per rank, not {ordinals:?}"
            )));
        }
        if !nvls_disabled(std::env::var("NCCL_NVLS_ENABLE").ok().as_deref()) {
            return Err(CollectiveError::Invalid(
                "set NCCL_NVLS_ENABLE=0 before running tensor parallelism on CUDA (NVLink multicast can take a \
                 shared host's GPUs out of service)"
                    .into(),
            ));
        }
        // SAFETY: only tries to open the shared library.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(CollectiveError::Invalid(
                "the NCCL library (libnccl.so) was not found on the library path".into(),
            ));
        }
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut raw = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `raw` has room for one communicator per device in `devs`.
        unsafe { nccl::comm_init_all(raw.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| CollectiveError::Invalid(format!("ncclCommInitAll over devices {ordinals:?}: {:?}", e.0)))?;
        let handles: Vec<CommHandle> = raw.into_iter().map(CommHandle).collect();
        let group = Arc::new(Group { comms: Mutex::new(Some(handles.clone())), aborted: Mutex::new(None) });
        let world = handles.len();
        tracing::info!(world, devices = ?ordinals, "NCCL communicators ready");
        Ok(handles
            .into_iter()
            .zip(ordinals)
            .enumerate()
            .map(|(rank, (comm, &ordinal))| NcclComm {
                rank,
                world,
                ordinal,
                comm,
                stream: std::ptr::null_mut(),
                group: Arc::clone(&group),
            })
            .collect())
    }

    /// The device this rank's communicator was created for.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Issue this rank's collectives on `stream` (its backend's stream, on its device).
    pub fn bind_stream(&mut self, stream: CUstream) {
        self.stream = stream;
    }

    fn check(&self, what: &str, r: Result<nccl::NcclStatus, nccl::NcclError>) -> Result<(), CollectiveError> {
        if let Some(reason) = self.group.aborted.lock().clone() {
            return Err(CollectiveError::Aborted(reason));
        }
        r.map(|_| ()).map_err(|e| {
            let msg = format!("NCCL {what} on rank {}: {:?}", self.rank, e.0);
            self.abort(&msg);
            CollectiveError::Aborted(msg)
        })
    }

    fn live(&self) -> Result<(), CollectiveError> {
        if self.stream.is_null() {
            return Err(CollectiveError::Invalid(format!("rank {} has no stream bound", self.rank)));
        }
        match self.group.aborted.lock().clone() {
            Some(reason) => Err(CollectiveError::Aborted(reason)),
            None => Ok(()),
        }
    }
}

impl DeviceCollective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    unsafe fn all_reduce_sum_f32(&self, buf: u64, count: usize) -> Result<(), CollectiveError> {
        self.live()?;
        let p = buf as *mut std::ffi::c_void;
        // SAFETY: the caller guarantees `buf` holds `count` f32 on this rank's device.
        let r = unsafe {
            nccl::all_reduce(
                p,
                p,
                count,
                nccl_sys::ncclDataType_t::ncclFloat32,
                nccl_sys::ncclRedOp_t::ncclSum,
                self.comm.0,
                self.stream as _,
            )
        };
        self.check("all-reduce", r)
    }

    unsafe fn all_gather_f32(&self, send: u64, recv: u64, count: usize) -> Result<(), CollectiveError> {
        self.live()?;
        // SAFETY: the caller guarantees `send` holds `count` f32 and `recv` `count · world`.
        let r = unsafe {
            nccl::all_gather(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                nccl_sys::ncclDataType_t::ncclFloat32,
                self.comm.0,
                self.stream as _,
            )
        };
        self.check("all-gather", r)
    }

    fn abort(&self, reason: &str) {
        let mut aborted = self.group.aborted.lock();
        if aborted.is_some() {
            return;
        }
        *aborted = Some(format!("rank {} failed: {reason}", self.rank));
        drop(aborted);
        tracing::error!(rank = self.rank, reason, "aborting the NCCL group");
        if let Some(comms) = self.group.comms.lock().take() {
            for c in comms {
                // SAFETY: ncclCommAbort may be called from any thread, also while another thread
                // waits in a collective on that communicator (which it releases); each handle is
                // released exactly once (taken out of the group).
                let _ = unsafe { nccl::comm_abort(c.0) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvls_must_be_switched_off_explicitly() {
        assert!(nvls_disabled(Some("0")));
        assert!(nvls_disabled(Some(" 0 ")));
        assert!(!nvls_disabled(None));
        assert!(!nvls_disabled(Some("1")));
        assert!(!nvls_disabled(Some("")));
    }

    #[test]
    fn a_group_needs_one_distinct_device_per_rank() {
        let e = NcclComm::group(&[0, 0]).err().unwrap().to_string();
        assert!(e.contains("one distinct device per rank"), "{e}");
        assert!(NcclComm::group(&[]).is_err());
    }
}
