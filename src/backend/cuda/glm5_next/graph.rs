//! Decode steps replayed from captured CUDA graphs. A batch-1 glm5_next step is a few hundred
//! small launches; queued one by one the device idles between them, and a graph launches them
//! all at once. A step may be replayed when every launch of it depends only on values in device
//! memory that are uploaded before the launch (token ids, positions, block tables, pools to
//! compress, logits rows) and on the shapes in `GraphKey`: decode rows only (no verification, no
//! snapshots, no embeddings), MoE grouped on the device (no routes read back), not profiling.
//! Such steps round the two sizes that grow with the context (`max_pools`, `max_sel`) up to
//! values that stay fixed for long runs and always pass one pool record per sequence (unused ones
//! marked), so one graph serves thousands of steps; the kernels only ever read a row's own count,
//! so the results are bitwise those of launches one by one (`tests/gpu_validate_glm5.rs`).
//!
//! A shape is captured the second time it is seen (the first run sizes the scratch buffers, whose
//! growth would end a capture), and every graph is dropped when a scratch buffer moves. A capture
//! the driver refuses turns graphs off for the backend with a warning; the step then runs as plain
//! launches. `SHELFSERVE_CUDA_GRAPHS=0` turns them off, as for llama.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::weights::Ffn;
use super::Glm5CudaBackend;
use crate::backend::cuda::gpu::dev_err;
use crate::backend::glm5_steps::SeqRows;
use crate::backend::{BackendError, EmbeddedRows};

/// Graphs kept at once; when full, all are dropped (keys change as contexts grow past a rounding
/// step, so old ones are rarely needed again).
const MAX_GRAPHS: usize = 32;
/// Keys remembered as seen once before they are forgotten.
const MAX_SEEN: usize = 256;

/// Everything a captured step's launches depend on besides values in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub rows: usize,
    pub max_pools: usize,
    pub max_sel: usize,
    /// `Scratch::generation` when the step's buffers were taken.
    pub generation: u64,
}

/// What to do with a step whose key is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GraphAction {
    Replay,
    Capture,
    Launch,
}

/// Captured decode steps by key, and the keys seen once.
pub(super) struct GraphCache {
    enabled: bool,
    graphs: HashMap<GraphKey, Captured>,
    seen: HashSet<GraphKey>,
    generation: u64,
    replays: u64,
}

/// An instantiated graph and where it leaves the step's logits.
pub(super) struct Captured {
    graph: cudarc::driver::CudaGraph,
    logits: u64,
}

// SAFETY: an executable graph is a plain driver handle, valid from any thread once the context
// is current; the backend binds its context before every use and is used by one thread at a
// time (`&mut self`).
unsafe impl Send for Captured {}

impl GraphCache {
    pub(super) fn from_env() -> Self {
        Self::new(std::env::var("SHELFSERVE_CUDA_GRAPHS").map_or(true, |v| v != "0"))
    }

    pub(super) fn new(enabled: bool) -> Self {
        GraphCache { enabled, graphs: HashMap::new(), seen: HashSet::new(), generation: 0, replays: 0 }
    }

    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    pub(super) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.forget();
        }
    }

    /// Drop every graph and sighting: a setting that changes a step's launches changed.
    pub(super) fn forget(&mut self) {
        self.graphs.clear();
        self.seen.clear();
    }

    /// Steps replayed from a graph so far.
    pub(super) fn replays(&self) -> u64 {
        self.replays
    }

    /// Replay a known shape, capture one seen before, else launch plainly (and remember it).
    pub(super) fn action(&mut self, key: &GraphKey) -> GraphAction {
        if key.generation != self.generation {
            // Buffers moved: every graph points at freed memory.
            self.forget();
            self.generation = key.generation;
        }
        if self.graphs.contains_key(key) {
            GraphAction::Replay
        } else if self.seen.contains(key) {
            GraphAction::Capture
        } else {
            if self.seen.len() >= MAX_SEEN {
                self.seen.clear();
            }
            self.seen.insert(*key);
            GraphAction::Launch
        }
    }

    /// Replay the graph of `key`; returns the address of its logits.
    pub(super) fn launch(&mut self, key: &GraphKey) -> Result<u64, BackendError> {
        let g = self.graphs.get(key).ok_or_else(|| BackendError::Device("no graph for this step's shape".into()))?;
        g.graph.launch().map_err(|e| dev_err("graph launch", e))?;
        self.replays += 1;
        Ok(g.logits)
    }

    fn insert(&mut self, key: GraphKey, graph: cudarc::driver::CudaGraph, logits: u64) {
        if self.graphs.len() >= MAX_GRAPHS {
            self.graphs.clear();
        }
        self.seen.remove(&key);
        self.graphs.insert(key, Captured { graph, logits });
    }
}

