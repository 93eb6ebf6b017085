//! Evicted pages leave the device without holding up the step stream. A page's blocks are
//! gathered into a device slot by a kernel on the main stream (so the gather reads them before any
//! later step can overwrite them), a copy stream waits for that kernel and moves the slot into
//! pinned host memory, and a completion thread turns the pinned bytes into the page image and
//! hands it on. The executor thread only launches; the copy engine and the completion thread do
//! the rest while the next steps run.
//!
//! Owns its slots (device buffer + pinned buffer + events), the copy stream and the completion
//! thread. It knows nothing about pages or the spill tier: callers pass a callback.

use std::sync::Arc;
use std::thread::JoinHandle;

use cudarc::driver::{result as drv, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use parking_lot::Mutex;

use super::gpu::{dev_err, DevBuf, Gpu};
use crate::backend::{BackendError, PageImageDone};

/// Pinned memory for pages in flight: a whole prompt's evictions (24 pages of 32 MiB for 6k
/// tokens of an 8B llama) fit without the executor waiting for a slot.
const RING_BYTES: usize = 1 << 30;
/// Slots whatever the page size: at least two, so copies overlap; at most 32.
const MIN_SLOTS: usize = 2;
const MAX_SLOTS: usize = 32;
/// Piece of an image one core copies out of pinned memory at a time.
const COPY_PIECE: usize = 4 << 20;

struct Slot {
    /// Where the gather kernel writes the page; grown on demand.
    device: Option<DevBuf>,
    /// Normal (cached, not write-combined) pinned memory: the completion thread reads it.
    host: Option<PinnedHostSlice<u8>>,
    /// Recorded on the main stream after the gather.
    gathered: CudaEvent,
    /// Recorded on the copy stream after the device→host copy.
    copied: CudaEvent,
}

enum Job {
    /// A started copy: wait for it, hand the image on, free the slot.
    Page { slot: usize, bytes: usize, done: PageImageDone },
    /// Answer once every earlier job is done.
    Flush(flume::Sender<()>),
}

pub struct PageMover {
    ctx: Arc<CudaContext>,
    copy_stream: Arc<CudaStream>,
    slots: Vec<Arc<Mutex<Slot>>>,
    /// Slots free for a new gather (the completion thread returns them).
    free_rx: flume::Receiver<usize>,
    free_tx: flume::Sender<usize>,
    jobs: Option<flume::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl PageMover {
    /// Slots for pages of about `page_bytes` (the ring's budget over the page size).
    pub fn new(gpu: &Gpu, page_bytes: usize) -> Result<Self, BackendError> {
        let ctx = gpu.ctx.clone();
        let copy_stream = ctx.new_stream().map_err(|e| dev_err("creating the page copy stream", e))?;
        let (free_tx, free_rx) = flume::unbounded();
        let count = (RING_BYTES / page_bytes.max(1)).clamp(MIN_SLOTS, MAX_SLOTS);
        let mut slots = Vec::with_capacity(count);
        for i in 0..count {
            let gathered = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            let copied = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            slots.push(Arc::new(Mutex::new(Slot { device: None, host: None, gathered, copied })));
            let _ = free_tx.send(i);
        }
        let (jobs, job_rx) = flume::unbounded::<Job>();
        let worker_slots = slots.clone();
        let worker_ctx = ctx.clone();
        let worker_free = free_tx.clone();
        let thread = std::thread::Builder::new()
            .name("shelfserve-page-out".into())
            .spawn(move || {
                let _ = worker_ctx.bind_to_thread();
                for job in job_rx {
                    match job {
                        Job::Page { slot, bytes, done } => {
                            let image = copy_out(&worker_slots[slot].lock(), bytes);
                            let _ = worker_free.send(slot);
                            done(image);
                        }
                        Job::Flush(answer) => {
                            let _ = answer.send(());
                        }
                    }
                }
            })
            .map_err(|e| BackendError::Device(format!("starting the page copy thread: {e}")))?;
        Ok(PageMover { ctx, copy_stream, slots, free_rx, free_tx, jobs: Some(jobs), thread: Some(thread) })
    }

    /// Starts moving `bytes` that `gather` writes into a device buffer out to the host; `done`
    /// gets the image on the completion thread. `gather(gpu, dst)` launches on the main stream.
    /// Blocks only while every slot is in flight.
    pub fn read(
        &self,
        gpu: &Gpu,
        bytes: usize,
        gather: impl FnOnce(&Gpu, u64) -> Result<(), BackendError>,
        done: PageImageDone,
    ) -> Result<(), BackendError> {
        let gone = || BackendError::Device("the page copy thread is gone".into());
        let index = self.free_rx.recv().map_err(|_| gone())?;
        if let Err(e) = self.start(gpu, index, bytes, gather) {
            // Nothing of this slot is in flight: it is free again at once.
            let _ = self.free_tx.send(index);
            return Err(e);
        }
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        jobs.send(Job::Page { slot: index, bytes, done }).map_err(|_| gone())
    }

    fn start(
        &self,
        gpu: &Gpu,
        index: usize,
        bytes: usize,
        gather: impl FnOnce(&Gpu, u64) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let mut slot = self.slots[index].lock();
        if slot.device.as_ref().is_none_or(|d| d.bytes() < bytes) {
            slot.device = Some(gpu.alloc(bytes)?);
        }
        if slot.host.as_ref().is_none_or(|h| h.len() < bytes) {
            // SAFETY: the completion thread reads only the `bytes` the copy below wrote, after
            // `copied` completes.
            slot.host = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
                    .map_err(|e| dev_err("allocating pinned page memory", e))?,
            );
        }
        let dst = slot.device.as_ref().map(DevBuf::ptr).unwrap_or_default();
        gather(gpu, dst)?;
        slot.gathered.record(&gpu.stream).map_err(|e| dev_err("recording a page event", e))?;
        self.copy_stream.wait(&slot.gathered).map_err(|e| dev_err("ordering the page copy", e))?;
        let host = slot.host.as_mut().ok_or_else(|| BackendError::Device("no pinned page memory".into()))?;
        let ptr = host.as_mut_ptr().map_err(|e| dev_err("pinned page memory", e))?;
        // SAFETY: `ptr` is `host.len() ≥ bytes` pinned bytes no one else touches until the
        // completion thread has waited for `copied`; `dst` holds `bytes` gathered bytes and is not
        // reused before this slot comes back from that thread.
        unsafe {
            let view = std::slice::from_raw_parts_mut(ptr, bytes);
            drv::memcpy_dtoh_async(view, dst, self.copy_stream.cu_stream())
                .map_err(|e| dev_err("device→host page copy", e))?;
        }
        slot.copied.record(&self.copy_stream).map_err(|e| dev_err("recording a page event", e))
    }

    /// Waits until every page started so far has been handed on.
    pub fn flush(&self) -> Result<(), BackendError> {
        let gone = || BackendError::Device("the page copy thread is gone".into());
        let Some(jobs) = &self.jobs else { return Ok(()) };
        let (tx, rx) = flume::bounded(1);
        jobs.send(Job::Flush(tx)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }
}

/// The slot's first `bytes` as an image, once its copy is done. Copied by all cores: a fresh
/// image's pages are first touched here, and one core faulting in 32 MiB is slower than the
/// copy engine that filled the slot.
fn copy_out(slot: &Slot, bytes: usize) -> Result<Vec<u8>, BackendError> {
    use rayon::prelude::*;
    slot.copied.synchronize().map_err(|e| dev_err("waiting for a page copy", e))?;
    let host = slot.host.as_ref().ok_or_else(|| BackendError::Device("no pinned page memory".into()))?;
    let ptr = host.as_ptr().map_err(|e| dev_err("pinned page memory", e))?;
    // SAFETY: the copy into these `bytes` completed (`copied`), and the slot is not reused
    // before it is returned to the free list after this copy.
    let src = unsafe { std::slice::from_raw_parts(ptr, bytes) };
    // Zeroed by the allocator as fresh pages (not written), so the copy is the first touch.
    let mut image = vec![0u8; bytes];
    image.par_chunks_mut(COPY_PIECE).zip(src.par_chunks(COPY_PIECE)).for_each(|(d, s)| d.copy_from_slice(s));
    Ok(image)
}

impl Drop for PageMover {
    fn drop(&mut self) {
        // Every started page is handed on before the buffers go.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
