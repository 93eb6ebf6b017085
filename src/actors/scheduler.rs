//! `SchedulerActor`: the one place where serving decisions are made. It owns the policy (waiting
//! and running queues per priority, token budget, preemption, KV block accounting), plans one
//! step at a time, sends it to the executor, and turns the executor's sampled tokens into
//! per-request events (EOS, max_tokens and the context limit are decided here; stop strings by
//! each `RequestActor`). It never touches tensors.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::Sender;

use super::drafter::{DraftUpdate, DrafterMsg};
use super::executor::{ExecutorMsg, PlanSeq, SampleSpec, StepPlan, StepResult};
use super::handle::{EngineError, FinishReason, GenerationRequest, StreamEvent, TokenInfo};
use super::request::{RequestActor, RequestArgs, RequestMsg};
use crate::backend::KvGeometry;
use crate::config::engine::LaneConfig;
use crate::sampling::{PenaltyState, SamplingParams};
use crate::sched::{NewSeq, Policy, PolicyConfig, SeqId};
use crate::spec::stats::AcceptanceStats;
use crate::tokenizer::TokenizerBundle;

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
    /// The executor actor for rank 0 (sent once, right after it is spawned).
    AttachExecutor(ActorRef<ExecutorMsg>),
    ExecutorReady {
        rank: usize,
        kv: KvGeometry,
    },
    ExecutorFailed {
        rank: usize,
        error: String,
    },
    /// Counters for tests and health checks.
    Stats(RpcReplyPort<SchedulerStats>),
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
}

/// Shared with the engine handle: what admission control reads without a round trip.
pub struct SharedCounters {
    pub ready: AtomicBool,
    /// Requests per lane that have not produced a token yet (the bounded queue).
    pub queued: Vec<AtomicUsize>,
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
    queued: bool,
    /// Draft tokens per step for this sequence's lane (0 = no speculation).
    spec_k: usize,
    /// Leading tokens of the sequence the drafter has already been given.
    drafter_len: usize,
}

pub struct SchedulerState {
    args: SchedulerArgs,
    policy: Option<Policy>,
    executor: Option<ActorRef<ExecutorMsg>>,
    in_flight: bool,
    next_step: u64,
    next_seq: SeqId,
    live: HashMap<SeqId, LiveSeq>,
    stats: SchedulerStats,
    acceptance: AcceptanceStats,
}

pub struct SchedulerActor;

