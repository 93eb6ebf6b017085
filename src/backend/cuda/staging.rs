//! Fast weight upload: matrices go from the memory-mapped checkpoint to the device through a
//! ring of pinned (page-locked, write-combined) staging buffers. All cores read and convert the
//! next buffer's share of the checkpoint while the copy engine moves the previous buffers to the
//! device, each on its own stream; no host copy of the whole model is ever made. A rank's share
//! of a tensor (rows or columns) is read in place from the map, never cut into a temporary.
//!
//! [`MatrixRuns`] (what goes where, and the conversion) is plain host code with unit tests;
//! [`StagingUploader`] owns the pinned ring and the streams.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED;
use cudarc::driver::{result as drv, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};
use rayon::prelude::*;

use super::gpu::{dev_err, DevBuf, Gpu, Precision};
use super::shard::Cut;
use crate::backend::BackendError;
use crate::model::tensor::{to_f32, DType, TensorView};

/// A matrix on its way to the device, as runs of source elements in output order.
pub struct MatrixRuns<'a> {
    runs: Vec<Run<'a>>,
    /// Output element index where each run starts (same length as `runs`).
    starts: Vec<usize>,
    elems: usize,
}

enum Run<'a> {
    /// Consecutive elements of a stored plain tensor (F32, F16 or BF16), as bytes of the map.
    Stored { dtype: DType, bytes: &'a [u8] },
    /// Values decoded up front (block-quantized sources, whose blocks do not split at a cut).
    Decoded(Vec<f32>),
    /// Padding rows.
    Zeros(usize),
}

impl Run<'_> {
    fn len(&self) -> usize {
        match self {
            Run::Stored { dtype, bytes } => bytes.len() / dtype.block_bytes(),
            Run::Decoded(v) => v.len(),
            Run::Zeros(n) => *n,
        }
    }
}

