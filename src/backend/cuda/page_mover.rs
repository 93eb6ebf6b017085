//! Evicted pages leave the device without holding up the step stream. A page's blocks are
//! gathered into a device slot by a kernel on the main stream (so the gather reads them before any
//! later step can overwrite them), a copy stream waits for that kernel and moves the slot into
//! pinned host memory, and a completion thread turns the pinned bytes into the page image and
//! hands it on. The executor thread only launches; the copy engine and the completion thread do
//! the rest while the next steps run.
//!
//! Restored pages come back the same way in reverse: the image is copied into a slot's pinned
//! buffer, an upload stream moves it to the slot's device buffer, and the main stream waits for
//! that upload before the scatter kernel writes the blocks. Nothing is synchronized on the
//! executor thread (a pageable copy plus a device sync per page made a restore from host memory
//! slower than recomputing it); the completion thread frees the slot once the scatter has run.
//!
//! Owns its slots (device buffer + pinned buffer + events), the copy and upload streams and the
//! completion thread. It knows nothing about pages or the spill tier: callers pass a callback.

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
/// Threads that stage restored images into pinned memory: their own pool, so a restore does not
/// queue behind the copy-outs of the pages its own blocks evicted (on the shared pool each 32 MiB
/// restore waited ~25 ms for them, and the restore cost more than recomputing).
const MAX_STAGING_THREADS: usize = 8;
/// Restore slots whatever the page size (a quarter of the ring's budget, 2 to 8).
const MAX_UPLOAD_SLOTS: usize = 8;

