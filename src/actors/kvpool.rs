//! `KvPoolActor`: owns the `kv::KvPool` (free list, refcounts, block tables, prefix index, LRU,
//! recurrent-state slots). The scheduler commits each planned step's pool work in one `Commit`
//! and gets the block tables and the next view back in one `Committed` message: one round trip
//! per step. Prefix-cache metrics are published here, where the lookups happen. No policy: the
//! scheduler decides who runs; this actor only says which blocks back them.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::executor::ExecutorMsg;
use super::rank_pages::ExpectedPage;
use super::rank_state::StateParts;
use super::scheduler::SchedulerMsg;
use super::spill::SpillMsg;
use crate::kv::{
    apply_ops, view, EvictedPage, KvPool, MissReason, PageHash, PoolCounters, PoolOp, PoolReply, SlotSnapshot,
};

#[derive(ractor_cluster::RactorMessage)]
pub enum KvPoolMsg {
    /// Apply `ops` in order and answer the scheduler with `SchedulerMsg::PoolCommitted`.
    /// `for_step` is echoed: true when the ops end with a planned step's admissions and growth.
    Commit { ops: Vec<PoolOp>, for_step: bool },
    /// Counters and occupancy (tests, diagnostics).
    Stats(RpcReplyPort<PoolStats>),
    /// The spill tier wrote this page: later lookups may restore it.
    Spilled { hash: PageHash, parent: Option<PageHash> },
    /// The spill tier dropped this page (budget).
    SpillDropped(PageHash),
    /// The spill tier keeps this page's image in host memory (its disk write may still be
    /// queued): restorable at once.
    InHost { hash: PageHash, parent: Option<PageHash> },
    /// The spill tier dropped this page from host memory (its disk copy, if any, remains).
    HostDropped(PageHash),
    /// The spill tier turned off (disk full or unwritable): nothing on disk is restorable.
    SpillOff,
    /// A restore ended; on success the executor has the image queued before any later step, and
    /// `snapshot` is the page's recurrent state (hybrid models).
    Restored { hash: PageHash, ok: bool, snapshot: Option<Arc<[u8]>> },
    /// A restore read `bytes` from disk in `secs` (from the spill tier): refits the restore cost
    /// model.
    ReadMeasured { bytes: usize, secs: f64 },
    /// The step cost model's latest coefficients (from the scheduler): prices recomputation
    /// against restores.
    StepCost(crate::sched::StepCost),
    /// Recurrent state read at page boundaries in the last step (from the scheduler, before the
    /// commit whose `Advance` publishes those pages).
    Snapshots(Vec<SlotSnapshot>),
    /// Drained shutdown: write every cached page the spill tier lacks (the pages stay cached) and
    /// answer once they are synced (`false`: spill is off or the sync failed).
    FlushToSpill(RpcReplyPort<bool>),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub num_blocks: usize,
    pub free_blocks: usize,
    /// Blocks of cached pages nobody references.
    pub evictable_blocks: usize,
    pub referenced_blocks: usize,
    pub cached_pages: usize,
    pub sequences: usize,
    pub counters: PoolCounters,
    /// Pages the spill tier holds.
    pub spilled_pages: usize,
    /// Host bytes of the recurrent-state snapshots the pool holds (hybrid models).
    pub snapshot_bytes: usize,
}

pub struct KvPoolArgs {
    pub pool: KvPool,
    pub scheduler: ActorRef<SchedulerMsg>,
    pub executor: ActorRef<ExecutorMsg>,
    /// The executors of ranks 1.. when each rank has its own (`serve --head`): a prefix hit's
    /// state image is split between all of them (`state_parts`); empty in one executor.
    pub followers: Vec<ActorRef<ExecutorMsg>>,
    /// Each rank's slice of a state slot, rank 0 first.
    pub state_parts: StateParts,
    /// The spill tier, when on.
    pub spill: Option<ActorRef<SpillMsg>>,
}

pub struct KvPoolState {
    pool: KvPool,
    scheduler: ActorRef<SchedulerMsg>,
    executor: ActorRef<ExecutorMsg>,
    followers: Vec<ActorRef<ExecutorMsg>>,
    state_parts: StateParts,
    spill: Option<ActorRef<SpillMsg>>,
    /// Counters already published to `/metrics`.
    published: PoolCounters,
    /// The last batch of pages the ranks were asked to copy out (ranks in executors of their own).
    spill_batch: u64,
}

pub struct KvPoolActor;

