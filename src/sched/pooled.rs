//! `Policy`: a `Planner` and a `KvPool` composed synchronously — exactly what the SchedulerActor
//! and the KvPoolActor do through messages, minus the messages. Tests and benches drive it; every
//! step goes through the same `PoolOp` list and `kv::apply_ops` as in the engine.

use super::policy::{NewSeq, Planner, PolicyConfig, PolicyError, SeqId, SeqView, StepPlanOut};
use crate::kv::{apply_ops, KvPool, KvPoolConfig, PoolIdentity};

pub struct Policy {
    planner: Planner,
    pool: KvPool,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy").field("planner", &self.planner).field("pool", &self.pool).finish()
    }
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Result<Self, PolicyError> {
        let identity = PoolIdentity { model_fingerprint: "policy".into(), kv_layout: "plain".into(), rank: 0 };
        Self::with_identity(cfg, &identity)
    }

    pub fn with_identity(cfg: PolicyConfig, identity: &PoolIdentity) -> Result<Self, PolicyError> {
        let planner = Planner::new(cfg.clone())?;
        let pool_cfg = KvPoolConfig {
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            page_tokens: cfg.page_tokens,
            state_slots: cfg.max_num_seqs,
            snapshot_bytes: 0,
        };
        let pool = KvPool::new(pool_cfg, identity).map_err(|e| PolicyError::InvalidConfig(e.to_string()))?;
        Ok(Self { planner, pool })
    }

    pub fn config(&self) -> &PolicyConfig {
        self.planner.config()
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn add(&mut self, seq: NewSeq) -> Result<(), PolicyError> {
        self.planner.add(seq)?;
        self.flush();
        Ok(())
    }

    pub fn abort(&mut self, id: SeqId) -> bool {
        let known = self.planner.abort(id);
        self.flush();
        known
    }

    /// See `Planner::set_pacing`.
    pub fn set_pacing(&mut self, pacing: Option<super::Pacing>) {
        self.planner.set_pacing(pacing);
    }

    /// See `Planner::observe_step`.
    pub fn observe_step(&mut self, shape: &super::StepShape, secs: f64) {
        self.planner.observe_step(shape, secs);
    }

    pub fn set_draft(&mut self, id: SeqId, draft: Vec<u32>) -> usize {
        self.planner.set_draft(id, draft)
    }

    /// Plans a step, commits its pool work and returns the step with block tables.
    pub fn plan_step(&mut self) -> Option<StepPlanOut> {
        let ops = self.planner.plan_step()?;
        let reply = apply_ops(&mut self.pool, ops);
        let out = self.planner.finish_step(reply);
        // Sequences the pool could not admit were sent back to waiting: tell the pool now.
        self.flush();
        Some(out)
    }

    /// Plans, commits and returns the step that continues the one in flight (see
    /// `sched::lookahead`); its chunks' tokens are placeholders for what that step samples.
    pub fn plan_lookahead(&mut self, may_continue: impl Fn(SeqId) -> bool) -> Option<StepPlanOut> {
        let ops = self.planner.plan_lookahead(may_continue)?;
        let reply = apply_ops(&mut self.pool, ops);
        let out = self.planner.finish_step(reply);
        self.flush();
        Some(out)
    }

    pub fn on_step_done(&mut self, sampled: &[(SeqId, Vec<u32>)], finished: &[SeqId]) -> Vec<SeqId> {
        let ended = self.planner.on_step_done(sampled, finished);
        self.flush();
        ended
    }

    pub fn on_step_failed(&mut self) -> Vec<SeqId> {
        let failed = self.planner.on_step_failed();
        self.flush();
        failed
    }

    /// See `Planner::set_yielding` (`sched::yielding`).
    pub fn set_yielding(&mut self, on: bool) {
        self.planner.set_yielding(on);
    }

    /// See `Planner::set_separate_lane_decodes` (`sched::lane_split`).
    pub fn set_separate_lane_decodes(&mut self, on: bool) {
        self.planner.set_separate_lane_decodes(on);
    }

    /// See `Planner::on_step_suspended`.
    pub fn on_step_suspended(&mut self) -> Option<i32> {
        self.planner.on_step_suspended()
    }

    /// See `Planner::resume_suspended`.
    pub fn resume_suspended(&mut self) -> bool {
        self.planner.resume_suspended()
    }

    pub fn num_waiting(&self) -> usize {
        self.planner.num_waiting()
    }

    pub fn num_waiting_for(&self, priority: i32) -> usize {
        self.planner.num_waiting_for(priority)
    }

    pub fn num_running(&self) -> usize {
        self.planner.num_running()
    }

    /// Blocks some sequence references.
    pub fn blocks_used(&self) -> usize {
        self.pool.num_referenced()
    }

    /// Blocks free or holding unreferenced cached pages.
    pub fn blocks_free(&self) -> usize {
        self.pool.num_available()
    }

    pub fn is_idle(&self) -> bool {
        self.planner.is_idle()
    }

    pub fn seq(&self, id: SeqId) -> Option<SeqView<'_>> {
        self.planner.seq(id).map(|v| SeqView { block_table: self.pool.blocks_of(id), ..v })
    }

    /// The planner's checks, the pool's exact accounting, and that both agree: every sequence's
    /// blocks and computed tokens, and the available count.
    pub fn assert_accounting(&mut self) {
        self.planner.assert_accounting();
        self.pool.assert_accounting(&[]);
        assert!(!self.planner.has_pending(), "pool work left unsent");
        assert_eq!(self.planner.blocks_available(), self.pool.num_available(), "planner view != pool");
        for id in self.pool.seq_ids().collect::<Vec<_>>() {
            let v = self.planner.seq(id).expect("the pool holds only live sequences");
            assert_eq!(v.held_blocks, self.pool.blocks_of(id).len(), "seq {id}: held blocks differ");
            assert_eq!(v.num_computed, self.pool.computed_of(id), "seq {id}: computed tokens differ");
        }
        if self.planner.is_idle() {
            assert_eq!(self.pool.num_referenced(), 0, "an idle policy references blocks");
        }
    }

    /// Sends queued pool work now and takes the resulting view.
    fn flush(&mut self) {
        if self.planner.has_pending() {
            let ops = self.planner.take_pending();
            let reply = apply_ops(&mut self.pool, ops);
            self.planner.apply_view(&reply);
        }
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "lane_test_support.rs"]
mod lane_test_support;
#[cfg(test)]
#[path = "pacing_tests.rs"]
mod pacing_tests;

#[cfg(test)]
#[path = "lane_split_tests.rs"]
mod lane_split_tests;
#[cfg(test)]
#[path = "yielding_tests.rs"]
mod yielding_tests;
