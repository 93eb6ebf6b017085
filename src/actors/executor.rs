//! `ExecutorActor`: one per rank. It owns a backend (device, weights, KV memory) on a dedicated OS
//! thread, runs exactly the `StepPlan` it is sent, samples where the plan says so, and reports
//! the result to the scheduler. No policy lives here.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::scheduler::SchedulerMsg;
use crate::backend::{Backend, SeqStep};
use crate::sampling::{PenaltyState, SamplingParams};
use crate::sched::SeqId;
use crate::spec::step::{sample_with_drafts, StepTokens};

/// What to sample for a sequence whose chunk ends at its last known token.
#[derive(Clone, Debug)]
pub struct SampleSpec {
    pub params: Arc<SamplingParams>,
    /// Index of the token being generated (the counter of the seeded draw).
    pub step: u64,
    /// Penalty history; `None` when the params use no penalties.
    pub penalties: Option<Arc<PenaltyState>>,
}

/// One sequence's share of a step, as plain data.
#[derive(Clone, Debug)]
pub struct PlanSeq {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub block_table: Vec<u32>,
    /// Recurrent-state slot (see `SeqStep::state_slot`).
    pub state_slot: u32,
    /// Trailing draft tokens in `tokens` to verify (0 without speculative decoding).
    pub num_draft: usize,
    pub sample: Option<SampleSpec>,
}

/// Everything an executor needs to run one step.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub step_id: u64,
    pub seqs: Vec<PlanSeq>,
}

#[derive(Debug)]
pub struct StepResult {
    pub step_id: u64,
    /// Emitted tokens per sequence that asked for them, in plan order: one without drafts;
    /// accepted drafts plus the target's next token with them.
    pub sampled: Vec<(SeqId, StepTokens)>,
    pub elapsed: Duration,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Set when the backend failed; the step produced nothing.
    pub error: Option<String>,
}

pub enum ExecutorMsg {
    Run(StepPlan),
}

pub struct ExecutorActor;

pub struct ExecutorArgs {
    /// Builds the backend on the executor thread (loading weights can take a while, and
    /// device contexts belong to the thread that uses them).
    pub make_backend: Box<dyn FnOnce() -> Result<Box<dyn Backend>, String> + Send>,
    pub scheduler: ActorRef<SchedulerMsg>,
    pub rank: usize,
}

pub struct ExecutorState {
    jobs: Option<std::sync::mpsc::Sender<StepPlan>>,
    thread: Option<JoinHandle<()>>,
}

fn run_plan(backend: &mut dyn Backend, plan: &StepPlan) -> StepResult {
    let start = Instant::now();
    let steps: Vec<SeqStep<'_>> = plan
        .seqs
        .iter()
        .map(|s| SeqStep {
            tokens: &s.tokens,
            start_pos: s.start_pos,
            block_table: &s.block_table,
            logits_rows: if s.sample.is_some() { s.num_draft + 1 } else { 0 },
            state_slot: s.state_slot,
        })
        .collect();
    // A decode carries its last token plus drafts; anything else is prefill work.
    let is_decode = |s: &PlanSeq| s.sample.is_some() && s.tokens.len() == s.num_draft + 1;
    let prefill_tokens = plan.seqs.iter().filter(|s| !is_decode(s)).map(|s| s.tokens.len()).sum();
    let decode_tokens = plan.seqs.iter().filter(|s| is_decode(s)).map(|s| s.tokens.len()).sum();
    let mut result = StepResult {
        step_id: plan.step_id,
        sampled: Vec::new(),
        elapsed: Duration::ZERO,
        prefill_tokens,
        decode_tokens,
        error: None,
    };
    match backend.forward(&steps) {
        Ok(logits) => {
            for (i, s) in plan.seqs.iter().enumerate() {
                let Some(spec) = &s.sample else { continue };
                let rows: Vec<&[f32]> = logits.rows(i).collect();
                if rows.len() != s.num_draft + 1 {
                    result.error = Some(format!(
                        "backend returned {} logits rows for sequence {}, expected {}",
                        rows.len(),
                        s.seq,
                        s.num_draft + 1
                    ));
                    result.sampled.clear();
                    break;
                }
                let draft = &s.tokens[s.tokens.len() - s.num_draft..];
                let penalties: Option<&PenaltyState> = spec.penalties.as_deref();
                result.sampled.push((s.seq, sample_with_drafts(&rows, draft, &spec.params, penalties, spec.step)));
            }
        }
        Err(e) => result.error = Some(e.to_string()),
    }
    result.elapsed = start.elapsed();
    result
}

impl Actor for ExecutorActor {
    type Msg = ExecutorMsg;
    type State = ExecutorState;
    type Arguments = ExecutorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: ExecutorArgs,
    ) -> Result<ExecutorState, ActorProcessingErr> {
        let (tx, rx) = std::sync::mpsc::channel::<StepPlan>();
        let scheduler = args.scheduler.clone();
        let rank = args.rank;
        let make = args.make_backend;
        // The compute thread blocks on its channel when idle: no polling.
        let thread = std::thread::Builder::new().name(format!("shelfserve-exec-{rank}")).spawn(move || {
            let mut backend = match make() {
                Ok(b) => {
                    let _ = scheduler.cast(SchedulerMsg::ExecutorReady { rank, kv: b.kv_geometry() });
                    b
                }
                Err(e) => {
                    tracing::error!(rank, error = %e, "executor failed to load the model");
                    let _ = scheduler.cast(SchedulerMsg::ExecutorFailed { rank, error: e });
                    return;
                }
            };
            while let Ok(plan) = rx.recv() {
                let result = run_plan(backend.as_mut(), &plan);
                if scheduler.cast(SchedulerMsg::StepDone(result)).is_err() {
                    break;
                }
            }
        })?;
        Ok(ExecutorState { jobs: Some(tx), thread: Some(thread) })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: ExecutorMsg,
        state: &mut ExecutorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ExecutorMsg::Run(plan) => {
                let jobs = state.jobs.as_ref().ok_or("executor thread is gone")?;
                jobs.send(plan).map_err(|_| "executor thread is gone")?;
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut ExecutorState,
    ) -> Result<(), ActorProcessingErr> {
        // Closing the channel ends the thread after its current step.
        state.jobs.take();
        if let Some(t) = state.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        Ok(())
    }
}