/// Messages a pool reply is sent back in (so the scheduler never waits inside a handler).
pub fn committed(reply: PoolReply, for_step: bool) -> SchedulerMsg {
    SchedulerMsg::PoolCommitted { reply, for_step }
}

impl KvPoolState {
    fn stats(&self) -> PoolStats {
        PoolStats {
            num_blocks: self.pool.num_blocks(),
            free_blocks: self.pool.num_free(),
            evictable_blocks: self.pool.num_evictable(),
            referenced_blocks: self.pool.num_referenced(),
            cached_pages: self.pool.num_cached_pages(),
            sequences: self.pool.seq_ids().count(),
            counters: self.pool.counters().clone(),
            spilled_pages: self.pool.num_spilled(),
            snapshot_bytes: self.pool.snapshot_bytes_held(),
        }
    }

    /// Publishes what changed since the last call.
    fn publish_metrics(&mut self) {
        let now = self.pool.counters().clone();
        let before = &self.published;
        metrics::counter!("shelfserve_prefix_cache_queries_total").increment(now.queries - before.queries);
        metrics::counter!("shelfserve_prefix_cache_hit_tokens_total").increment(now.hit_tokens - before.hit_tokens);
        for reason in MissReason::ALL {
            let n = now.misses.get(&reason).copied().unwrap_or(0);
            let was = before.misses.get(&reason).copied().unwrap_or(0);
            if n > was {
                metrics::counter!("shelfserve_prefix_cache_miss_total", "reason" => reason.label()).increment(n - was);
            }
        }
        metrics::counter!("shelfserve_kv_pages_evicted_total").increment(now.evictions - before.evictions);
        metrics::counter!("shelfserve_spill_restores_total", "choice" => "restore")
            .increment(now.restores_chosen - before.restores_chosen);
        metrics::counter!("shelfserve_spill_restores_total", "choice" => "recompute")
            .increment(now.restores_declined - before.restores_declined);
        metrics::gauge!("shelfserve_kv_pages_used").set(self.pool.num_referenced() as f64);
        metrics::gauge!("shelfserve_kv_pages_free").set(self.pool.num_free() as f64);
        metrics::gauge!("shelfserve_kv_pages_cached").set(self.pool.num_evictable() as f64);
        if self.pool.needs_snapshots() {
            metrics::counter!("shelfserve_kv_pages_unsnapshotted_total")
                .increment(now.unsnapshotted_pages - before.unsnapshotted_pages);
            metrics::gauge!("shelfserve_kv_snapshot_bytes").set(self.pool.snapshot_bytes_held() as f64);
        }
        self.published = now;
    }
}

impl KvPoolState {
    /// A prefix hit's snapshot into `slot`: the whole image to the one executor, or each rank's
    /// slice to that rank's executor (ranks in executors of their own hold only their KDA heads).
    fn write_state(&self, slot: u32, image: Arc<[u8]>) -> Result<(), ActorProcessingErr> {
        if self.followers.is_empty() {
            self.executor.cast(ExecutorMsg::WriteState { slot, image })?;
            return Ok(());
        }
        // The pool only takes snapshots of the group's width, so a mismatch is a broken invariant.
        let parts = self.state_parts.split(&image)?;
        if parts.len() != self.followers.len() + 1 {
            return Err(format!("{} state slices for {} executors", parts.len(), self.followers.len() + 1).into());
        }
        for (executor, image) in std::iter::once(&self.executor).chain(&self.followers).zip(parts) {
            executor.cast(ExecutorMsg::WriteState { slot, image })?;
        }
        Ok(())
    }
}

impl KvPoolState {
    /// Has `pages` copied out of KV memory and stored by the spill tier; with `sync`, the spill
    /// tier answers there once they (and every page sent before them) are on disk and synced. One
    /// executor sends whole images; ranks in executors of their own each send their slice, which
    /// the spill tier joins (`actors::rank_pages`): it is told which pages to expect before any rank
    /// is asked, so no slice can reach it first.
    fn spill_pages(
        &mut self,
        spill: &ActorRef<SpillMsg>,
        pages: Vec<EvictedPage>,
        sync: Option<RpcReplyPort<bool>>,
    ) -> Result<(), ActorProcessingErr> {
        if self.followers.is_empty() {
            self.executor.cast(ExecutorMsg::ReadPages { pages, spill: spill.clone(), sync })?;
            return Ok(());
        }
        self.spill_batch += 1;
        let batch = self.spill_batch;
        let reads: Vec<(PageHash, Vec<u32>)> = pages.iter().map(|p| (p.hash, p.blocks.clone())).collect();
        let expected = pages
            .into_iter()
            .map(|p| ExpectedPage { hash: p.hash, parent: p.parent, blocks: p.blocks.len(), snapshot: p.snapshot })
            .collect();
        spill.cast(SpillMsg::Expect { batch, pages: expected, sync })?;
        for executor in std::iter::once(&self.executor).chain(&self.followers) {
            executor.cast(ExecutorMsg::ReadSlices { batch, pages: reads.clone() })?;
        }
        Ok(())
    }
}

