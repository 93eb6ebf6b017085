//! `SchedulerActor`: the one place where serving decisions are made. It owns the planner (waiting
//! and running queues per priority, token budget, chunking, preemption), plans one step at a
//! time against the `KvPoolActor`'s view, commits the step's pool work there (one round trip),
//! sends the step to the executor, and turns the executor's sampled tokens into per-request events
//! (EOS, max_tokens and the context limit are decided here; stop strings by each
//! `RequestActor`). It never touches tensors or block ids beyond forwarding them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::Sender;

use super::drafter::{DraftUpdate, DrafterMsg};
use super::executor::{ExecutorMsg, PlanSeq, SampleSpec, StepPlan, StepResult};
use super::handle::{EngineError, FinishReason, GenerationRequest, PromptImage, StreamEvent, TokenInfo};
use super::kvpool::{KvPoolActor, KvPoolArgs, KvPoolMsg, PoolStats};
use super::rank_pages::SliceReport;
use super::ranks::{RankBook, RankReady};
use super::request::{RequestActor, RequestArgs, RequestMsg};
use super::spill::{SpillActor, SpillArgs, SpillMsg, DEFAULT_READ_DEADLINE};
use crate::backend::KvGeometry;
use crate::config::engine::LaneConfig;
use crate::kv::restore_cost::RestoreCost;
use crate::kv::{KvPool, KvPoolConfig, PoolIdentity, PoolReply};
use crate::sampling::{PenaltyState, SamplingParams};
use crate::sched::admission::Admission;
use crate::sched::{
    page_ends_within, NewSeq, Pacing, Planner, PolicyConfig, PrefillRate, SeqId, StepCost, StepPlanOut, StepShape,
};
use crate::spec::stats::AcceptanceStats;
use crate::spec::HiddenChunk;
use crate::structured::{GrammarHandle, PendingMasks};
use crate::tokenizer::TokenizerBundle;

/// The executors' reports cross processes (`cluster::wire`); everything else is local.
pub enum SchedulerMsg {
    /// A validated request for lane `lane` (index into the lane list).
    Submit {
        req: GenerationRequest,
        lane: usize,
        events: Sender<StreamEvent>,
    },
    /// Cancel a request (client gone, stop string matched). Its blocks are freed now, or when
    /// the step it is part of returns.
    Cancel(SeqId),
    StepDone(StepResult),
    /// The `KvPoolActor` applied a commit: for a planned step (`for_step`), the step can be
    /// finished and dispatched; otherwise (a flush of releases) just the view is new.
    PoolCommitted {
        reply: PoolReply,
        for_step: bool,
    },
    ExecutorReady {
        rank: usize,
        kv: KvGeometry,
        /// Bytes of one block's KV image (for the spill tier's size checks).
        kv_block_bytes: usize,
        state_slot_bytes: usize,
        /// The backend reads recurrent state at offsets inside a step (`Backend::snapshots_inside_step`).
        snapshots_inside_step: bool,
        /// The rank's executor: the scheduler learns its executors from these reports, and sends
        /// every step to all of them once every rank is ready (rank 0 samples). `None` when the
        /// report came from another process: the rank's executor is then found in the cluster's
        /// process group (`cluster::executor_of`).
        executor: Option<ActorRef<ExecutorMsg>>,
    },
    /// The pool changed outside a commit (a restore from disk ended): plan again.
    PoolViewChanged(crate::kv::PoolView),
    ExecutorFailed {
        rank: usize,
        error: String,
    },
    /// Counters for tests and health checks.
    Stats(RpcReplyPort<SchedulerStats>),
    /// The KV pool's occupancy and prefix-cache counters (forwarded to the pool actor).
    PoolStats(RpcReplyPort<PoolStats>),
    /// Drained shutdown, past its timeout: fail every live request with `shutting_down`.
    CancelAll,
    /// Drained shutdown: cached pages not on disk yet go to the spill tier (forwarded to the pool
    /// actor, after any commit this actor sent); answers once synced.
    FlushToSpill(RpcReplyPort<bool>),
    /// A rank's slice of a page it copied out for the spill tier, or the end of such a batch
    /// (ranks in executors of their own, `actors::rank_pages`): forwarded to the spill tier, which
    /// joins the ranks' slices. Every executor can reach its scheduler, from another process too.
    PageSlices(SliceReport),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    pub steps: u64,
    pub preemptions: u64,
    /// Draft tokens verified, and how many of them were accepted.
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// Steps sent to the executor whose results are not in yet. With overlapped scheduling a
    /// finished sequence's last lookahead step may still run (its result is dropped): the engine
    /// is idle only once this is 0 as well.
    pub steps_in_flight: usize,
    /// Steps of lower-lane prefill that stopped at a layer boundary to give way (`sched::yielding`).
    pub prefill_yields: u64,
}

/// Shared with the engine handle: what admission control reads without a round trip.
pub struct SharedCounters {
    pub ready: AtomicBool,
    /// Accepted requests per lane that have not ended: HTTP handlers accept through it (429 when
    /// neither a sequence slot nor the lane's queue can hold one more), the scheduler releases.
    pub admission: parking_lot::Mutex<Admission>,
    /// Set when the executor failed: new work is refused with this message.
    pub failed: parking_lot::Mutex<Option<String>>,
}