struct Slot {
    /// Where the gather kernel writes the page; grown on demand.
    device: Option<DevBuf>,
    /// Normal (cached, not write-combined) pinned memory: the completion thread reads it.
    host: Option<PinnedHostSlice<u8>>,
    /// Recorded on the main stream after the gather (on the upload stream after a restore's upload).
    gathered: CudaEvent,
    /// Recorded on the copy stream after the device→host copy (on the main stream after a restore's
    /// scatter).
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
    /// Host→device copies of restored pages (the copy stream carries evictions the other way).
    upload_stream: Arc<CudaStream>,
    /// Copies restored images into pinned slots (see `MAX_STAGING_THREADS`).
    staging_pool: rayon::ThreadPool,
    /// Slots of restores, apart from the eviction slots so that a restore never waits for the
    /// copy-outs of the pages its own blocks evicted; used round robin.
    upload_slots: Vec<Mutex<Slot>>,
    next_upload: std::sync::atomic::AtomicUsize,
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
        let upload_stream = ctx.new_stream().map_err(|e| dev_err("creating the page upload stream", e))?;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let staging_pool = rayon::ThreadPoolBuilder::new()
            .num_threads((cores / 4).clamp(2, MAX_STAGING_THREADS))
            .thread_name(|i| format!("shelfserve-page-in-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("starting the page staging threads: {e}")))?;
        let (free_tx, free_rx) = flume::unbounded();
        let count = (RING_BYTES / page_bytes.max(1)).clamp(MIN_SLOTS, MAX_SLOTS);
        let mut slots = Vec::with_capacity(count);
        for i in 0..count {
            let gathered = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            let copied = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            slots.push(Arc::new(Mutex::new(Slot { device: None, host: None, gathered, copied })));
            let _ = free_tx.send(i);
        }
        let uploads = (RING_BYTES / 4 / page_bytes.max(1)).clamp(MIN_SLOTS, MAX_UPLOAD_SLOTS);
        let mut upload_slots = Vec::with_capacity(uploads);
        for _ in 0..uploads {
            let gathered = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            let copied = ctx.new_event(None).map_err(|e| dev_err("creating a page event", e))?;
            upload_slots.push(Mutex::new(Slot { device: None, host: None, gathered, copied }));
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
        Ok(PageMover {
            ctx,
            copy_stream,
            upload_stream,
            staging_pool,
            upload_slots,
            next_upload: std::sync::atomic::AtomicUsize::new(0),
            slots, free_rx, free_tx, jobs: Some(jobs), thread: Some(thread) })
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
        self.ensure_buffers(gpu, &mut slot, bytes)?;
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

    /// Grows a slot's buffers to `bytes`.
    fn ensure_buffers(&self, gpu: &Gpu, slot: &mut Slot, bytes: usize) -> Result<(), BackendError> {
        if slot.device.as_ref().is_none_or(|d| d.bytes() < bytes) {
            slot.device = Some(gpu.alloc(bytes)?);
        }
        if slot.host.as_ref().is_none_or(|h| h.len() < bytes) {
            // SAFETY: every reader of the buffer reads only bytes a copy wrote, after that copy's
            // event completes.
            slot.host = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
                    .map_err(|e| dev_err("allocating pinned page memory", e))?,
            );
        }
        Ok(())
    }

    /// Writes `image` back to the device: copied into a pinned restore slot here, uploaded on
    /// the upload stream, and handed to `scatter(gpu, src)`, which launches on the main stream
    /// after the upload (so every later step sees the blocks written). Returns without waiting for
    /// the device, except for the scatter that last used the same slot.
    pub fn write(
        &self,
        gpu: &Gpu,
        image: &[u8],
        scatter: impl FnOnce(&Gpu, u64) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        use rayon::prelude::*;
        use std::sync::atomic::Ordering;
        let bytes = image.len();
        let index = self.next_upload.fetch_add(1, Ordering::Relaxed) % self.upload_slots.len();
        let mut slot = self.upload_slots[index].lock();
        // `copied` marks the slot's last scatter (which ran after its upload): both buffers are free
        // after it. Never recorded yet: returns at once.
        slot.copied.synchronize().map_err(|e| dev_err("waiting for a restore slot", e))?;
        self.ensure_buffers(gpu, &mut slot, bytes)?;
        let dst = slot.device.as_ref().map(DevBuf::ptr).unwrap_or_default();
        let host = slot.host.as_mut().ok_or_else(|| BackendError::Device("no pinned page memory".into()))?;
        let ptr = host.as_mut_ptr().map_err(|e| dev_err("pinned page memory", e))?;
        // SAFETY: the slot's last scatter (hence its last upload) is done and the slot is locked:
        // its `bytes` pinned bytes are ours until the upload below, which reads them in stream order.
        let staged = unsafe { std::slice::from_raw_parts_mut(ptr, bytes) };
        self.staging_pool.install(|| {
            staged.par_chunks_mut(COPY_PIECE).zip(image.par_chunks(COPY_PIECE)).for_each(|(d, s)| d.copy_from_slice(s))
        });
        // SAFETY: `dst` holds at least `bytes` and nothing else reads or writes it before the
        // scatter below (ordered after this copy by `gathered`) has run.
        unsafe {
            drv::memcpy_htod_async(dst, &*staged, self.upload_stream.cu_stream())
                .map_err(|e| dev_err("host→device page copy", e))?;
        }
        slot.gathered.record(&self.upload_stream).map_err(|e| dev_err("recording a page event", e))?;
        gpu.stream.wait(&slot.gathered).map_err(|e| dev_err("ordering the page scatter", e))?;
        scatter(gpu, dst)?;
        slot.copied.record(&gpu.stream).map_err(|e| dev_err("recording a page event", e))
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

/// The slot's first `bytes` as an image, once its copy is done. Copied by all cores into memory
/// advised as huge pages: a fresh image is first touched here, and faulting in 32 MiB as 4 KiB
/// pages (8,192 faults, each zeroing its page) took ~25 ms, longer than the copy engine that filled
/// the slot; with a host tier keeping the images, every eviction is such a fresh allocation.
fn copy_out(slot: &Slot, bytes: usize) -> Result<Vec<u8>, BackendError> {
    use rayon::prelude::*;
    slot.copied.synchronize().map_err(|e| dev_err("waiting for a page copy", e))?;
    let host = slot.host.as_ref().ok_or_else(|| BackendError::Device("no pinned page memory".into()))?;
    let ptr = host.as_ptr().map_err(|e| dev_err("pinned page memory", e))?;
    // SAFETY: the copy into these `bytes` completed (`copied`), and the slot is not reused
    // before it is returned to the free list after this copy.
    let src = unsafe { std::slice::from_raw_parts(ptr, bytes) };
    let mut image: Vec<u8> = Vec::with_capacity(bytes);
    advise_huge_pages(image.as_mut_ptr(), bytes);
    image.spare_capacity_mut()[..bytes].par_chunks_mut(COPY_PIECE).zip(src.par_chunks(COPY_PIECE)).for_each(
        |(d, s)| {
            // SAFETY: `d` and `s` are equally long, `s` is initialized and the two do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), d.as_mut_ptr().cast::<u8>(), s.len()) }
        },
    );
    // SAFETY: the first `bytes` were all written just above.
    unsafe { image.set_len(bytes) };
    Ok(image)
}

/// Asks the kernel to back the whole 2 MiB pieces of `len` bytes at `ptr` with huge pages (a hint:
/// ignored where transparent huge pages are off).
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    const HUGE: usize = 2 << 20;
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside the allocation at `ptr`; MADV_HUGEPAGE changes no
        // contents and only affects how later faults are served.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
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