impl Actor for KvPoolActor {
    type Msg = KvPoolMsg;
    type State = KvPoolState;
    type Arguments = KvPoolArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<KvPoolMsg>,
        args: KvPoolArgs,
    ) -> Result<KvPoolState, ActorProcessingErr> {
        Ok(KvPoolState {
            pool: args.pool,
            scheduler: args.scheduler,
            executor: args.executor,
            followers: args.followers,
            state_parts: args.state_parts,
            spill: args.spill,
            published: PoolCounters::default(),
            spill_batch: 0,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<KvPoolMsg>,
        msg: KvPoolMsg,
        st: &mut KvPoolState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            KvPoolMsg::Commit { ops, for_step } => {
                let mut reply = apply_ops(&mut st.pool, ops);
                let evicted = st.pool.take_evicted();
                let evicted_count = evicted.len();
                // Prefix hits of a hybrid model resume from the last hit page's snapshot: queued at
                // the executor before the scheduler hears back, hence before their first step.
                for w in st.pool.take_state_writes() {
                    st.write_state(w.slot, w.image)?;
                }
                if let Some(spill) = st.spill.clone() {
                    // Queued at the executors before the scheduler hears back, hence before any
                    // step that could write the evicted blocks.
                    if !evicted.is_empty() {
                        st.spill_pages(&spill, evicted, None)?;
                    }
                    if !reply.restores.is_empty() {
                        tracing::debug!(pages = reply.restores.len(), evicted = evicted_count, "restores started");
                    }
                    for r in std::mem::take(&mut reply.restores) {
                        if spill.cast(SpillMsg::Load { hash: r.hash, blocks: r.blocks }).is_err() {
                            st.pool.finish_restore(r.hash, false, None);
                        }
                    }
                } else {
                    for r in std::mem::take(&mut reply.restores) {
                        st.pool.finish_restore(r.hash, false, None);
                    }
                }
                st.publish_metrics();
                st.scheduler.cast(committed(reply, for_step))?;
            }
            KvPoolMsg::Stats(reply) => {
                st.pool.reclaim();
                let _ = reply.send(st.stats());
            }
            KvPoolMsg::Spilled { hash, parent } => st.pool.note_spilled(hash, parent),
            KvPoolMsg::SpillDropped(hash) => st.pool.forget_spilled(&hash),
            KvPoolMsg::InHost { hash, parent } => st.pool.note_in_host(hash, parent),
            KvPoolMsg::HostDropped(hash) => st.pool.forget_in_host(&hash),
            KvPoolMsg::SpillOff => {
                st.spill = None;
                st.pool.forget_all_spilled();
            }
            KvPoolMsg::ReadMeasured { bytes, secs } => st.pool.observe_restore_read(bytes, secs),
            KvPoolMsg::StepCost(cost) => st.pool.set_step_cost(cost),
            KvPoolMsg::Snapshots(snaps) => {
                for snap in snaps {
                    if let Err(e) = st.pool.add_snapshot(snap) {
                        tracing::error!(error = %e, "a recurrent-state snapshot was refused");
                    }
                }
            }
            KvPoolMsg::FlushToSpill(reply) => match st.spill.clone() {
                Some(spill) => {
                    let pages = st.pool.unspilled_pages();
                    tracing::info!(pages = pages.len(), "writing cached pages to the spill tier before exit");
                    st.spill_pages(&spill, pages, Some(reply))?;
                }
                None => {
                    let _ = reply.send(false);
                }
            },
            KvPoolMsg::Restored { hash, ok, snapshot } => {
                tracing::debug!(page = %hash.to_hex(), ok, "restore ended");
                st.pool.finish_restore(hash, ok, snapshot);
                st.publish_metrics();
                st.scheduler.cast(SchedulerMsg::PoolViewChanged(view(&st.pool)))?;
            }
        }
        Ok(())
    }
}