pub struct SchedulerArgs {
    pub lanes: Vec<LaneConfig>,
    pub policy: PolicyConfig,
    pub counters: Arc<SharedCounters>,
    pub tokenizer: Option<Arc<TokenizerBundle>>,
    pub eos_token_ids: Vec<u32>,
    pub max_context: usize,
    /// Present when some lane drafts (`speculative` in its config).
    pub drafter: Option<ActorRef<DrafterMsg>>,
    /// What makes cached pages valid (model fingerprint, KV layout, rank).
    pub pool_identity: PoolIdentity,
    /// Tensor-parallel ranks, one executor each; steps start once all of them are ready.
    pub world: usize,
    /// The cluster this head serves (`serve --head`): ranks of other processes report ready
    /// without a reference, and their executors are found in its process groups.
    pub cluster_group: Option<String>,
    /// The opened spill store (taken when the executor is ready); `None` = spill off.
    pub spill: Option<crate::spill::SpillStore>,
    /// Bytes of evicted pages the spill tier keeps in host memory (with spill on).
    pub spill_host_bytes: u64,
    /// Lane latency targets and the starting step cost (given to the planner when it is built);
    /// `None` = lane pacing off.
    pub pacing: Option<Pacing>,
    /// Plan each step while the executor runs the one before it when that step can only be
    /// continued (`sched::lookahead`); one rank only.
    pub overlap: bool,
    /// Steps of lower-lane prefill stop at a layer boundary when a higher lane gets work
    /// (`sched::yielding`): with lane pacing and one rank only.
    pub yield_lower_prefill: bool,
    /// With yielding: a decoding higher lane's steps alternate with lower lanes' prefill steps
    /// (`sched::lane_split`).
    pub separate_lane_decodes: bool,
}

struct LiveSeq {
    request: ActorRef<RequestMsg>,
    lane: usize,
    params: Arc<SamplingParams>,
    penalties: Option<Arc<PenaltyState>>,
    stop_ids: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    generated: usize,
    /// Counted in `SharedCounters::admission` until it ends.
    admitted: bool,
    /// Draft tokens per step for this sequence's lane (0 = no speculation).
    spec_k: usize,
    /// Leading tokens of the sequence the drafter has already been given.
    drafter_len: usize,
    /// The target's hidden states of this sequence not yet given to the drafter (lanes whose
    /// drafter reads them).
    hidden: Vec<HiddenChunk>,
    /// The first admission's prefix hit was reported to the request (usage.cached_tokens).
    hit_reported: bool,
    /// Structured output: the matcher, always at the accepted tokens.
    grammar: Option<GrammarHandle>,
    /// Images of the prompt (placeholder spans, pixels, content hashes): each step's plan carries
    /// those its chunk covers.
    images: Vec<PromptImage>,
    /// When the scheduler received it, and when it last emitted tokens (lane target metrics).
    arrived: Instant,
    last_emit: Option<Instant>,
}

pub struct SchedulerState {
    args: SchedulerArgs,
    policy: Option<Planner>,
    pool: Option<ActorRef<KvPoolMsg>>,
    /// A commit is at the pool; nothing else is sent there until it is answered.
    awaiting_pool: bool,
    /// The last plan came back empty because admissions wait for pages read back from disk:
    /// plan again only when something changes (restore ended, step done, submit, cancel).
    restore_wait: bool,
    /// Rank 0's executor (the one that samples; with one executor, it reads and writes spilled pages).
    executor: Option<ActorRef<ExecutorMsg>>,
    /// The other ranks' executors, sent the same plans.
    followers: Vec<ActorRef<ExecutorMsg>>,
    /// Which ranks have loaded and answered the step in flight.
    ranks: RankBook,
    /// Executors that reported ready, by rank, until the whole group has.
    joining: Vec<Option<ActorRef<ExecutorMsg>>>,
    /// What each step dispatched and not yet done computes, oldest first (timed by the executor,
    /// it refits the step cost model): one step, or two while a lookahead step waits behind it.
    in_flight: VecDeque<StepShape>,
    /// When the last step's result arrived, while the next step is being planned: the host time
    /// between two steps (the device idles through it) is recorded when that step is dispatched.
    step_done_at: Option<Instant>,
    /// Measured seconds per prefill token (prices recomputation against restores).
    prefill_rate: PrefillRate,
    next_step: u64,
    next_seq: SeqId,
    live: HashMap<SeqId, LiveSeq>,
    stats: SchedulerStats,
    acceptance: AcceptanceStats,
    /// Hybrid models with the prefix cache on: the page size at whose boundaries the executor
    /// snapshots recurrent state (0 = no snapshots).
    snapshot_page: usize,
    /// Every rank's backend reads recurrent state inside a step, so prefill chunks of a hybrid
    /// model may cross page boundaries (true until a rank reports otherwise).
    snapshots_inside_step: bool,
    /// The spill tier is on (the pool prices restores with the step cost model).
    spill_on: bool,
    /// The spill tier, which joins the page slices of ranks in executors of their own.
    spill: Option<ActorRef<SpillMsg>>,
    /// Per lane (by index), its latency targets when lane pacing is on (empty when off).
    targets: Vec<LaneTargetSecs>,
    /// Where structured outputs' token masks are computed while the executor runs a step.
    mask_pool: Arc<rayon::ThreadPool>,
    /// The yieldable step in flight or suspended, with its yield signal.
    yield_watch: Option<yield_watch::YieldWatch>,
}

pub struct SchedulerActor;

