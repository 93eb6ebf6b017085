//! `SpillActor`: drives the spill tier (`spill::SpillIo`, a thread that owns the page store).
//! Evicted page images from the executor are queued for writing; the outcomes come back in order
//! and tell the pool which pages are on disk. A restore is read on the I/O thread under a
//! deadline (a miss when it runs out), then its KV part goes to the executor and the pool hears
//! `Restored`. Evicted images are also kept in host memory up to a budget (`spill::host`), so a
//! page evicted recently is restored by a copy to the device, without a read. It decides nothing
//! about eviction (the pool does) and never blocks on the disk.
//!
//! When the tensor-parallel group's ranks are executors of their own (`actors::rank_pages`), each
//! holds only its slice of a page: the pool announces each batch of pages (`Expect`), every rank
//! reports its slices (`Slices`, through the scheduler: from other processes too), and the joined
//! image is stored as one page; a restore is split back and each rank is sent its slice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use bytes::Bytes;

use super::executor::ExecutorMsg;
use super::kvpool::KvPoolMsg;
use super::rank_pages::{ExpectedPage, JoinEvent, PageParts, SliceJoin, SliceReport};
use crate::kv::PageHash;
use crate::spill::host::HostTier;
use crate::spill::{IoEvent, LoadError, SpillIo, SpillStore};

/// How long a restore may take before it counts as a miss (the page is recomputed instead).
pub const DEFAULT_READ_DEADLINE: Duration = Duration::from_secs(5);

#[derive(ractor_cluster::RactorMessage)]
pub enum SpillMsg {
    /// The pool actor, once spawned (the two actors refer to each other).
    AttachPool(ActorRef<KvPoolMsg>),
    /// An evicted page's image (from the executor thread): write it.
    Store { hash: PageHash, parent: Option<PageHash>, image: Vec<u8> },
    /// Read a page back (from the pool actor) and have the executor write it into `blocks`.
    Load { hash: PageHash, blocks: Vec<u32> },
    /// Answers once every page queued before it is on disk and synced (`false`: spill is off or
    /// the sync failed). For the drained shutdown.
    Sync(RpcReplyPort<bool>),
    /// A read ended (from the task that awaited it).
    LoadDone { hash: PageHash, blocks: Vec<u32>, started: Instant, result: Result<Bytes, LoadError> },
    /// A write's outcome (from the I/O thread, in order).
    Io(IoEvent),
    /// Ranks in executors of their own: every rank was asked (`ExecutorMsg::ReadSlices`, sent
    /// just after this) for its slices of `pages` as batch `batch`; join them. With `sync` (a
    /// drained shutdown's flush): answer once this batch and every earlier one ended and what they
    /// joined is on disk and synced.
    Expect { batch: u64, pages: Vec<ExpectedPage>, sync: Option<RpcReplyPort<bool>> },
    /// A rank's slice of a page of a batch, or the end of its batch (forwarded by the scheduler).
    Slices(SliceReport),
    /// A rank failed (from the scheduler): the slices it owes never come; their pages are dropped.
    RankFailed(usize),
}

pub struct SpillArgs {
    /// `None`: spill is off (budget 0 or the directory could not be opened).
    pub store: Option<SpillStore>,
    /// Every rank's executor, rank 0 first (one: it reads and writes whole pages).
    pub executors: Vec<ActorRef<ExecutorMsg>>,
    /// Each rank's slice of a KV block (a page image is the ranks' slices in rank order).
    pub page_parts: PageParts,
    /// Exact size of a page image: `page_blocks * kv_block_bytes + snapshot_bytes`.
    pub page_image_bytes: usize,
    /// Trailing bytes of a page image that are its recurrent-state snapshot (0 for
    /// attention-only models); they go back to the pool, the rest to the executor's blocks.
    pub snapshot_bytes: usize,
    pub read_deadline: Duration,
    /// Bytes of evicted page images kept in host memory (0: every restore reads the disk).
    pub host_budget: u64,
}

pub struct SpillState {
    io: Option<Arc<SpillIo>>,
    pool: Option<ActorRef<KvPoolMsg>>,
    executors: Vec<ActorRef<ExecutorMsg>>,
    page_parts: PageParts,
    /// The ranks' slices of pages being spilled, until whole (ranks in executors of their own).
    join: SliceJoin<RpcReplyPort<bool>>,
    page_image_bytes: usize,
    snapshot_bytes: usize,
    read_deadline: Duration,
    host: HostTier,
}

pub struct SpillActor;