impl Glm5CudaBackend {
    /// Whether this step may be replayed from a graph (module doc).
    pub(super) fn graphable(&self, seqs: &[SeqRows<'_>], embeds: &[Vec<EmbeddedRows<'_>>]) -> bool {
        let n = seqs.len();
        self.graphs.enabled()
            && self.profile.is_none()
            && n > 0
            && embeds.iter().all(Vec::is_empty)
            && seqs.iter().all(|s| s.n == 1 && !s.checkpoint && self.marks[s.slot].is_empty())
            && self.weights.layers.iter().all(|l| match &l.ffn {
                Ffn::Moe(w) => self.moe_on_device(w, n),
                Ffn::Dense(_) => true,
            })
    }

    /// Capture the launches `run` queues as the graph of `key` and launch it; if the driver
    /// refuses the capture, turn graphs off and run the launches plainly.
    pub(super) fn capture_step(
        &mut self,
        key: GraphKey,
        run: impl Fn(&mut Self) -> Result<(u64, Instant), BackendError>,
    ) -> Result<(u64, Instant), BackendError> {
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.gpu.stream.begin_capture(mode).map_err(|e| dev_err("begin graph capture", e))?;
        let queued = run(self);
        let captured = self.gpu.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        match (queued, captured) {
            (Ok((logits, lap)), Ok(Some(graph))) if self.scratch.generation == key.generation => {
                graph.launch().map_err(|e| dev_err("graph launch", e))?;
                self.graphs.insert(key, graph, logits);
                Ok((logits, lap))
            }
            (queued, captured) => {
                tracing::warn!(
                    launches = ?queued.err(),
                    capture = ?captured.err(),
                    "glm5_next: a decode step could not be captured as a CUDA graph; graphs are off for this backend"
                );
                self.graphs.set_enabled(false);
                run(self)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(rows: usize, generation: u64) -> GraphKey {
        GraphKey { rows, max_pools: 128, max_sel: 2064, generation }
    }

    #[test]
    fn a_shape_is_launched_then_captured_and_a_moved_buffer_forgets_it() {
        let mut c = GraphCache::new(true);
        assert_eq!(c.action(&key(1, 0)), GraphAction::Launch);
        assert_eq!(c.action(&key(2, 0)), GraphAction::Launch);
        assert_eq!(c.action(&key(1, 0)), GraphAction::Capture);
        // The sizing run of a new generation launches plainly again.
        assert_eq!(c.action(&key(1, 1)), GraphAction::Launch);
        assert_eq!(c.action(&key(2, 1)), GraphAction::Launch, "generation 0's sightings are gone");
        assert_eq!(c.action(&key(2, 1)), GraphAction::Capture);
    }

    #[test]
    fn turning_graphs_off_forgets_what_was_seen() {
        let mut c = GraphCache::new(true);
        c.action(&key(1, 0));
        c.set_enabled(false);
        c.set_enabled(true);
        assert_eq!(c.action(&key(1, 0)), GraphAction::Launch);
        assert!(c.launch(&key(1, 0)).is_err(), "nothing captured");
    }
}