#[path = "scheduler_yield.rs"]
mod yield_watch;

/// Threads that compute grammar masks during forward passes: a mask takes well under a
/// millisecond for most grammars, so two keep up with a batch of constrained sequences.
const MASK_THREADS: usize = 2;

/// How long a step waits for its drafts before running without them.
const DRAFTER_TIMEOUT_MS: u64 = 10_000;

fn uses_penalties(p: &SamplingParams) -> bool {
    p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

impl SchedulerState {
    /// The request no longer counts against admission (it ended, failed or was cancelled).
    fn release_admission(&mut self, id: SeqId) {
        if let Some(l) = self.live.get_mut(&id) {
            if l.admitted {
                l.admitted = false;
                self.args.counters.admission.lock().release(l.lane);
            }
        }
    }

    fn end(&mut self, id: SeqId, reason: FinishReason) {
        self.release_admission(id);
        if let Some(l) = self.live.remove(&id) {
            self.forget_drafts(id, &l);
            let _ = l.request.cast(RequestMsg::Finished { reason });
        }
    }

    fn forget_drafts(&self, id: SeqId, l: &LiveSeq) {
        if let (Some(d), true) = (&self.args.drafter, l.spec_k > 0) {
            let _ = d.cast(DrafterMsg::Forget { seq: id, lane: l.lane });
        }
    }

    /// Ask the drafter for drafts for every running decoding sequence of a drafting lane, in one
    /// round trip, and offer them to the policy for the next step. A drafter that fails or is
    /// slow only costs this step its drafts.
    async fn refresh_drafts(&mut self) {
        if !self.in_flight.is_empty() {
            return;
        }
        let (Some(drafter), Some(policy)) = (self.args.drafter.clone(), self.policy.as_ref()) else { return };
        let mut updates = Vec::new();
        for (&id, l) in self.live.iter_mut() {
            if l.spec_k == 0 {
                continue;
            }
            let Some(v) = policy.seq(id) else { continue };
            if !v.running || v.num_computed + 1 != v.tokens.len() {
                continue;
            }
            updates.push(DraftUpdate {
                seq: id,
                lane: l.lane,
                append: v.tokens[l.drafter_len..].to_vec(),
                hidden: std::mem::take(&mut l.hidden),
                k: l.spec_k,
            });
            l.drafter_len = v.tokens.len();
        }
        if updates.is_empty() {
            return;
        }
        // Generous: a draft model prefills a new sequence's prompt inside this call.
        let drafts = match ractor::call_t!(drafter, |reply| DrafterMsg::Propose { updates, reply }, DRAFTER_TIMEOUT_MS)
        {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "drafter did not answer; this step runs without drafts");
                return;
            }
        };
        if let Some(policy) = self.policy.as_mut() {
            for (id, mut draft) in drafts {
                // A draft token the grammar forbids could never be accepted: cut it and the rest.
                if let Some(g) = self.live.get(&id).and_then(|l| l.grammar.as_ref()) {
                    let valid = g.lock().valid_prefix(&draft);
                    draft.truncate(valid);
                }
                if !draft.is_empty() {
                    policy.set_draft(id, draft);
                }
            }
        }
    }

    async fn plan_next_step(&mut self) {
        self.refresh_drafts().await;
        self.maybe_step();
    }

    fn fail(&mut self, id: SeqId, err: EngineError) {
        self.release_admission(id);
        if let Some(p) = self.policy.as_mut() {
            p.abort(id);
        }
        if let Some(l) = self.live.remove(&id) {
            self.forget_drafts(id, &l);
            let _ = l.request.cast(RequestMsg::Failed(err));
        }
    }

    fn cancel(&mut self, id: SeqId) {
        self.release_admission(id);
        if let Some(l) = self.live.remove(&id) {
            self.forget_drafts(id, &l);
        }
        if let Some(p) = self.policy.as_mut() {
            p.abort(id);
        }
    }

    /// Plan the next step if the executor is idle and there is work, and commit its pool work;
    /// the step is dispatched when the pool answers (`dispatch`). With nothing to plan, queued
    /// releases are still sent so freed pages are cached or free at once.
    fn maybe_step(&mut self) {
        if !self.in_flight.is_empty() {
            self.maybe_lookahead();
            return;
        }
        if self.awaiting_pool || self.restore_wait {
            return;
        }
        let (Some(policy), Some(pool), Some(_)) = (self.policy.as_mut(), self.pool.as_ref(), self.executor.as_ref())
        else {
            return;
        };
        if policy.may_resume() {
            self.resume_suspended();
            return;
        }
        let (ops, for_step) = match policy.plan_step() {
            Some(ops) => (ops, true),
            None if policy.has_pending() => (policy.take_pending(), false),
            // Nothing else can run: a suspended step continues even if a lane above waits.
            None if policy.suspended_level().is_some() => {
                self.resume_suspended();
                return;
            }
            None => {
                // Nothing to run: the device goes idle for want of work, not for the host.
                self.step_done_at = None;
                return;
            }
        };
        if pool.cast(KvPoolMsg::Commit { ops, for_step }).is_ok() {
            self.awaiting_pool = true;
        } else {
            self.pool_gone();
        }
    }

    /// With one step in flight that can only be continued, plan and commit the step after it now,
    /// so it is at the executor when that step ends (`sched::lookahead`).
    fn maybe_lookahead(&mut self) {
        if !self.args.overlap
            || self.in_flight.len() != 1
            || self.awaiting_pool
            || self.restore_wait
            || !self.followers.is_empty()
        {
            return;
        }
        let (Some(policy), Some(pool)) = (self.policy.as_mut(), self.pool.as_ref()) else { return };
        let (live, max_context) = (&self.live, self.args.max_context);
        let may_continue = |id: SeqId| {
            live.get(&id).is_some_and(|l| {
                l.spec_k == 0
                    && l.grammar.is_none()
                    && l.penalties.is_none()
                    // The step in flight adds one token; the context must hold the next one too.
                    && l.prompt_len + l.generated + 1 < max_context
            })
        };
        let Some(ops) = policy.plan_lookahead(may_continue) else { return };
        if pool.cast(KvPoolMsg::Commit { ops, for_step: true }).is_ok() {
            self.awaiting_pool = true;
        } else {
            self.pool_gone();
        }
    }

    /// The pool answered a commit.
    fn on_pool_committed(&mut self, reply: PoolReply, for_step: bool) {
        self.awaiting_pool = false;
        let Some(policy) = self.policy.as_mut() else { return };
        if !for_step {
            policy.apply_view(&reply);
            return;
        }
        let waits_for_restore = reply.grants.iter().any(|g| g.restoring);
        let out = policy.finish_step(reply);
        self.restore_wait = waits_for_restore && out.seqs.is_empty();
        self.dispatch(out);
    }

    fn dispatch(&mut self, out: StepPlanOut) {
        self.stats.preemptions += out.preempted.len() as u64;
        if !out.preempted.is_empty() {
            metrics::counter!("shelfserve_preemptions_total").increment(out.preempted.len() as u64);
        }
        // A preempted sequence's draft state goes (a draft model's KV is memory too); when it
        // runs again the drafter is given its whole context afresh.
        for &id in &out.preempted {
            if let Some(l) = self.live.get(&id) {
                self.forget_drafts(id, l);
            }
            if let Some(l) = self.live.get_mut(&id) {
                l.drafter_len = 0;
            }
        }
        for &(id, cached) in &out.prefix_hits {
            if let Some(l) = self.live.get_mut(&id).filter(|l| !l.hit_reported) {
                l.hit_reported = true;
                let _ = l.request.cast(RequestMsg::PrefixHit { cached_tokens: cached.min(l.prompt_len) });
            }
        }
        if out.seqs.is_empty() {
            // Everything planned sat out (the pool could not grant it, or a lookahead step's
            // sequences ended meanwhile): nothing is in flight for it; plan again against the
            // fresh view.
            return;
        }
        let Some(exec) = self.executor.clone() else { return };
        let snapshot_page = self.snapshot_page;
        let seqs = out
            .seqs
            .into_iter()
            .map(|p| {
                let sample = if p.wants_logits {
                    self.live.get(&p.id).map(|l| SampleSpec {
                        params: Arc::clone(&l.params),
                        // A lookahead row generates the token after the one the step in flight
                        // samples, whether or not that step's result is in yet.
                        step: if p.follows_previous {
                            (p.start_pos + 1).saturating_sub(l.prompt_len) as u64
                        } else {
                            l.generated as u64
                        },
                        penalties: l.penalties.clone(),
                        // Started now, joined by the executor after the forward pass.
                        grammar: l.grammar.as_ref().map(|g| {
                            let drafts = p.tokens[p.tokens.len() - p.num_draft..].to_vec();
                            PendingMasks::start(&self.mask_pool, g, drafts)
                        }),
                    })
                } else {
                    None
                };
                // A verify run is capped at the page end (`sched::drafts`); the executor snapshots
                // it only if every draft was accepted, i.e. the kept state really is at the end.
                let snapshot_after = page_ends_within(p.start_pos, p.tokens.len(), snapshot_page);
                let end = p.start_pos + p.tokens.len();
                let images = self.live.get(&p.id).map_or_else(Vec::new, |l| {
                    l.images.iter().filter(|i| i.span.start < end && i.span.end > p.start_pos).cloned().collect()
                });
                PlanSeq {
                    images,
                    seq: p.id,
                    follows_previous: p.follows_previous,
                    tokens: p.tokens,
                    start_pos: p.start_pos,
                    block_table: p.block_table,
                    state_slot: p.state_slot,
                    num_draft: p.num_draft,
                    snapshot_after,
                    sample,
                }
            })
            .collect();
        self.next_step += 1;
        let yield_signal = self.arm_yield(self.next_step, out.yield_level);
        let plan = StepPlan { step_id: self.next_step, seqs, yield_signal };
        // A follower of another process is gone once its node is (`cluster`): name its rank.
        let lost = match self.followers.iter().position(|f| f.cast(ExecutorMsg::Run(plan.clone())).is_err()) {
            Some(i) => Some(i + 1),
            None => exec.cast(ExecutorMsg::Run(plan)).is_err().then_some(0),
        };
        if lost.is_none() {
            // Queued behind a step still running, it starts with no host time in between.
            if !self.in_flight.is_empty() {
                metrics::counter!("shelfserve_steps_overlapped_total").increment(1);
            } else if let Some(done) = self.step_done_at.take() {
                metrics::histogram!("shelfserve_step_gap_seconds").record(done.elapsed().as_secs_f64());
            }
            self.step_done_at = None;
            self.in_flight.push_back(out.shape);
        } else if let Some(p) = self.policy.as_mut() {
            let why = match lost {
                Some(rank) if self.ranks.world() > 1 => format!("the executor of rank {rank} is gone"),
                _ => "the executor is gone".to_string(),
            };
            for id in p.on_step_failed() {
                self.fail(id, EngineError::Executor(why.clone()));
            }
        }
    }

    /// The pool actor is gone: nothing can be planned any more.
    fn pool_gone(&mut self) {
        tracing::error!("the KV pool actor is gone; failing live requests");
        *self.args.counters.failed.lock() = Some("the KV pool actor stopped".into());
        self.args.counters.ready.store(false, Ordering::SeqCst);
        let ids: Vec<SeqId> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(id, EngineError::Executor("the KV pool actor stopped".into()));
        }
    }

    fn on_step_done(&mut self, mut r: StepResult) {
        if r.suspended_after.is_some() && r.error.is_none() {
            self.on_step_suspended(&r);
            return;
        }
        // A resumed step's time covers only its second part: it does not refit the cost model.
        let resumed = self.end_yield_watch(r.step_id);
        let shape = self.in_flight.pop_front().unwrap_or_default();
        if self.in_flight.is_empty() {
            self.step_done_at = Some(Instant::now());
        }
        self.stats.steps += 1;
        let kind = if r.prefill_tokens > 0 { "prefill" } else { "decode" };
        metrics::histogram!("shelfserve_step_duration_seconds", "kind" => kind).record(r.elapsed.as_secs_f64());
        // Sequences whose images failed to encode were left out of the step: only their
        // requests fail, as the client's (400); the step's timing no longer fits its shape.
        let rejected = std::mem::take(&mut r.rejected);
        for (id, why) in &rejected {
            self.fail(*id, EngineError::Invalid(format!("the vision tower could not encode an image: {why}")));
        }
        let Some(policy) = self.policy.as_mut() else { return };
        if r.error.is_none() && rejected.is_empty() && !resumed {
            // A step far over its prediction is what keeps a waiting high lane past its target:
            // name its shape (before the fit learns from it) so such outliers can be traced.
            if let Some(pacing) = policy.pacing() {
                let predicted = pacing.model().predict(&shape);
                if r.elapsed.as_secs_f64() > 2.0 * predicted + 0.005 {
                    metrics::counter!("shelfserve_step_over_prediction_total").increment(1);
                    tracing::debug!(
                        step = r.step_id,
                        seconds = r.elapsed.as_secs_f64(),
                        predicted,
                        prefill_tokens = shape.prefill_tokens,
                        decode_seqs = shape.decode_seqs,
                        attended = shape.attended,
                        "step took over twice its predicted time"
                    );
                }
            }
            policy.observe_step(&shape, r.elapsed.as_secs_f64());
            // The pool prices recomputing a spilled prefix at the measured prefill rate.
            self.prefill_rate.observe(shape.prefill_tokens, r.elapsed.as_secs_f64());
            if shape.prefill_tokens >= PrefillRate::MIN_TOKENS && self.spill_on {
                if let (Some(cost), Some(pool)) = (self.prefill_rate.as_step_cost(), &self.pool) {
                    let _ = pool.cast(KvPoolMsg::StepCost(cost));
                }
            }
        }
        for (id, chunk) in r.hidden {
            if let Some(l) = self.live.get_mut(&id) {
                if l.spec_k > 0 && self.args.lanes[l.lane].speculative.reads_hidden_states() {
                    l.hidden.push(chunk);
                }
            }
        }
        if let Some(err) = r.error {
            tracing::error!(step = r.step_id, error = %err, "step failed");
            for id in policy.on_step_failed() {
                self.fail(id, EngineError::Executor(err.clone()));
            }
            return;
        }
        let mut sampled = Vec::with_capacity(r.sampled.len());
        let mut ended: Vec<(SeqId, FinishReason)> = Vec::new();
        let now = Instant::now();
        for (id, step) in r.sampled {
            let Some(l) = self.live.get_mut(&id) else { continue };
            if step.drafted > 0 {
                let source = self.args.lanes[l.lane].speculative.source_name().unwrap_or("none");
                self.acceptance.record(source, step.drafted, step.accepted);
                self.stats.drafted_tokens += step.drafted as u64;
                self.stats.accepted_tokens += step.accepted as u64;
            }
            // Tokens are taken in order until a stop token, max_tokens or the context limit: an
            // accepted run of drafts ends exactly where the un-drafted reply would have.
            let (mut infos, mut kept, mut finish) = (Vec::new(), Vec::new(), None);
            for s in step.tokens {
                if l.stop_ids.contains(&s.token) {
                    finish = Some(FinishReason::Stop);
                    break;
                }
                l.generated += 1;
                if let Some(p) = l.penalties.as_mut() {
                    Arc::make_mut(p).push_output(s.token);
                }
                kept.push(s.token);
                infos.push(TokenInfo {
                    id: s.token,
                    logprob: l.params.logprobs.map(|_| s.logprob),
                    top_logprobs: if l.params.logprobs.is_some() { s.top_logprobs } else { Vec::new() },
                });
                if l.generated >= l.max_tokens || l.prompt_len + l.generated >= self.args.max_context {
                    finish = Some(FinishReason::Length);
                    break;
                }
            }
            if !infos.is_empty() {
                record_lane_latency(&self.args.lanes[l.lane], self.targets.get(l.lane).copied(), l, now);
                if l.request.cast(RequestMsg::Tokens(infos)).is_err() {
                    finish = Some(FinishReason::Stop);
                }
            }
            if let Some(reason) = finish {
                ended.push((id, reason));
            }
            if let (Some(g), false) = (&l.grammar, kept.is_empty()) {
                g.lock().consume(&kept);
            }
            if !kept.is_empty() {
                sampled.push((id, kept));
            }
        }
        let Some(policy) = self.policy.as_mut() else { return };
        let finished: Vec<SeqId> = ended.iter().map(|e| e.0).collect();
        for id in policy.on_step_done(&sampled, &finished) {
            if !finished.contains(&id) {
                ended.push((id, FinishReason::Length));
            }
        }
        for (id, reason) in ended {
            self.end(id, reason);
        }
        self.publish_gauges();
    }

    fn publish_gauges(&self) {
        if let Some(p) = &self.policy {
            metrics::gauge!("shelfserve_running_sequences").set(p.num_running() as f64);
            if let Some(pacing) = p.pacing() {
                let c = pacing.model().cost();
                for (term, v) in [
                    ("fixed", c.fixed),
                    ("per_prefill_token", c.per_prefill_token),
                    ("per_decode_seq", c.per_decode_seq),
                    ("per_million_attended", c.per_million_attended),
                ] {
                    metrics::gauge!("shelfserve_step_cost_seconds", "term" => term).set(v);
                }
            }
        }
        let admission = self.args.counters.admission.lock();
        for (i, lane) in self.args.lanes.iter().enumerate() {
            metrics::gauge!("shelfserve_queue_depth", "lane" => lane.name.clone()).set(admission.waiting(i) as f64);
        }
    }
}