impl SpillState {
    fn turn_off(&mut self, why: &dyn std::fmt::Display) {
        tracing::warn!(error = %why, "KV spill tier turned off (disk full or unwritable); serving continues");
        metrics::counter!("shelfserve_spill_disabled_total").increment(1);
        self.io = None;
        if let Some(pool) = &self.pool {
            let _ = pool.cast(KvPoolMsg::SpillOff);
        }
    }

    fn on_io(&mut self, event: IoEvent) {
        match event {
            IoEvent::Stored { hash, parent, bytes, dropped } => {
                metrics::counter!("shelfserve_spill_bytes_written_total").increment(bytes);
                if let Some(pool) = &self.pool {
                    for d in dropped {
                        let _ = pool.cast(KvPoolMsg::SpillDropped(d));
                    }
                    let _ = pool.cast(KvPoolMsg::Spilled { hash, parent });
                }
            }
            IoEvent::TooLarge { hash } => {
                tracing::debug!(page = %hash.to_hex(), "a page is larger than the whole spill budget; not spilled")
            }
            IoEvent::Failed(e) => self.turn_off(&e),
        }
    }

    /// Keeps an evicted image in host memory (telling the pool) and queues its disk write.
    fn on_store(&mut self, hash: PageHash, parent: Option<PageHash>, image: Vec<u8>) {
        let Some(io) = &self.io else { return };
        let image = Bytes::from(image);
        if self.host.is_on() {
            let (kept, dropped) = self.host.insert(hash, image.clone());
            if let Some(pool) = &self.pool {
                for d in dropped {
                    let _ = pool.cast(KvPoolMsg::HostDropped(d));
                }
                if kept {
                    let _ = pool.cast(KvPoolMsg::InHost { hash, parent });
                }
            }
            metrics::gauge!("shelfserve_spill_host_bytes").set(self.host.used_bytes() as f64);
        }
        io.store(hash, parent, image);
    }

    /// What joining the ranks' slices led to: whole pages are stored, dropped ones counted, and a
    /// flush whose pages are all in is synced.
    fn on_join(&mut self, events: Vec<JoinEvent<RpcReplyPort<bool>>>) {
        for event in events {
            match event {
                JoinEvent::Joined(page) => self.on_store(page.hash, page.parent, page.image),
                JoinEvent::Dropped { hash, error } => {
                    metrics::counter!("shelfserve_spill_slices_dropped_total", "reason" => error.kind()).increment(1);
                    tracing::warn!(page = %hash.to_hex(), error = %error, "an evicted page was not spilled: a rank's slice of it is missing");
                }
                JoinEvent::Flushed(reply) => self.sync(reply),
            }
        }
    }

    /// Answers `reply` once every write queued so far is on disk and synced.
    fn sync(&self, reply: RpcReplyPort<bool>) {
        match &self.io {
            Some(io) => {
                let synced = io.sync();
                tokio::spawn(async move {
                    let ok = synced.await.map_err(|e| tracing::warn!(error = %e, "spill sync failed")).is_ok();
                    let _ = reply.send(ok);
                });
            }
            None => {
                let _ = reply.send(false);
            }
        }
    }

    /// Queues a restored page's KV part at the executors (each rank its slice when the ranks are
    /// executors of their own); false if it cannot be.
    fn write_page(&self, hash: PageHash, blocks: Vec<u32>, kv: Bytes) -> bool {
        if let [executor] = &self.executors[..] {
            return executor.cast(ExecutorMsg::WritePage { hash, blocks, image: kv }).is_ok();
        }
        let slices = match self.page_parts.split(&kv, blocks.len()) {
            Ok(slices) => slices,
            Err(e) => {
                tracing::warn!(page = %hash.to_hex(), error = %e, "a spilled page does not split between this group's ranks; recomputing");
                return false;
            }
        };
        // Every rank must get its slice: one that cannot be sent fails the restore (the pool then
        // frees the blocks; what the others wrote there is never read).
        self.executors
            .iter()
            .zip(slices)
            .map(|(executor, image)| executor.cast(ExecutorMsg::WritePage { hash, blocks: blocks.clone(), image }))
            .fold(true, |ok, sent| ok & sent.is_ok())
    }

