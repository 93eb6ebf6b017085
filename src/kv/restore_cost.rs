//! Whether a spilled prefix is worth reading back, or cheaper to recompute.
//!
//! A restore makes the admission wait for the pages' reads; recomputing them costs prefill steps.
//! Reading pays only when the spill tier is fast next to the device: on a GPU, prefill of a 6k
//! prefix can take half a second where reading its 800 MB image takes seconds. So the pool restores
//! only when the predicted read time beats the predicted recompute time:
//!
//! * read: `bytes / throughput`, the throughput a decayed average of the disk restores measured so
//!   far (each from queueing to the image being in memory, so a disk busy with writes counts), with
//!   the reads of one admission running `parallel_reads` wide; pages the spill tier still holds
//!   in host memory cost only their copy to the device, one after another
//!   (`HOST_COPY_BPS`);
//! * recompute: the step cost model's prefill cost (`sched::cost`) of those pages' tokens at their
//!   positions, refit as the engine runs (the scheduler hands the pool its latest coefficients).
//!
//! The read prior is optimistic, so the first restores happen and are measured; after that the
//! measurements decide. Plain data: no clocks, no I/O.

use crate::sched::StepCost;

/// Weight of history in the read-throughput average (about the last 8 restores matter).
const READ_DECAY: f64 = 0.875;

#[derive(Debug, Clone)]
pub struct RestoreCost {
    /// Bytes of one page image (KV blocks plus recurrent-state snapshot).
    page_image_bytes: usize,
    page_tokens: usize,
    /// Reads of one admission that run at once.
    parallel_reads: usize,
    /// Bytes per second one read achieves (decayed average, or the prior).
    read_bps: f64,
    reads_seen: u64,
    /// Prices recomputation.
    step: StepCost,
}

/// Why a restore was chosen or not, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestoreDecision {
    pub restore: bool,
    pub read_secs: f64,
    pub recompute_secs: f64,
}

impl RestoreCost {
    /// Prior read throughput of one read: a local NVMe drive or the page cache. Optimistic on
    /// purpose (see the module doc).
    pub const PRIOR_READ_BPS: f64 = 2e9;
    /// A page image in host memory copied into the device's blocks: pageable memory over PCIe,
    /// conservatively (pinned gen5 reaches 25 GB/s and more).
    pub const HOST_COPY_BPS: f64 = 8e9;

    pub fn new(page_image_bytes: usize, page_tokens: usize, parallel_reads: usize, step: StepCost) -> Self {
        RestoreCost {
            page_image_bytes,
            page_tokens,
            parallel_reads: parallel_reads.max(1),
            read_bps: Self::PRIOR_READ_BPS,
            reads_seen: 0,
            step,
        }
    }

    /// A restore read `bytes` in `secs` (from queueing to the image in memory).
    pub fn observe_read(&mut self, bytes: usize, secs: f64) {
        if bytes == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let bps = bytes as f64 / secs;
        self.read_bps = if self.reads_seen == 0 { bps } else { READ_DECAY * self.read_bps + (1.0 - READ_DECAY) * bps };
        self.reads_seen += 1;
    }

    /// The step cost model's latest coefficients.
    pub fn set_step_cost(&mut self, step: StepCost) {
        self.step = step;
    }

    pub fn read_bps(&self) -> f64 {
        self.read_bps
    }

    pub fn reads_seen(&self) -> u64 {
        self.reads_seen
    }

    /// Seconds to read `pages` pages, `parallel_reads` at a time.
    pub fn read_secs(&self, pages: usize) -> f64 {
        let rounds = pages.div_ceil(self.parallel_reads);
        rounds as f64 * self.page_image_bytes as f64 / self.read_bps
    }

    /// Seconds of prefill to recompute the pages with these indices (page `i` covers tokens
    /// `i·page_tokens..(i + 1)·page_tokens`).
    pub fn recompute_secs(&self, page_indices: &[usize]) -> f64 {
        page_indices.iter().map(|&i| self.step.prefill_secs(i * self.page_tokens, self.page_tokens)).sum()
    }

    /// Restore the spilled pages with these indices (`host_pages` of them in host memory, the
    /// rest on disk), or recompute them?
    pub fn decide(&self, page_indices: &[usize], host_pages: usize) -> RestoreDecision {
        let host_pages = host_pages.min(page_indices.len());
        let read_secs = self.read_secs(page_indices.len() - host_pages)
            + host_pages as f64 * self.page_image_bytes as f64 / Self::HOST_COPY_BPS;
        let recompute_secs = self.recompute_secs(page_indices);
        RestoreDecision { restore: !page_indices.is_empty() && read_secs < recompute_secs, read_secs, recompute_secs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 256-token pages of 4 MiB on a device that prefills at 10k tokens/s.
    fn model() -> RestoreCost {
        let step = StepCost { fixed: 0.01, per_prefill_token: 1e-4, per_decode_seq: 0.0, per_million_attended: 0.0 };
        RestoreCost::new(4 << 20, 256, 4, step)
    }

    #[test]
    fn restores_while_the_prior_is_optimistic_then_follows_the_measured_reads() {
        let mut c = model();
        // 8 pages: 2048 tokens = 0.2 s of prefill; 2 rounds of 4 MiB at 2 GB/s = 4 ms.
        let pages: Vec<usize> = (0..8).collect();
        assert!(c.decide(&pages, 0).restore);
        // The disk turns out to read 20 MB/s: 2 rounds of 4 MiB ≈ 0.42 s > 0.2 s.
        for _ in 0..20 {
            c.observe_read(4 << 20, (4 << 20) as f64 / 20e6);
        }
        assert!((c.read_bps() - 20e6).abs() / 20e6 < 0.05, "{}", c.read_bps());
        let d = c.decide(&pages, 0);
        assert!(!d.restore, "{d:?}");
        assert!(d.read_secs > d.recompute_secs);
    }

    #[test]
    fn a_slower_device_makes_the_same_disk_worth_reading() {
        let mut c = model();
        for _ in 0..20 {
            c.observe_read(4 << 20, (4 << 20) as f64 / 20e6);
        }
        let pages = [0, 1, 2, 3];
        assert!(!c.decide(&pages, 0).restore);
        // The refit step cost says prefill is 10× slower than assumed: now the read pays.
        c.set_step_cost(StepCost {
            fixed: 0.01,
            per_prefill_token: 1e-3,
            per_decode_seq: 0.0,
            per_million_attended: 0.0,
        });
        assert!(c.decide(&pages, 0).restore);
    }

    #[test]
    fn later_pages_cost_more_to_recompute_through_attention() {
        let step = StepCost { fixed: 0.0, per_prefill_token: 0.0, per_decode_seq: 0.0, per_million_attended: 1.0 };
        let c = RestoreCost::new(1 << 20, 256, 1, step);
        assert!(c.recompute_secs(&[20]) > 10.0 * c.recompute_secs(&[0]));
        assert!(!c.decide(&[], 0).restore, "nothing to restore");
    }

    #[test]
    fn bad_measurements_are_ignored() {
        let mut c = model();
        c.observe_read(0, 1.0);
        c.observe_read(100, 0.0);
        c.observe_read(100, f64::NAN);
        assert_eq!((c.reads_seen(), c.read_bps()), (0, RestoreCost::PRIOR_READ_BPS));
    }
}
