//! The disk tier of the KV pool. `SpillStore` (plain data + file I/O) keeps evicted pages in a
//! spill directory under a byte budget, CRC-32 per 8 MiB chunk, with an index that survives a
//! restart. `SpillActor` owns the store and runs its I/O on the blocking pool, never on the async
//! runtime's workers. It does not decide what to evict (the `KvPoolActor` does) nor touch device
//! memory (the executor reads and writes page images on its own thread, in order with steps).

pub mod store;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};

pub use store::{LoadError, SpillError, SpillStore, SpilledPage, CHUNK_BYTES};

use crate::actors::executor::ExecutorMsg;
use crate::actors::kvpool::KvPoolMsg;
use crate::kv::PageHash;

pub enum SpillMsg {
    /// The pool actor, once spawned (the two actors refer to each other).
    AttachPool(ActorRef<KvPoolMsg>),
    /// An evicted page's image (from the executor thread): write it.
    Store { hash: PageHash, parent: Option<PageHash>, image: Vec<u8> },
    /// Read a page back (from the pool actor) and have the executor write it into `blocks`.
    Load { hash: PageHash, blocks: Vec<u32> },
}

pub struct SpillArgs {
    /// `None`: spill is off (budget 0 or the directory could not be opened).
    pub store: Option<SpillStore>,
    pub executor: ActorRef<ExecutorMsg>,
    /// Exact size of a page image: `page_blocks * kv_block_bytes + snapshot_bytes`.
    pub page_image_bytes: usize,
    /// Trailing bytes of a page image that are its recurrent-state snapshot (0 for
    /// attention-only models); they go back to the pool, the rest to the executor's blocks.
    pub snapshot_bytes: usize,
}

pub struct SpillState {
    store: Option<SpillStore>,
    pool: Option<ActorRef<KvPoolMsg>>,
    executor: ActorRef<ExecutorMsg>,
    page_image_bytes: usize,
    snapshot_bytes: usize,
}

pub struct SpillActor;

/// Opens the spill store for a model, or explains why spill is off (logged, never fatal).
pub fn open_store(dir: Option<&PathBuf>, budget: u64, fingerprint: &str) -> Option<SpillStore> {
    let dir = dir?;
    if budget == 0 {
        return None;
    }
    match SpillStore::open(dir, fingerprint, budget) {
        Ok(s) => {
            tracing::info!(dir = %s.dir().display(), budget, pages = s.len(), "KV spill tier on");
            Some(s)
        }
        Err(e) => {
            tracing::warn!(error = %e, "KV spill tier off: the spill directory is unusable; serving continues");
            None
        }
    }
}

impl SpillState {
    fn turn_off(&mut self, why: &SpillError) {
        tracing::warn!(error = %why, "KV spill tier turned off (disk full or unwritable); serving continues");
        metrics::counter!("shelfserve_spill_disabled_total").increment(1);
        self.store = None;
        if let Some(pool) = &self.pool {
            let _ = pool.cast(KvPoolMsg::SpillOff);
        }
    }
}

impl Actor for SpillActor {
    type Msg = SpillMsg;
    type State = SpillState;
    type Arguments = SpillArgs;

    async fn pre_start(&self, _myself: ActorRef<SpillMsg>, a: SpillArgs) -> Result<SpillState, ActorProcessingErr> {
        Ok(SpillState {
            store: a.store,
            pool: None,
            executor: a.executor,
            page_image_bytes: a.page_image_bytes,
            snapshot_bytes: a.snapshot_bytes,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SpillMsg>,
        msg: SpillMsg,
        st: &mut SpillState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SpillMsg::AttachPool(pool) => st.pool = Some(pool),
            SpillMsg::Store { hash, parent, image } => {
                let Some(mut store) = st.store.take() else { return Ok(()) };
                let len = image.len() as u64;
                let (store, result) = tokio::task::spawn_blocking(move || {
                    let r = store.store(hash, parent, &image);
                    (store, r)
                })
                .await?;
                st.store = Some(store);
                match result {
                    Ok((stored, dropped)) => {
                        if let Some(pool) = &st.pool {
                            for d in dropped {
                                let _ = pool.cast(KvPoolMsg::SpillDropped(d));
                            }
                            if stored {
                                metrics::counter!("shelfserve_spill_bytes_written_total").increment(len);
                                let _ = pool.cast(KvPoolMsg::Spilled { hash, parent });
                            }
                        }
                    }
                    Err(e) => st.turn_off(&e),
                }
            }
            SpillMsg::Load { hash, blocks } => {
                let started = Instant::now();
                let loaded = match st.store.take() {
                    Some(mut store) => {
                        let (store, r) = tokio::task::spawn_blocking(move || {
                            let r = store.load(&hash);
                            (store, r)
                        })
                        .await?;
                        st.store = Some(store);
                        r
                    }
                    None => Err(LoadError::NotSpilled(hash.to_hex())),
                };
                let mut snapshot = None;
                let ok = match loaded {
                    Ok(mut image) if image.len() == st.page_image_bytes => {
                        metrics::counter!("shelfserve_spill_bytes_read_total").increment(image.len() as u64);
                        // The page's recurrent state (hybrid models) goes back to the pool with it.
                        if st.snapshot_bytes > 0 {
                            let state = image.split_off(image.len() - st.snapshot_bytes);
                            snapshot = Some(Arc::from(state));
                        }
                        // Queued before the pool hears of it, so it runs before any step reads it.
                        st.executor.cast(ExecutorMsg::WritePage { hash, blocks, image })?;
                        metrics::histogram!("shelfserve_spill_restore_seconds").record(started.elapsed().as_secs_f64());
                        true
                    }
                    Ok(image) => {
                        tracing::warn!(page = %hash.to_hex(), bytes = image.len(), want = st.page_image_bytes,
                            "a spilled page has the wrong size for this pool; recomputing");
                        false
                    }
                    Err(e) => {
                        if matches!(e, LoadError::Crc { .. }) {
                            metrics::counter!("shelfserve_spill_crc_failures_total").increment(1);
                        }
                        tracing::warn!(error = %e, kind = e.kind(), "a spilled page cannot be served; recomputing");
                        false
                    }
                };
                if let Some(pool) = &st.pool {
                    let _ = pool.cast(KvPoolMsg::Restored { hash, ok, snapshot });
                }
            }
        }
        Ok(())
    }
}
