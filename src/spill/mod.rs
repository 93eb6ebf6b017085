//! The disk tier of the KV pool, as a page store that knows no actor messages (the `SpillActor`
//! in `actors/spill.rs` drives it). It owns the spill directory: self-describing page files
//! (`format`: header, CRC-32 per 8 MiB chunk, keyed MAC), the rules that keep the directory from
//! being aimed (`secure`: ownership and mode, no links followed, no FIFOs opened, a 0600 secret),
//! the byte budget and the index, a checksummed cache of the pages' headers rebuilt from the
//! files when damaged (`store`), and the I/O threads that run all of it off the async runtime
//! with read deadlines, reads several at a time (`io`). It does not decide what to evict (the pool does) nor touch device
//! memory (the executor reads and writes page images).

pub mod format;
pub mod host;
pub mod io;
pub mod secure;
pub mod store;

use std::path::PathBuf;

pub use format::CHUNK_BYTES;
pub use io::{IoEvent, SpillIo, PARALLEL_READS};
pub use store::{LoadError, OpenReport, SpillError, SpillStore, SpilledPage};

/// Opens the spill store for a model and KV layout, or explains why spill is off (logged, never
/// fatal). Publishes what the opening found: `shelfserve_spill_index_rebuilds_total` and
/// `shelfserve_spill_files_discarded_total{reason}`.
pub fn open_store(dir: Option<&PathBuf>, budget: u64, fingerprint: &str, kv_layout: &str) -> Option<SpillStore> {
    let dir = dir?;
    if budget == 0 {
        return None;
    }
    match SpillStore::open(dir, fingerprint, kv_layout, budget) {
        Ok(s) => {
            let r = s.open_report();
            if let Some(why) = &r.rebuilt {
                tracing::warn!(why = %why, kept = r.kept, damaged = r.damaged, "KV spill index rebuilt from the page files");
                metrics::counter!("shelfserve_spill_index_rebuilds_total").increment(1);
            }
            for (reason, n) in r.discarded() {
                if n > 0 {
                    tracing::warn!(reason, files = n, "KV spill: discarded files found at startup");
                    metrics::counter!("shelfserve_spill_files_discarded_total", "reason" => reason).increment(n as u64);
                }
            }
            tracing::info!(dir = %s.dir().display(), budget, pages = s.len(), "KV spill tier on");
            Some(s)
        }
        Err(e) => {
            tracing::error!(error = %e, "KV spill tier off: the spill directory is unusable; serving continues");
            None
        }
    }
}