impl<'a> MatrixRuns<'a> {
    /// `parts` stacked by rows, each a `[rows, cols]` tensor cut by its `Cut` (as `Cut::apply`
    /// would, without materialising the cut).
    pub fn new(parts: &[(TensorView<'a>, Cut)]) -> Self {
        let mut runs = Vec::new();
        for (view, cut) in parts {
            let cols = *view.shape.last().unwrap_or(&1);
            if view.dtype.is_quantized() {
                runs.push(Run::Decoded(cut.apply(&to_f32(view), cols)));
                continue;
            }
            let (dtype, es) = (view.dtype, view.dtype.block_bytes());
            let rows = |r: std::ops::Range<usize>| Run::Stored {
                dtype,
                bytes: &view.data[r.start * cols * es..r.end * cols * es],
            };
            match cut {
                Cut::Rows(r) => runs.push(rows(r.clone())),
                Cut::PaddedRows { rows: r, to } => {
                    runs.push(rows(r.clone()));
                    runs.push(Run::Zeros((to - r.len()) * cols));
                }
                Cut::Cols(c) => {
                    let n_rows = view.data.len() / es / cols.max(1);
                    runs.extend((0..n_rows).map(|row| Run::Stored {
                        dtype,
                        bytes: &view.data[(row * cols + c.start) * es..(row * cols + c.end) * es],
                    }));
                }
            }
        }
        runs.retain(|r| r.len() > 0);
        let mut starts = Vec::with_capacity(runs.len());
        let mut elems = 0;
        for r in &runs {
            starts.push(elems);
            elems += r.len();
        }
        MatrixRuns { runs, starts, elems }
    }

    pub fn elems(&self) -> usize {
        self.elems
    }

    /// Write output elements `first..first + out.len() / prec.bytes()` into `out`, converted to
    /// `prec` exactly as `to_f32` followed by the backend's f32→storage rounding would.
    pub fn fill(&self, first: usize, out: &mut [u8], prec: Precision) {
        let eb = prec.bytes();
        let (mut at, end) = (first, first + out.len() / eb);
        let mut run = self.starts.partition_point(|&s| s <= first).saturating_sub(1);
        let mut written = 0;
        while at < end {
            let (r, start) = (&self.runs[run], self.starts[run]);
            let take = (start + r.len()).min(end) - at;
            let from = at - start;
            convert(r, from, take, &mut out[written * eb..(written + take) * eb], prec);
            written += take;
            at += take;
            run += 1;
        }
    }
}

fn convert(run: &Run<'_>, from: usize, n: usize, out: &mut [u8], prec: Precision) {
    let bf16_of = |x: f32| half::bf16::from_f32(x).to_bits().to_le_bytes();
    match (run, prec) {
        (Run::Zeros(_), _) => out.fill(0),
        (Run::Stored { dtype: DType::BF16, bytes }, Precision::Bf16)
        | (Run::Stored { dtype: DType::F32, bytes }, Precision::F32) => {
            let es = prec.bytes();
            out.copy_from_slice(&bytes[from * es..(from + n) * es]);
        }
        (Run::Stored { dtype, bytes }, _) => {
            let es = dtype.block_bytes();
            let src = &bytes[from * es..(from + n) * es];
            for (o, x) in out.chunks_exact_mut(prec.bytes()).zip(src.chunks_exact(es)) {
                let v = match dtype {
                    DType::F16 => half::f16::from_le_bytes([x[0], x[1]]).to_f32(),
                    DType::BF16 => half::bf16::from_le_bytes([x[0], x[1]]).to_f32(),
                    _ => f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
                };
                match prec {
                    Precision::Bf16 => o.copy_from_slice(&bf16_of(v)),
                    Precision::F32 => o.copy_from_slice(&v.to_le_bytes()),
                }
            }
        }
        (Run::Decoded(v), _) => {
            for (o, &x) in out.chunks_exact_mut(prec.bytes()).zip(&v[from..from + n]) {
                match prec {
                    Precision::Bf16 => o.copy_from_slice(&bf16_of(x)),
                    Precision::F32 => o.copy_from_slice(&x.to_le_bytes()),
                }
            }
        }
    }
}

/// Bytes of one staging buffer; four make the ring. Large enough that a copy's launch cost is
/// noise, small enough that the first copy starts early.
const SLOT_BYTES: usize = 64 << 20;
const SLOTS: usize = 4;
/// Piece of a staging buffer one core fills at a time.
const PIECE_BYTES: usize = 1 << 20;

struct Slot {
    host: PinnedHostSlice<u8>,
    stream: Arc<CudaStream>,
    /// Recorded after this slot's last copy: the buffer may be refilled once it completes.
    copied: CudaEvent,
}

/// The pinned ring and its streams, plus load progress. Call [`finish`](Self::finish) before
/// anything reads the uploaded weights on another stream.
pub struct StagingUploader {
    ctx: Arc<CudaContext>,
    slots: Vec<Slot>,
    next: usize,
    started: Instant,
    bytes: u64,
    reported_gib: u64,
    bar: indicatif::ProgressBar,
}

impl StagingUploader {
    /// `expected` bytes (for the progress bar; the load still works if it is off).
    pub fn new(gpu: &Gpu, expected: u64) -> Result<Self, BackendError> {
        let ctx = gpu.ctx.clone();
        let mut slots = Vec::with_capacity(SLOTS);
        for _ in 0..SLOTS {
            // SAFETY: the buffer is written before it is read (every copy sends only the filled
            // prefix) and it is freed by `PinnedHostSlice::drop` after its event completes.
            let host = unsafe { ctx.alloc_pinned_with_flags::<u8>(SLOT_BYTES, CU_MEMHOSTALLOC_WRITECOMBINED) }
                .map_err(|e| dev_err("allocating pinned staging memory", e))?;
            let stream = ctx.new_stream().map_err(|e| dev_err("creating an upload stream", e))?;
            let copied = ctx.new_event(None).map_err(|e| dev_err("creating an upload event", e))?;
            slots.push(Slot { host, stream, copied });
        }
        Ok(StagingUploader {
            ctx,
            slots,
            next: 0,
            started: Instant::now(),
            bytes: 0,
            reported_gib: 0,
            bar: load_bar(expected),
        })
    }

    /// Allocate a `[.. , cols]` matrix of `runs` in `prec` on the device and start filling it.
    pub fn matrix(&mut self, gpu: &Gpu, runs: &MatrixRuns<'_>, prec: Precision) -> Result<DevBuf, BackendError> {
        let eb = prec.bytes();
        let buf = gpu.alloc(runs.elems() * eb)?;
        let per_slot = SLOT_BYTES / eb;
        let mut first = 0;
        while first < runs.elems() {
            let n = per_slot.min(runs.elems() - first);
            let slot = &mut self.slots[self.next];
            self.next = (self.next + 1) % SLOTS;
            slot.copied.synchronize().map_err(|e| dev_err("waiting for a staging buffer", e))?;
            // SAFETY: the event above says the last copy out of this buffer is done; nothing else
            // holds a pointer into it.
            let host = unsafe { std::slice::from_raw_parts_mut(slot_ptr(&mut slot.host)?, n * eb) };
            host.par_chunks_mut(PIECE_BYTES).enumerate().for_each(|(i, piece)| {
                runs.fill(first + i * (PIECE_BYTES / eb), piece, prec);
            });
            self.ctx.bind_to_thread().map_err(|e| dev_err("binding the context", e))?;
            // SAFETY: `buf` holds `elems · eb` bytes and this copy writes `n · eb` of them at
            // `first · eb`; the pinned source stays untouched until `copied` completes.
            unsafe { drv::memcpy_htod_async(buf.ptr() + (first * eb) as u64, &*host, slot.stream.cu_stream()) }
                .map_err(|e| dev_err("host→device weight copy", e))?;
            slot.copied.record(&slot.stream).map_err(|e| dev_err("recording an upload event", e))?;
            first += n;
            self.advance((n * eb) as u64);
        }
        Ok(buf)
    }

    fn advance(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.bar.inc(bytes);
        let gib = self.bytes >> 30;
        // Logs get a line per 4 GiB, for hosts where the bar is not drawn (no terminal).
        if gib >= self.reported_gib + 4 {
            self.reported_gib = gib;
            tracing::info!(gib, gb_per_s = format!("{:.2}", self.rate()), "loading weights");
        }
    }

    fn rate(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.started.elapsed().as_secs_f64().max(1e-9)
    }

    /// Wait for every copy; report the load rate.
    pub fn finish(self) -> Result<(), BackendError> {
        for s in &self.slots {
            s.stream.synchronize().map_err(|e| dev_err("finishing the weight upload", e))?;
        }
        self.bar.finish_and_clear();
        tracing::info!(
            gb = format!("{:.2}", self.bytes as f64 / 1e9),
            seconds = format!("{:.2}", self.started.elapsed().as_secs_f64()),
            gb_per_s = format!("{:.2}", self.rate()),
            "weights on the device"
        );
        Ok(())
    }
}

fn slot_ptr(host: &mut PinnedHostSlice<u8>) -> Result<*mut u8, BackendError> {
    host.as_mut_ptr().map_err(|e| dev_err("staging buffer", e))
}

fn load_bar(expected: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(expected);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "loading weights [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
        // SAFETY: plain-old-data slices viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
    }

    /// What the previous loader did: decode, cut, round to storage.
    fn reference(parts: &[(TensorView<'_>, Cut)], prec: Precision) -> Vec<u8> {
        let mut out = Vec::new();
        for (v, cut) in parts {
            for x in cut.apply(&to_f32(v), *v.shape.last().unwrap()) {
                match prec {
                    Precision::Bf16 => out.extend(half::bf16::from_f32(x).to_bits().to_le_bytes()),
                    Precision::F32 => out.extend(x.to_le_bytes()),
                }
            }
        }
        out
    }

    fn filled(runs: &MatrixRuns<'_>, prec: Precision, piece_elems: usize) -> Vec<u8> {
        let eb = prec.bytes();
        let mut out = vec![0xAAu8; runs.elems() * eb];
        for (i, piece) in out.chunks_mut(piece_elems * eb).enumerate() {
            runs.fill(i * piece_elems, piece, prec);
        }
        out
    }

    #[test]
    fn every_cut_and_source_type_fills_what_the_host_path_computed() {
        let (rows, cols) = (6usize, 10usize);
        let vals: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin() * 3.0 + 1e-3 * i as f32).collect();
        let f32s = vals.clone();
        let bf16s: Vec<u16> = vals.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        let f16s: Vec<u16> = vals.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
        let shape = [rows, cols];
        let views = [
            TensorView { dtype: DType::F32, shape: &shape, data: bytes_of(&f32s) },
            TensorView { dtype: DType::BF16, shape: &shape, data: bytes_of(&bf16s) },
            TensorView { dtype: DType::F16, shape: &shape, data: bytes_of(&f16s) },
        ];
        let cuts = [Cut::Rows(0..rows), Cut::Rows(2..5), Cut::Cols(3..8), Cut::PaddedRows { rows: 1..4, to: 7 }];
        for prec in [Precision::Bf16, Precision::F32] {
            for a in &views {
                for b in &views {
                    for (ca, cb) in cuts.iter().zip(cuts.iter().rev()) {
                        let parts = [(*a, ca.clone()), (*b, cb.clone())];
                        let runs = MatrixRuns::new(&parts);
                        let want = reference(&parts, prec);
                        assert_eq!(runs.elems() * prec.bytes(), want.len());
                        // Pieces that start and end inside runs, across run boundaries, and whole.
                        for piece in [1, 3, 7, 16, runs.elems()] {
                            assert_eq!(
                                filled(&runs, prec, piece),
                                want,
                                "{prec:?} {:?}/{:?} piece {piece}",
                                a.dtype,
                                b.dtype
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_sources_are_decoded_then_cut() {
        // One Q8_0 block row: scale 0.5, codes -16..16.
        let mut block = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let data = [block.clone(), block].concat();
        let shape = [2, 32];
        let view = TensorView { dtype: DType::Q8_0, shape: &shape, data: &data };
        let parts = [(view, Cut::Cols(4..20))];
        let runs = MatrixRuns::new(&parts);
        assert_eq!(filled(&runs, Precision::F32, 5), reference(&parts, Precision::F32));
        assert_eq!(runs.elems(), 32);
    }
}