    /// `from_disk`: the image was read from its file (the read time refits the pool's pricing).
    fn on_loaded(
        &mut self,
        hash: PageHash,
        blocks: Vec<u32>,
        started: Instant,
        loaded: Result<Bytes, LoadError>,
        from_disk: bool,
    ) {
        let mut snapshot = None;
        let ok = match loaded {
            Ok(mut image) if image.len() == self.page_image_bytes => {
                let source = if from_disk { "disk" } else { "host" };
                metrics::counter!("shelfserve_spill_bytes_read_total", "from" => source).increment(image.len() as u64);
                if let (Some(pool), true) = (&self.pool, from_disk) {
                    let secs = started.elapsed().as_secs_f64();
                    let _ = pool.cast(KvPoolMsg::ReadMeasured { bytes: image.len(), secs });
                }
                // The page's recurrent state (hybrid models) goes back to the pool with it.
                if self.snapshot_bytes > 0 {
                    let state = image.split_off(image.len() - self.snapshot_bytes);
                    snapshot = Some(Arc::from(&state[..]));
                }
                // Queued before the pool hears of it, so it runs before any step reads it.
                let queued = self.write_page(hash, blocks, image);
                metrics::histogram!("shelfserve_spill_restore_seconds").record(started.elapsed().as_secs_f64());
                queued
            }
            Ok(image) => {
                tracing::warn!(page = %hash.to_hex(), bytes = image.len(), want = self.page_image_bytes,
                    "a spilled page has the wrong size for this pool; recomputing");
                false
            }
            Err(e) => {
                if matches!(e, LoadError::Crc { .. }) {
                    metrics::counter!("shelfserve_spill_crc_failures_total").increment(1);
                }
                if matches!(e, LoadError::NotRegular { .. }) {
                    metrics::counter!("shelfserve_spill_files_discarded_total", "reason" => "not_regular").increment(1);
                }
                metrics::counter!("shelfserve_spill_load_failures_total", "kind" => e.kind()).increment(1);
                tracing::warn!(error = %e, kind = e.kind(), "a spilled page cannot be served; recomputing");
                false
            }
        };
        if let Some(pool) = &self.pool {
            let _ = pool.cast(KvPoolMsg::Restored { hash, ok, snapshot });
        }
    }
}

impl Actor for SpillActor {
    type Msg = SpillMsg;
    type State = SpillState;
    type Arguments = SpillArgs;

    async fn pre_start(&self, myself: ActorRef<SpillMsg>, a: SpillArgs) -> Result<SpillState, ActorProcessingErr> {
        let io = match a.store {
            Some(store) => {
                let me = myself.clone();
                match SpillIo::start(store, move |event| {
                    let _ = me.cast(SpillMsg::Io(event));
                }) {
                    Ok(io) => Some(Arc::new(io)),
                    Err(e) => {
                        tracing::warn!(error = %e, "KV spill tier off: its I/O thread did not start");
                        None
                    }
                }
            }
            None => None,
        };
        Ok(SpillState {
            io,
            pool: None,
            join: SliceJoin::new(a.page_parts.clone()),
            executors: a.executors,
            page_parts: a.page_parts,
            page_image_bytes: a.page_image_bytes,
            snapshot_bytes: a.snapshot_bytes,
            read_deadline: a.read_deadline,
            host: HostTier::new(a.host_budget),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SpillMsg>,
        msg: SpillMsg,
        st: &mut SpillState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SpillMsg::AttachPool(pool) => st.pool = Some(pool),
            SpillMsg::Store { hash, parent, image } => st.on_store(hash, parent, image),
            SpillMsg::Load { hash, blocks } => {
                let started = Instant::now();
                if let Some(image) = st.host.get(&hash) {
                    st.on_loaded(hash, blocks, started, Ok(image), false);
                    return Ok(());
                }
                match st.io.clone() {
                    Some(io) => {
                        let deadline = st.read_deadline;
                        // The actor keeps serving writes and other reads while this one waits.
                        tokio::spawn(async move {
                            let result = io.load(hash, deadline).await.map(Bytes::from);
                            let _ = myself.cast(SpillMsg::LoadDone { hash, blocks, started, result });
                        });
                    }
                    None => st.on_loaded(hash, blocks, started, Err(LoadError::NotSpilled(hash.to_hex())), true),
                }
            }
            SpillMsg::LoadDone { hash, blocks, started, result } => st.on_loaded(hash, blocks, started, result, true),
            SpillMsg::Io(event) => st.on_io(event),
            SpillMsg::Sync(reply) => st.sync(reply),
            SpillMsg::Expect { batch, pages, sync } => {
                let events = st.join.expect(batch, pages, sync);
                st.on_join(events);
            }
            SpillMsg::Slices(report) => {
                let events = st.join.report(report);
                st.on_join(events);
            }
            SpillMsg::RankFailed(rank) => {
                let events = st.join.rank_failed(rank);
                st.on_join(events);
            }
        }
        Ok(())
    }
}