/// Per-lane time to first token (from the scheduler's receipt) and its target misses; gaps between
/// emissions over `target_itl` count as ITL misses.
fn record_lane_latency(lane: &LaneConfig, target: Option<LaneTargetSecs>, l: &mut LiveSeq, now: Instant) {
    match l.last_emit {
        None => {
            let ttft = now.duration_since(l.arrived).as_secs_f64();
            metrics::histogram!("shelfserve_lane_ttft_seconds", "lane" => lane.name.clone()).record(ttft);
            if target.is_some_and(|t| ttft > t.ttft) {
                metrics::counter!("shelfserve_lane_target_misses_total", "lane" => lane.name.clone(), "target" => "ttft")
                    .increment(1);
            }
        }
        Some(prev) => {
            let gap = now.duration_since(prev).as_secs_f64();
            if target.is_some_and(|t| gap > t.itl) {
                metrics::counter!("shelfserve_lane_target_misses_total", "lane" => lane.name.clone(), "target" => "itl")
                    .increment(1);
            }
        }
    }
    l.last_emit = Some(now);
}

/// A lane's targets in seconds (index = lane), for the miss counters.
#[derive(Clone, Copy, Debug)]
struct LaneTargetSecs {
    ttft: f64,
    itl: f64,
}

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        args: SchedulerArgs,
    ) -> Result<SchedulerState, ActorProcessingErr> {
        let world = args.world;
        let targets = match &args.pacing {
            Some(p) => args
                .lanes
                .iter()
                .filter_map(|l| p.targets().iter().find(|t| t.priority == l.priority))
                .map(|t| LaneTargetSecs { ttft: t.ttft, itl: t.itl })
                .collect(),
            None => Vec::new(),
        };
        let mask_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(MASK_THREADS)
            .thread_name(|i| format!("grammar-mask-{i}"))
            .build()
            .map_err(|e| format!("cannot start the grammar mask threads: {e}"))?;
        Ok(SchedulerState {
            targets,
            mask_pool: Arc::new(mask_pool),
            args,
            policy: None,
            pool: None,
            awaiting_pool: false,
            restore_wait: false,
            executor: None,
            followers: Vec::new(),
            ranks: RankBook::new(world),
            joining: vec![None; world.max(1)],
            in_flight: VecDeque::new(),
            step_done_at: None,
            prefill_rate: PrefillRate::default(),
            next_step: 0,
            next_seq: 0,
            live: HashMap::new(),
            stats: SchedulerStats::default(),
            acceptance: AcceptanceStats::default(),
            snapshot_page: 0,
            snapshots_inside_step: true,
            spill_on: false,
            spill: None,
            yield_watch: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        st: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit { req, lane, events } => {
                st.next_seq += 1;
                let id = st.next_seq;
                let failed = st.args.counters.failed.lock().clone();
                let params = Arc::new(req.sampling.clone());
                let mut stop_ids = req.stop_token_ids.clone();
                if !req.ignore_eos {
                    stop_ids.extend(&st.args.eos_token_ids);
                }
                let request_args = RequestArgs {
                    seq: id,
                    prompt_tokens: req.prompt.len(),
                    cached_tokens: 0,
                    tokenizer: st.args.tokenizer.clone(),
                    skip_special_tokens: req.skip_special_tokens,
                    stop_strings: req.stop_strings.clone(),
                    loop_guard: req.loop_guard,
                    events,
                    scheduler: myself.clone(),
                };
                let (request, _) = Actor::spawn(None, RequestActor, request_args).await?;
                st.live.insert(
                    id,
                    LiveSeq {
                        request,
                        lane,
                        penalties: uses_penalties(&params).then(|| Arc::new(PenaltyState::new(&req.prompt))),
                        params,
                        stop_ids,
                        prompt_len: req.prompt.len(),
                        max_tokens: req.max_tokens,
                        generated: 0,
                        admitted: true,
                        spec_k: match st.args.lanes[lane].speculative {
                            crate::spec::SpeculativeMethod::None => 0,
                            _ => st.args.lanes[lane].num_speculative_tokens,
                        },
                        drafter_len: 0,
                        hidden: Vec::new(),
                        hit_reported: false,
                        grammar: req.grammar.clone(),
                        images: req.images.clone(),
                        arrived: Instant::now(),
                        last_emit: None,
                    },
                );
                if let Some(e) = failed {
                    st.fail(id, EngineError::Executor(e));
                    return Ok(());
                }
                let priority = st.args.lanes[lane].priority;
                let image_keys = req.images.iter().map(|i| (i.span.clone(), i.hash)).collect();
                let added = match st.policy.as_mut() {
                    Some(p) => p
                        .add_with_images(
                            NewSeq { id, priority, prompt: req.prompt, max_tokens: req.max_tokens },
                            image_keys,
                        )
                        .map_err(|e| e.to_string()),
                    None => Err("the model is still loading".to_string()),
                };
                st.restore_wait = false;
                match added {
                    Ok(()) => {
                        st.raise_yield(priority);
                        st.plan_next_step().await
                    }
                    Err(e) => st.fail(id, EngineError::Invalid(e)),
                }
            }
            SchedulerMsg::Cancel(id) => {
                st.cancel(id);
                st.restore_wait = false;
                st.plan_next_step().await;
            }
            SchedulerMsg::StepDone(r) => {
                // Under tensor parallelism the step is done when every rank has answered.
                let Some(mut r) = st.ranks.on_result(r.rank, r) else { return Ok(()) };
                // Ranks in executors of their own roll their state back as rank 0 did, before
                // anything this result leads to (a state write, the next step) reaches them.
                for f in st.followers.iter().filter(|_| r.error.is_none() && !r.verified.is_empty()) {
                    let _ = f.cast(ExecutorMsg::CommitVerified { step_id: r.step_id, slots: r.verified.clone() });
                }
                // Page-end snapshots reach the pool before the commit whose `Advance` publishes
                // their pages (same sender, so in order).
                if !r.snapshots.is_empty() && r.error.is_none() {
                    if let Some(pool) = &st.pool {
                        let _ = pool.cast(KvPoolMsg::Snapshots(std::mem::take(&mut r.snapshots)));
                    }
                }
                st.on_step_done(r);
                st.restore_wait = false;
                st.plan_next_step().await;
            }
            SchedulerMsg::PoolViewChanged(view) => {
                // A view taken outside a commit is only current when no commit is under way.
                if !st.awaiting_pool {
                    if let Some(p) = st.policy.as_mut() {
                        p.apply_view(&PoolReply { view, ..PoolReply::default() });
                    }
                }
                st.restore_wait = false;
                st.plan_next_step().await;
            }
            SchedulerMsg::PoolCommitted { reply, for_step } => {
                st.on_pool_committed(reply, for_step);
                st.maybe_step();
            }
            SchedulerMsg::ExecutorReady {
                rank,
                kv,
                kv_block_bytes,
                state_slot_bytes,
                snapshots_inside_step,
                executor,
            } => {
                st.snapshots_inside_step &= snapshots_inside_step;
                // The group is ready when every rank is; its KV image is the ranks' side by side.
                // Executors announce themselves here (a fast load may beat any other message).
                let executor = match executor
                    .or_else(|| st.args.cluster_group.as_deref().and_then(|g| crate::cluster::executor_of(g, rank)))
                {
                    Some(e) => e,
                    None => {
                        let error = format!("rank {rank} reported ready, but its executor is not in the cluster");
                        myself.cast(SchedulerMsg::ExecutorFailed { rank, error })?;
                        return Ok(());
                    }
                };
                if let Some(slot) = st.joining.get_mut(rank) {
                    *slot = Some(executor);
                }
                let Some(RankReady { kv, kv_block_bytes, state_slot_bytes }) =
                    st.ranks.on_ready(rank, RankReady { kv, kv_block_bytes, state_slot_bytes })?
                else {
                    return Ok(());
                };
                let mut group = std::mem::take(&mut st.joining).into_iter().flatten();
                st.executor = group.next();
                st.followers = group.collect();
                let mut cfg = st.args.policy.clone();
                cfg.num_blocks = kv.num_blocks;
                cfg.block_size = kv.block_size;
                cfg.recurrent_state = state_slot_bytes > 0;
                cfg.page_aligned_chunks = cfg.recurrent_state && !st.snapshots_inside_step;
                if state_slot_bytes > 0 && cfg.page_tokens > 0 {
                    // A cached page of a hybrid model carries the recurrent state at its end.
                    tracing::info!(
                        state_slot_bytes,
                        page_tokens = cfg.page_tokens,
                        "prefix cache pages snapshot this model's recurrent state at every page end"
                    );
                    st.snapshot_page = cfg.page_tokens;
                }
                let pool_cfg = KvPoolConfig {
                    num_blocks: kv.num_blocks,
                    block_size: kv.block_size,
                    page_tokens: cfg.page_tokens,
                    state_slots: kv.state_slots,
                    snapshot_bytes: state_slot_bytes,
                };
                let mut pool = KvPool::new(pool_cfg, &st.args.pool_identity).map_err(|e| e.to_string())?;
                let mut planner = Planner::new(cfg.clone()).map_err(|e| e.to_string())?;
                planner.set_pacing(st.args.pacing.take());
                // Yielding needs pacing (its targets say which lanes are above) and a single rank
                // (all would have to stop at the same layer). Lookahead steps never yield, and none
                // is planned behind a yieldable step (`sched::yielding`).
                let yielding = st.args.yield_lower_prefill && planner.pacing().is_some() && st.ranks.world() == 1;
                planner.set_yielding(yielding);
                planner.set_separate_lane_decodes(yielding && st.args.separate_lane_decodes);
                let planner_cost = planner.pacing().map(|p| p.model().cost());
                st.policy = Some(planner);
                let executor = st.executor.clone().ok_or("no executor is attached")?;
                let store = st.args.spill.take().filter(|_| cfg.page_tokens > 0);
                let spill = match store {
                    Some(store) => {
                        // Pages a previous run spilled: restorable from the first request on.
                        for p in store.pages() {
                            pool.note_spilled(p.hash, p.parent);
                        }
                        let page_image_bytes = cfg.page_tokens / kv.block_size * kv_block_bytes + state_slot_bytes;
                        // Restore a spilled prefix only when reading it beats recomputing it.
                        let step_cost = planner_cost.unwrap_or(StepCost::CPU);
                        pool.set_restore_cost(Some(RestoreCost::new(
                            page_image_bytes,
                            cfg.page_tokens,
                            crate::spill::io::PARALLEL_READS,
                            step_cost,
                        )));
                        st.spill_on = true;
                        let args = SpillArgs {
                            store: Some(store),
                            executors: std::iter::once(executor.clone()).chain(st.followers.iter().cloned()).collect(),
                            page_parts: st.ranks.page_parts(),
                            page_image_bytes,
                            snapshot_bytes: state_slot_bytes,
                            read_deadline: DEFAULT_READ_DEADLINE,
                            host_budget: st.args.spill_host_bytes,
                        };
                        // Not linked: a failing spill tier must not take serving down with it;
                        // the pool treats an unreachable spill actor as spill off.
                        let (spill, _) = Actor::spawn(None, SpillActor, args).await?;
                        Some(spill)
                    }
                    None => None,
                };
                // Linked: if the pool actor dies the scheduler stops too, and the engine reports
                // `shutting_down` (a pool that lost its books cannot serve safely).
                let (pool_ref, _) = Actor::spawn_linked(
                    None,
                    KvPoolActor,
                    KvPoolArgs {
                        pool,
                        scheduler: myself.clone(),
                        executor,
                        followers: st.followers.clone(),
                        state_parts: st.ranks.state_parts(),
                        spill: spill.clone(),
                    },
                    myself.get_cell(),
                )
                .await?;
                if let Some(spill) = &spill {
                    spill.cast(SpillMsg::AttachPool(pool_ref.clone()))?;
                }
                st.spill = spill;
                st.pool = Some(pool_ref);
                tracing::info!(rank, blocks = kv.num_blocks, block_size = kv.block_size, "executor ready");
                st.args.counters.ready.store(true, Ordering::SeqCst);
                st.publish_gauges();
            }
            SchedulerMsg::ExecutorFailed { rank, error } => {
                tracing::error!(rank, %error, "executor failed; failing in-flight requests and refusing new ones");
                *st.args.counters.failed.lock() = Some(error.clone());
                // Its slices of pages being spilled will never come: the spill tier drops them.
                if let Some(spill) = &st.spill {
                    let _ = spill.cast(SpillMsg::RankFailed(rank));
                }
                st.args.counters.ready.store(false, Ordering::SeqCst);
                let ids: Vec<SeqId> = st.live.keys().copied().collect();
                for id in ids {
                    st.fail(id, EngineError::Executor(error.clone()));
                }
            }
            SchedulerMsg::PoolStats(reply) => {
                // Without a pool (still loading) the port is dropped and the caller gets an error.
                if let Some(pool) = &st.pool {
                    let _ = pool.cast(KvPoolMsg::Stats(reply));
                }
            }
            SchedulerMsg::CancelAll => {
                let ids: Vec<SeqId> = st.live.keys().copied().collect();
                for id in ids {
                    st.fail(id, EngineError::ShuttingDown);
                }
                st.maybe_step();
            }
            SchedulerMsg::FlushToSpill(reply) => match &st.pool {
                Some(pool) => {
                    let _ = pool.cast(KvPoolMsg::FlushToSpill(reply));
                }
                None => {
                    let _ = reply.send(false);
                }
            },
            SchedulerMsg::PageSlices(report) => match &st.spill {
                Some(spill) => {
                    let _ = spill.cast(SpillMsg::Slices(report));
                }
                None => tracing::debug!("a page slice with the spill tier off; dropped"),
            },
            SchedulerMsg::Stats(reply) => {
                let mut s = st.stats;
                s.steps_in_flight = st.in_flight.len();
                if let Some(p) = &st.policy {
                    s.waiting = p.num_waiting();
                    s.running = p.num_running();
                    s.blocks_used = p.config().num_blocks - p.blocks_available();
                    s.blocks_free = p.blocks_available();
                }
                let _ = reply.send(s);
            }
        }
        Ok(())
    }
}