fn uses_penalties(p: &SamplingParams) -> bool {
    p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

impl SchedulerState {
    fn dequeue(&mut self, id: SeqId) {
        if let Some(l) = self.live.get_mut(&id) {
            if l.queued {
                l.queued = false;
                self.args.counters.queued[l.lane].fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    fn end(&mut self, id: SeqId, reason: FinishReason) {
        self.dequeue(id);
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
        if self.in_flight {
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
                k: l.spec_k,
            });
            l.drafter_len = v.tokens.len();
        }
        if updates.is_empty() {
            return;
        }
        let drafts = match ractor::call_t!(drafter, |reply| DrafterMsg::Propose { updates, reply }, 2000) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "drafter did not answer; this step runs without drafts");
                return;
            }
        };
        if let Some(policy) = self.policy.as_mut() {
            for (id, draft) in drafts {
                policy.set_draft(id, draft);
            }
        }
    }

    async fn plan_next_step(&mut self) {
        self.refresh_drafts().await;
        self.maybe_step();
    }

    fn fail(&mut self, id: SeqId, err: EngineError) {
        self.dequeue(id);
        if let Some(p) = self.policy.as_mut() {
            p.abort(id);
        }
        if let Some(l) = self.live.remove(&id) {
            self.forget_drafts(id, &l);
            let _ = l.request.cast(RequestMsg::Failed(err));
        }
    }

    fn cancel(&mut self, id: SeqId) {
        self.dequeue(id);
        if let Some(l) = self.live.remove(&id) {
            self.forget_drafts(id, &l);
        }
        if let Some(p) = self.policy.as_mut() {
            p.abort(id);
        }
    }

    /// Plan and dispatch the next step if the executor is idle and there is work.
    fn maybe_step(&mut self) {
        if self.in_flight {
            return;
        }
        let (Some(policy), Some(exec)) = (self.policy.as_mut(), self.executor.as_ref()) else { return };
        let Some(out) = policy.plan_step() else { return };
        self.stats.preemptions += out.preempted.len() as u64;
        if !out.preempted.is_empty() {
            metrics::counter!("shelfserve_preemptions_total").increment(out.preempted.len() as u64);
        }
        let seqs = out
            .seqs
            .into_iter()
            .map(|p| {
                let sample = if p.wants_logits {
                    self.live.get(&p.id).map(|l| SampleSpec {
                        params: Arc::clone(&l.params),
                        step: l.generated as u64,
                        penalties: l.penalties.clone(),
                    })
                } else {
                    None
                };
                PlanSeq {
                    seq: p.id,
                    tokens: p.tokens,
                    start_pos: p.start_pos,
                    block_table: p.block_table,
                    state_slot: 0,
                    num_draft: p.num_draft,
                    sample,
                }
            })
            .collect();
        self.next_step += 1;
        if exec.cast(ExecutorMsg::Run(StepPlan { step_id: self.next_step, seqs })).is_ok() {
            self.in_flight = true;
        } else if let Some(p) = self.policy.as_mut() {
            for id in p.on_step_failed() {
                self.fail(id, EngineError::Executor("the executor is gone".into()));
            }
        }
    }

    fn on_step_done(&mut self, r: StepResult) {
        self.in_flight = false;
        self.stats.steps += 1;
        let kind = if r.prefill_tokens > 0 { "prefill" } else { "decode" };
        metrics::histogram!("shelfserve_step_duration_seconds", "kind" => kind).record(r.elapsed.as_secs_f64());
        let Some(policy) = self.policy.as_mut() else { return };
        if let Some(err) = r.error {
            tracing::error!(step = r.step_id, error = %err, "step failed");
            for id in policy.on_step_failed() {
                self.fail(id, EngineError::Executor(err.clone()));
            }
            return;
        }
        let mut sampled = Vec::with_capacity(r.sampled.len());
        let mut ended: Vec<(SeqId, FinishReason)> = Vec::new();
        for (id, step) in r.sampled {
            let Some(l) = self.live.get_mut(&id) else { continue };
            if step.drafted > 0 {
                self.acceptance.record(step.drafted, step.accepted);
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
                if l.request.cast(RequestMsg::Tokens(infos)).is_err() {
                    finish = Some(FinishReason::Stop);
                }
                if l.queued {
                    l.queued = false;
                    self.args.counters.queued[l.lane].fetch_sub(1, Ordering::SeqCst);
                }
            }
            if let Some(reason) = finish {
                ended.push((id, reason));
            }
            if !kept.is_empty() {
                sampled.push((id, kept));
            }
        }
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
            metrics::gauge!("shelfserve_kv_pages_used").set(p.blocks_used() as f64);
            metrics::gauge!("shelfserve_kv_pages_free").set(p.blocks_free() as f64);
        }
        for (lane, n) in self.args.lanes.iter().zip(&self.args.counters.queued) {
            metrics::gauge!("shelfserve_queue_depth", "lane" => lane.name.clone()).set(n.load(Ordering::SeqCst) as f64);
        }
    }
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
        Ok(SchedulerState {
            args,
            policy: None,
            executor: None,
            in_flight: false,
            next_step: 0,
            next_seq: 0,
            live: HashMap::new(),
            stats: SchedulerStats::default(),
            acceptance: AcceptanceStats::default(),
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
                        queued: true,
                        spec_k: match st.args.lanes[lane].speculative {
                            crate::spec::SpeculativeMethod::None => 0,
                            _ => st.args.lanes[lane].num_speculative_tokens,
                        },
                        drafter_len: 0,
                    },
                );
                if let Some(e) = failed {
                    st.fail(id, EngineError::Executor(e));
                    return Ok(());
                }
                let priority = st.args.lanes[lane].priority;
                let added = match st.policy.as_mut() {
                    Some(p) => p
                        .add(NewSeq { id, priority, prompt: req.prompt, max_tokens: req.max_tokens })
                        .map_err(|e| e.to_string()),
                    None => Err("the model is still loading".to_string()),
                };
                match added {
                    Ok(()) => st.plan_next_step().await,
                    Err(e) => st.fail(id, EngineError::Invalid(e)),
                }
            }
            SchedulerMsg::Cancel(id) => {
                st.cancel(id);
                st.plan_next_step().await;
            }
            SchedulerMsg::StepDone(r) => {
                st.on_step_done(r);
                st.plan_next_step().await;
            }
            SchedulerMsg::AttachExecutor(exec) => {
                st.executor = Some(exec);
                st.plan_next_step().await;
            }
            SchedulerMsg::ExecutorReady { rank, kv } => {
                let mut cfg = st.args.policy.clone();
                cfg.num_blocks = kv.num_blocks;
                cfg.block_size = kv.block_size;
                st.policy = Some(Policy::new(cfg).map_err(|e| e.to_string())?);
                tracing::info!(rank, blocks = kv.num_blocks, block_size = kv.block_size, "executor ready");
                st.args.counters.ready.store(true, Ordering::SeqCst);
                st.publish_gauges();
            }
            SchedulerMsg::ExecutorFailed { rank, error } => {
                tracing::error!(rank, %error, "executor failed; failing in-flight requests and refusing new ones");
                *st.args.counters.failed.lock() = Some(error.clone());
                st.args.counters.ready.store(false, Ordering::SeqCst);
                let ids: Vec<SeqId> = st.live.keys().copied().collect();
                for id in ids {
                    st.fail(id, EngineError::Executor(error.clone()));
                }
            }
            SchedulerMsg::Stats(reply) => {
                let mut s = st.stats;
                if let Some(p) = &st.policy {
                    s.waiting = p.num_waiting();
                    s.running = p.num_running();
                    s.blocks_used = p.blocks_used();
                    s.blocks_free = p.blocks_free();
                }
                let _ = reply.send(s);
            }
        }
        Ok(())
    }
}
