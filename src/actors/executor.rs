//! `ExecutorActor`: one per rank. It owns a backend (device, weights, KV memory) on a dedicated OS
//! thread, runs exactly the `StepPlan` it is sent, samples where the plan says so (rank 0 only:
//! under tensor parallelism every rank runs the same plan in lockstep, joined by the backend's
//! collectives, and the others report only success or failure), and reports the result to the
//! scheduler. No policy lives here.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

pub use super::encoders::EncoderCache;
use super::encoders::{encode_step_images, StepEmbeds};
use super::handle::PromptImage;
use super::previous_samples::PreviousSamples;
use super::rank_pages::SliceReport;
use super::rank_state::VerifiedSlot;
use super::scheduler::SchedulerMsg;
use super::spill::SpillMsg;
use super::workspace_probe::measure_workspace;
pub use super::workspace_probe::WorkspaceProbe;
use super::yielding;
use crate::backend::{Backend, DeviceSampleSpec, EmbeddedRows, HiddenTaps, SeqStep, StepLogits};
use crate::kv::{EvictedPage, PageHash, SlotSnapshot};
use crate::sampling::{PenaltyState, SamplingParams};
use crate::sched::SeqId;
use crate::spec::step::{sample_with_drafts, StepTokens};
use crate::spec::HiddenChunk;
use crate::structured::{apply_mask, PendingMasks};

/// What to sample for a sequence whose chunk ends at its last known token.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SampleSpec {
    pub params: Arc<SamplingParams>,
    /// Index of the token being generated (the counter of the seeded draw).
    pub step: u64,
    /// Penalty history; `None` when the params use no penalties.
    pub penalties: Option<Arc<PenaltyState>>,
    /// Structured output: the allowed-token masks of this step's rows, computed while the
    /// forward pass runs and joined just before sampling. Not sent to another process: only
    /// rank 0 samples, and rank 0 is always the head's own executor.
    #[serde(skip)]
    pub grammar: Option<Arc<PendingMasks>>,
}

/// One sequence's share of a step, as plain data.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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
    /// Page boundaries of a hybrid model that this step reaches, as token counts into the step
    /// (ascending): the recurrent state after each is read for that page's snapshot. One inside
    /// the step is marked on the backend before the forward; one at the step's end is the slot
    /// afterwards (a verify run: only if every draft was accepted).
    pub snapshot_after: Vec<usize>,
    /// The prompt's images whose placeholder rows this step's tokens cover (all or part of
    /// them): the executor encodes them (or finds them in its encoder cache) and feeds their
    /// embeddings in place of those rows.
    pub images: Vec<PromptImage>,
    /// A lookahead row (`sched::lookahead`): its one token is a placeholder for the token the
    /// executor's previous step sampled for this sequence, put in just before the step runs.
    pub follows_previous: bool,
}

impl PlanSeq {
    /// The backend's view of this row: logits for the sampled position and every draft, none
    /// for a prefill chunk that does not end its prompt.
    pub(super) fn seq_step(&self) -> SeqStep<'_> {
        SeqStep {
            tokens: &self.tokens,
            start_pos: self.start_pos,
            block_table: &self.block_table,
            logits_rows: if self.sample.is_some() { self.num_draft + 1 } else { 0 },
            state_slot: self.state_slot,
        }
    }
}

/// Everything an executor needs to run one step.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StepPlan {
    pub step_id: u64,
    pub seqs: Vec<PlanSeq>,
    /// Present when the step carries lower-lane prefill (maybe with their decodes) and may give way to a higher lane
    /// (`sched::yielding`): the scheduler raises it, and a backend that can yield stops the step at
    /// the next layer boundary, reported as `StepResult::suspended_after`; `ExecutorMsg::Resume`
    /// continues it. Not sent to another process: only a lone rank 0 yields.
    #[serde(skip)]
    pub yield_signal: Option<Arc<AtomicBool>>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct StepResult {
    pub step_id: u64,
    /// The tensor-parallel rank that ran it (0 without tensor parallelism).
    pub rank: usize,
    /// Emitted tokens per sequence that asked for them, in plan order: one without drafts;
    /// accepted drafts plus the target's next token with them.
    pub sampled: Vec<(SeqId, StepTokens)>,
    pub elapsed: Duration,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Set when the backend failed; the step produced nothing.
    pub error: Option<String>,
    /// Recurrent state at the page boundary each `PlanSeq::snapshot` sequence reached (for the pool).
    pub snapshots: Vec<SlotSnapshot>,
    /// The target's tapped hidden states of the tokens each sequence kept this step (every token
    /// of a prefill chunk; the last known token and the accepted drafts of a verification), when
    /// the backend taps layers for a drafter (`Backend::set_hidden_taps`). Rank 0 only.
    pub hidden: Vec<(SeqId, HiddenChunk)>,
    /// Sequences left out of the step because one of their images failed to encode, with the
    /// reason: their requests fail (400); the rest of the step ran.
    pub rejected: Vec<(SeqId, String)>,
    /// The step stopped after this decoder layer to give way (`StepPlan::yield_signal`): nothing
    /// was sampled, the executor keeps it until `ExecutorMsg::Resume`.
    pub suspended_after: Option<usize>,
    /// The verifications rank 0 committed (slot, tokens kept): ranks in other executors roll
    /// their slices of those slots back the same way (`ExecutorMsg::CommitVerified`).
    pub verified: Vec<VerifiedSlot>,
}

impl StepResult {
    /// A step that produced nothing because of `error`.
    pub fn failed(step_id: u64, rank: usize, error: String) -> Self {
        StepResult {
            step_id,
            rank,
            sampled: Vec::new(),
            elapsed: Duration::ZERO,
            prefill_tokens: 0,
            decode_tokens: 0,
            error: Some(error),
            snapshots: Vec::new(),
            hidden: Vec::new(),
            rejected: Vec::new(),
            suspended_after: None,
            verified: Vec::new(),
        }
    }
}

/// Crosses processes (`cluster::wire`): a worker's executor is a remote actor of the head.
pub enum ExecutorMsg {
    Run(StepPlan),
    /// Continue the suspended step `step_id` (see `StepPlan::yield_signal`) from the layer after
    /// the one it stopped at; it reports `StepDone` like any step.
    Resume {
        step_id: u64,
    },
    /// Copy evicted pages out of KV memory (KV image + recurrent snapshot, one unit each) and send
    /// them to the spill tier. Queued before any step that may reuse their blocks (the KV pool
    /// sends it before answering the scheduler), and run in order with steps.
    ReadPages {
        pages: Vec<EvictedPage>,
        spill: ActorRef<SpillMsg>,
        /// A drained shutdown's flush: after the pages, ask the spill tier to sync and answer
        /// here (the spill tier gets the request after every page, from this same thread).
        sync: Option<ractor::RpcReplyPort<bool>>,
    },
    /// The ranks of a group in executors of their own (`actors::rank_pages`): copy this rank's
    /// slice of each page (`(hash, blocks)`) out of KV memory and report each to the scheduler
    /// (`SchedulerMsg::PageSlices`, for the spill tier's join), then `SliceReport::Done` for the
    /// batch. Sent by the KV pool to every rank, for evicted pages before it answers the scheduler
    /// (so before any step that may reuse their blocks) and for a drained shutdown's flush; run in
    /// order with steps. Crosses processes (the report goes to the scheduler, which every executor
    /// has, so nothing local travels).
    ReadSlices {
        batch: u64,
        pages: Vec<(PageHash, Vec<u32>)>,
    },
    /// A prefix hit on a hybrid model: put the last hit page's recurrent-state snapshot into the
    /// sequence's slot (sent by the KV pool before it answers the scheduler, so it runs before the
    /// sequence's next step).
    WriteState {
        slot: u32,
        image: Arc<[u8]>,
    },
    /// Write a restored page image into `blocks` (sent by the spill tier before it tells the pool
    /// the page is back, so it runs before any step that reads it).
    WritePage {
        hash: PageHash,
        blocks: Vec<u32>,
        image: bytes::Bytes,
    },
    /// To a rank other than 0 in its own executor: step `step_id`'s verifications as rank 0
    /// committed them (only rank 0 samples, so only it knows the accepted lengths). Sent by the
    /// scheduler as soon as the step's result is in, so it runs before anything that step's
    /// result leads to (a state write, the next step). A failed commit fails the next step.
    CommitVerified {
        step_id: u64,
        slots: Vec<VerifiedSlot>,
    },
}

/// Work for the compute thread, in arrival order.
enum Job {
    Step(StepPlan),
    Resume(u64),
    Read(Vec<EvictedPage>, ActorRef<SpillMsg>, Option<ractor::RpcReplyPort<bool>>),
    ReadSlices(u64, Vec<(PageHash, Vec<u32>)>),
    Write(PageHash, Vec<u32>, bytes::Bytes),
    WriteState(u32, Arc<[u8]>),
    CommitVerified(u64, Vec<VerifiedSlot>),
}

pub struct ExecutorActor;

/// Images whose vision-tower output the compute thread keeps (see [`EncoderCache`]).
const ENCODER_CACHE_IMAGES: usize = 16;

pub struct ExecutorArgs {
    /// Builds the backend on the executor thread (loading weights can take a while, and
    /// device contexts belong to the thread that uses them).
    pub make_backend: Box<dyn FnOnce() -> Result<Box<dyn Backend>, String> + Send>,
    pub scheduler: ActorRef<SchedulerMsg>,
    pub rank: usize,
    /// A profiling step to run once the weights are loaded, before the rank reports ready
    /// (CUDA, one rank): measures the step workspace the KV pool was sized around.
    pub workspace_probe: Option<WorkspaceProbe>,
    /// The cluster group of a worker's rank (`cluster::worker`): the executor joins its rank's
    /// process group before it loads, so the head finds it when its ready report arrives.
    pub group: Option<String>,
}

pub struct ExecutorState {
    /// To the compute thread: flume, whose sender never blocks the actor and whose receiver
    /// blocks the thread when idle (no polling).
    jobs: Option<flume::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// Run `plan` on `backend`. Images are encoded first; the sequences whose images fail to encode
/// are left out of the step and reported in `StepResult::rejected`, the others run.
pub(super) fn run_plan(
    backend: &mut dyn Backend,
    plan: &StepPlan,
    rank: usize,
    encoders: &mut EncoderCache,
) -> StepResult {
    if plan.seqs.iter().all(|s| s.images.is_empty()) {
        return run_encoded(backend, plan, rank, None);
    }
    let start = Instant::now();
    let (embeds, rejected) = encode_step_images(backend, plan, encoders);
    if rejected.is_empty() {
        return run_encoded(backend, plan, rank, Some(embeds));
    }
    for (seq, why) in &rejected {
        tracing::warn!(seq, error = %why, "an image failed to encode: its request fails alone");
    }
    let keep: Vec<bool> = plan.seqs.iter().map(|s| !rejected.iter().any(|(id, _)| *id == s.seq)).collect();
    let kept = StepPlan {
        step_id: plan.step_id,
        yield_signal: None,
        seqs: plan.seqs.iter().zip(&keep).filter(|(_, k)| **k).map(|(s, _)| s.clone()).collect(),
    };
    let embeds: StepEmbeds = embeds.into_iter().zip(&keep).filter(|(_, k)| **k).map(|(e, _)| e).collect();
    let mut result = if kept.seqs.is_empty() {
        StepResult {
            step_id: plan.step_id,
            rank,
            sampled: Vec::new(),
            elapsed: start.elapsed(),
            prefill_tokens: 0,
            decode_tokens: 0,
            error: None,
            snapshots: Vec::new(),
            hidden: Vec::new(),
            rejected: Vec::new(),
            suspended_after: None,
            verified: Vec::new(),
        }
    } else {
        run_encoded(backend, &kept, rank, Some(embeds))
    };
    result.rejected = rejected;
    result
}

/// Run `plan` on `backend` with its images already encoded (`encoded`: per sequence, the runs of
/// rows that take image embeddings); rank 0 samples, the other ranks only run the forward pass.
fn run_encoded(backend: &mut dyn Backend, plan: &StepPlan, rank: usize, encoded: Option<StepEmbeds>) -> StepResult {
    let start = Instant::now();
    let steps: Vec<SeqStep<'_>> = plan.seqs.iter().map(PlanSeq::seq_step).collect();
    // A decode carries its last token plus drafts; anything else is prefill work.
    let is_decode = |s: &PlanSeq| s.sample.is_some() && s.tokens.len() == s.num_draft + 1;
    let prefill_tokens = plan.seqs.iter().filter(|s| !is_decode(s)).map(|s| s.tokens.len()).sum();
    let decode_tokens = plan.seqs.iter().filter(|s| is_decode(s)).map(|s| s.tokens.len()).sum();
    let mut result = StepResult {
        step_id: plan.step_id,
        rank,
        sampled: Vec::new(),
        elapsed: Duration::ZERO,
        prefill_tokens,
        decode_tokens,
        error: None,
        snapshots: Vec::new(),
        hidden: Vec::new(),
        rejected: Vec::new(),
        suspended_after: None,
        verified: Vec::new(),
    };
    // Sequences verifying drafts ask the backend to keep per-token recurrent state, and are
    // committed to their accepted length right after sampling (a no-op without recurrent state).
    // Only rank 0 samples, so only it knows the accepted length: in one process a model with
    // recurrent state runs its whole group in one executor (`generate::rank_backend_makers`);
    // ranks in other processes are sent rank 0's commits (`StepResult::verified`).
    let verify: Vec<bool> = plan.seqs.iter().map(|s| s.num_draft > 0 && s.sample.is_some()).collect();
    // Page ends strictly inside a chunk: the backend keeps the state there during the forward.
    let marked: Vec<(&PlanSeq, Vec<usize>)> = plan
        .seqs
        .iter()
        .map(|s| (s, s.snapshot_after.iter().copied().filter(|&k| k > 0 && k < s.tokens.len()).collect::<Vec<_>>()))
        .filter(|(s, inside)| !inside.is_empty() && s.num_draft == 0)
        .filter(|(s, inside)| match backend.mark_state_snapshots(s.state_slot, inside) {
            Ok(()) => true,
            // Those pages are then not published (recomputed on a later hit), nothing worse.
            Err(e) => {
                tracing::warn!(seq = s.seq, error = %e, "could not mark recurrent-state snapshots inside a step");
                false
            }
        })
        .collect();
    // Without drafts, rank 0 first offers the backend to sample on its device (only ids cross
    // back); a backend that samples on the host answers `None` having run nothing. Grammar masks
    // are applied to host logits, so a step with a constrained sequence samples on the host.
    let constrained = plan.seqs.iter().any(|s| s.sample.as_ref().is_some_and(|spec| spec.grammar.is_some()));
    // Image rows take the vision tower's embeddings, on the host path (`forward_embedded`).
    let embeds: Vec<Vec<EmbeddedRows<'_>>> = encoded
        .iter()
        .flatten()
        .map(|runs| {
            runs.iter()
                .map(|(first_row, e, from, rows)| EmbeddedRows {
                    first_row: *first_row,
                    hidden: e.hidden,
                    data: &e.data[from * e.hidden..(from + rows) * e.hidden],
                })
                .collect()
        })
        .collect();
    if rank == 0 && !verify.contains(&true) && !constrained && encoded.is_none() {
        match sample_on_device(backend, &steps, plan) {
            Ok(Some(sampled)) => result.sampled = sampled,
            Ok(None) => sample_on_host(backend, &steps, &verify, &embeds, plan, rank, &mut result),
            Err(e) => result.error = Some(e),
        }
    } else {
        sample_on_host(backend, &steps, &verify, &embeds, plan, rank, &mut result);
    }
    if let Some(taps) = backend.take_hidden_taps().filter(|_| rank == 0 && result.error.is_none()) {
        result.hidden = kept_hidden(&taps, plan, &result.sampled);
    }
    // A verify run's state is at its end only when all its drafts were accepted; otherwise the
    // page it would have completed stays unpublished (recomputed on a later hit). A rank other than
    // 0 cannot know yet (its commit comes later): its slot is still at the step's end, and the
    // scheduler keeps its slice only beside a rank 0 snapshot (`rank_state::StateParts::join`).
    let reached_end = |s: &PlanSeq| {
        rank != 0
            || s.num_draft == 0
            || result.sampled.iter().any(|(seq, e)| *seq == s.seq && e.accepted == s.num_draft)
    };
    for (s, inside) in marked {
        let images = backend.take_state_snapshots(s.state_slot);
        if result.error.is_some() {
            continue;
        }
        if images.len() != inside.len() {
            tracing::warn!(seq = s.seq, marked = inside.len(), got = images.len(), "recurrent-state snapshots missing");
            continue;
        }
        for (k, image) in inside.into_iter().zip(images) {
            result.snapshots.push(SlotSnapshot { seq: s.seq, tokens: s.start_pos + k, image: image.into() });
        }
    }
    let at_end = |s: &PlanSeq| !s.tokens.is_empty() && s.snapshot_after.last() == Some(&s.tokens.len());
    let snapshot_seqs: Vec<&PlanSeq> =
        plan.seqs.iter().filter(|s| at_end(s) && result.error.is_none() && reached_end(s)).collect();
    for s in snapshot_seqs {
        match backend.read_state_slot(s.state_slot) {
            Ok(image) => {
                let tokens = s.start_pos + s.tokens.len();
                result.snapshots.push(SlotSnapshot { seq: s.seq, tokens, image: image.into() });
            }
            // The page is then not published (recomputed on a later hit), nothing worse.
            Err(e) => tracing::warn!(seq = s.seq, error = %e, "could not snapshot the recurrent state at a page end"),
        }
    }
    result.elapsed = start.elapsed();
    result
}

/// Each sequence's tapped states for the tokens it kept: a verification keeps the last known token
/// and its accepted drafts (rejected drafts' states are never handed on); anything else all rows.
fn kept_hidden(taps: &HiddenTaps, plan: &StepPlan, sampled: &[(SeqId, StepTokens)]) -> Vec<(SeqId, HiddenChunk)> {
    plan.seqs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let kept = if s.num_draft > 0 && s.sample.is_some() {
                sampled.iter().find(|(id, _)| *id == s.seq).map_or(0, |(_, e)| e.accepted + 1)
            } else {
                s.tokens.len()
            };
            (s.seq, HiddenChunk::from_taps(taps, i, s.start_pos, kept))
        })
        .filter(|(_, c)| !c.data.is_empty())
        .collect()
}

/// Device sampling for a step without drafts: `Ok(None)` when the backend samples on the host.
fn sample_on_device(
    backend: &mut dyn Backend,
    steps: &[SeqStep<'_>],
    plan: &StepPlan,
) -> Result<Option<Vec<(SeqId, StepTokens)>>, String> {
    let specs: Vec<Option<DeviceSampleSpec<'_>>> = plan
        .seqs
        .iter()
        .map(|s| {
            s.sample.as_ref().map(|spec| DeviceSampleSpec {
                params: &spec.params,
                penalties: spec.penalties.as_deref(),
                step: spec.step,
            })
        })
        .collect();
    let Some(drawn) = backend.forward_sampled(steps, &specs).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let mut sampled = Vec::new();
    for (s, d) in plan.seqs.iter().zip(drawn) {
        match (&s.sample, d) {
            (Some(_), Some(token)) => {
                sampled.push((s.seq, StepTokens { tokens: vec![token], drafted: 0, accepted: 0 }))
            }
            (Some(_), None) => return Err(format!("the backend sampled nothing for sequence {}", s.seq)),
            (None, _) => {}
        }
    }
    Ok(Some(sampled))
}

/// The host path: the backend returns logits rows and rank 0 samples them (and verifies drafts).
fn sample_on_host(
    backend: &mut dyn Backend,
    steps: &[SeqStep<'_>],
    verify: &[bool],
    embeds: &[Vec<EmbeddedRows<'_>>],
    plan: &StepPlan,
    rank: usize,
    result: &mut StepResult,
) {
    let forward = if embeds.iter().any(|e| !e.is_empty()) {
        backend.forward_embedded(steps, verify, embeds)
    } else if verify.contains(&true) {
        backend.forward_verify(steps, verify)
    } else {
        backend.forward(steps)
    };
    match forward {
        Ok(logits) => sample_logits(backend, &logits, plan, rank, result),
        Err(e) => result.error = Some(e.to_string()),
    }
}

/// Rank 0 samples the step's logits rows (and verifies drafts) into `result`; other ranks only ran
/// the forward pass.
pub(super) fn sample_logits(
    backend: &mut dyn Backend,
    logits: &StepLogits,
    plan: &StepPlan,
    rank: usize,
    result: &mut StepResult,
) {
    if rank != 0 {
        return;
    }
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
        let emitted = match &spec.grammar {
            None => sample_with_drafts(&rows, draft, &spec.params, penalties, spec.step),
            Some(pending) => {
                let masked = masked_rows(&rows, pending);
                let masked: Vec<&[f32]> = masked.iter().map(Vec::as_slice).collect();
                sample_with_drafts(&masked, draft, &spec.params, penalties, spec.step)
            }
        };
        if s.num_draft > 0 {
            let kept = emitted.accepted + 1;
            if let Err(e) = backend.commit_verified(s.state_slot, kept) {
                result.error = Some(format!("rolling back sequence {} after verification: {e}", s.seq));
                result.sampled.clear();
                result.verified.clear();
                break;
            }
            result.verified.push(VerifiedSlot { slot: s.state_slot, kept });
        }
        result.sampled.push((s.seq, emitted));
    }
}

/// The rows with every token the grammar forbids at that position set to -inf (greedy, sampled
/// and verified rows alike; logprobs are then those of the constrained distribution).
fn masked_rows(rows: &[&[f32]], pending: &PendingMasks) -> Vec<Vec<f32>> {
    let masks = pending.wait(rows.len());
    rows.iter()
        .zip(masks)
        .map(|(row, mask)| {
            let mut row = row.to_vec();
            if let Some(mask) = mask {
                apply_mask(&mask, &mut row);
            }
            row
        })
        .collect()
}

fn send(state: &ExecutorState, job: Job) -> Result<(), ActorProcessingErr> {
    let jobs = state.jobs.as_ref().ok_or("executor thread is gone")?;
    jobs.send(job).map_err(|_| "executor thread is gone")?;
    Ok(())
}

/// Copies evicted pages out and hands them to the spill tier. A page's image is its blocks' KV
/// image followed by its recurrent-state snapshot (hybrid models; the pool kept it in host memory),
/// so the two are stored, checked and restored as one unit.
fn read_pages(backend: &mut dyn Backend, pages: Vec<EvictedPage>, spill: &ActorRef<SpillMsg>) {
    // The copies out run beside the next steps; each image goes to the spill tier when ready.
    for EvictedPage { hash, parent, blocks, snapshot } in pages {
        let spill = spill.clone();
        backend.read_kv_blocks_then(
            &blocks,
            Box::new(move |read| match read {
                Ok(mut image) => {
                    if let Some(s) = snapshot {
                        image.extend_from_slice(&s);
                    }
                    let _ = spill.cast(SpillMsg::Store { hash, parent, image });
                }
                Err(e) => {
                    tracing::warn!(page = %hash.to_hex(), error = %e, "could not read an evicted page to spill it")
                }
            }),
        );
    }
}

/// This rank's slices of a batch of pages, each reported to the scheduler when copied out (on a
/// device backend, from its completion thread), then the batch's end: sent by whichever copy
/// finishes last, after its own slice, so it follows every slice of the batch.
fn read_slices(
    backend: &mut dyn Backend,
    rank: usize,
    batch: u64,
    pages: Vec<(PageHash, Vec<u32>)>,
    scheduler: &ActorRef<SchedulerMsg>,
) {
    if pages.is_empty() {
        let _ = scheduler.cast(SchedulerMsg::PageSlices(SliceReport::Done { rank, batch }));
        return;
    }
    let left = Arc::new(std::sync::atomic::AtomicUsize::new(pages.len()));
    for (index, (hash, blocks)) in pages.into_iter().enumerate() {
        let (scheduler, left) = (scheduler.clone(), Arc::clone(&left));
        backend.read_kv_blocks_then(
            &blocks,
            Box::new(move |read| {
                let image = read.map_err(|e| {
                    tracing::warn!(rank, page = %hash.to_hex(), error = %e, "could not read this rank's slice of an evicted page");
                    e.to_string()
                });
                // A slice that cannot be sent (too large a message) is missing from the join, which
                // then drops the page when this batch ends.
                if let Err(e) = scheduler.cast(SchedulerMsg::PageSlices(SliceReport::Page { rank, batch, index, hash, image })) {
                    tracing::warn!(rank, page = %hash.to_hex(), error = %e, "could not send this rank's slice of an evicted page");
                }
                if left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                    let _ = scheduler.cast(SchedulerMsg::PageSlices(SliceReport::Done { rank, batch }));
                }
            }),
        );
    }
}

impl Actor for ExecutorActor {
    type Msg = ExecutorMsg;
    type State = ExecutorState;
    type Arguments = ExecutorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: ExecutorArgs,
    ) -> Result<ExecutorState, ActorProcessingErr> {
        if let Some(group) = &args.group {
            ractor::pg::join(crate::cluster::executor_group(group, args.rank), vec![myself.get_cell()]);
        }
        let (tx, rx) = flume::unbounded::<Job>();
        let scheduler = args.scheduler.clone();
        // Sent with `ExecutorReady`: a model that loads quickly may be ready before the scheduler
        // was told which executor it has.
        let me = myself.clone();
        let rank = args.rank;
        let make = args.make_backend;
        let probe = args.workspace_probe;
        // The compute thread blocks on its channel when idle: no polling.
        let thread = std::thread::Builder::new().name(format!("shelfserve-exec-{rank}")).spawn(move || {
            let loading = std::time::Instant::now();
            let mut backend = match make() {
                Ok(mut b) => {
                    tracing::info!(rank, seconds = format!("{:.2}", loading.elapsed().as_secs_f64()), "model loaded");
                    if let Some(p) = probe {
                        measure_workspace(b.as_mut(), p, rank);
                    }
                    let _ = scheduler.cast(SchedulerMsg::ExecutorReady {
                        rank,
                        kv: b.kv_geometry(),
                        kv_block_bytes: b.kv_block_bytes(),
                        state_slot_bytes: b.state_slot_bytes(),
                        snapshots_inside_step: b.snapshots_inside_step(),
                        executor: Some(me),
                    });
                    b
                }
                Err(e) => {
                    tracing::error!(rank, error = %e, "executor failed to load the model");
                    let _ = scheduler.cast(SchedulerMsg::ExecutorFailed { rank, error: e });
                    return;
                }
            };
            let mut encoders = EncoderCache::new(ENCODER_CACHE_IMAGES);
            let mut previous = PreviousSamples::default();
            // The step that stopped at a layer boundary to give way, until resumed.
            let mut suspended: Option<StepPlan> = None;
            // A commit of rank 0's verifications that failed here: this rank's state is no longer
            // the group's, so the next step fails (loudly, naming why) instead of computing from it.
            let mut commit_failed: Option<String> = None;
            while let Ok(job) = rx.recv() {
                match job {
                    Job::Step(mut plan) => {
                        let filled = match commit_failed.take() {
                            Some(e) => Err(e),
                            None => previous.fill(&mut plan),
                        };
                        let result = match filled {
                            Err(e) => StepResult::failed(plan.step_id, rank, e),
                            // A panicking backend must still answer, or the scheduler waits forever.
                            Ok(()) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                if yielding::yields(backend.as_ref(), &plan, rank) && suspended.is_none() {
                                    yielding::run(backend.as_mut(), &plan, rank, false)
                                } else {
                                    run_plan(backend.as_mut(), &plan, rank, &mut encoders)
                                }
                            }))
                            .unwrap_or_else(|_| {
                                let error = format!("the backend of rank {rank} panicked");
                                backend.abort_collectives(&error);
                                StepResult::failed(plan.step_id, rank, error)
                            }),
                        };
                        previous.record(&result);
                        if result.suspended_after.is_some() {
                            suspended = Some(plan);
                        }
                        if scheduler.cast(SchedulerMsg::StepDone(result)).is_err() {
                            break;
                        }
                    }
                    Job::Resume(step_id) => {
                        let result = match suspended.take() {
                            Some(plan) if plan.step_id == step_id => {
                                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    yielding::run(backend.as_mut(), &plan, rank, true)
                                }))
                                .unwrap_or_else(|_| {
                                    backend.drop_suspended();
                                    StepResult::failed(step_id, rank, format!("the backend of rank {rank} panicked"))
                                });
                                if result.suspended_after.is_some() {
                                    suspended = Some(plan);
                                }
                                result
                            }
                            other => {
                                suspended = other;
                                StepResult::failed(step_id, rank, format!("step {step_id} is not suspended here"))
                            }
                        };
                        previous.record(&result);
                        if scheduler.cast(SchedulerMsg::StepDone(result)).is_err() {
                            break;
                        }
                    }
                    Job::Read(pages, spill, sync) => {
                        let (started, count) = (Instant::now(), pages.len());
                        read_pages(backend.as_mut(), pages, &spill);
                        tracing::debug!(pages = count, micros = started.elapsed().as_micros() as u64, "evicted pages queued");
                        if let Some(reply) = sync {
                            // Every image is at the spill tier before it is asked to sync.
                            if let Err(e) = backend.finish_kv_reads() {
                                tracing::error!(error = %e, "copying pages out for the drained shutdown failed");
                            }
                            let _ = spill.cast(SpillMsg::Sync(reply));
                        }
                    }
                    Job::ReadSlices(batch, pages) => read_slices(backend.as_mut(), rank, batch, pages, &scheduler),
                    Job::Write(hash, blocks, image) => {
                        let started = Instant::now();
                        if let Err(e) = backend.write_kv_blocks(&blocks, &image) {
                            // The spill tier checked the image's size; this is a device failure.
                            tracing::error!(page = %hash.to_hex(), error = %e, "restoring a spilled page failed");
                        }
                        tracing::debug!(page = %hash.to_hex(), micros = started.elapsed().as_micros() as u64, "restored page queued");
                    }
                    Job::CommitVerified(step_id, slots) => {
                        for v in slots {
                            if let Err(e) = backend.commit_verified(v.slot, v.kept) {
                                tracing::error!(rank, step_id, slot = v.slot, error = %e, "rank 0's verification commit failed here");
                                commit_failed.get_or_insert_with(|| {
                                    format!("rank {rank} could not roll back slot {} after step {step_id}: {e}", v.slot)
                                });
                            }
                        }
                    }
                    Job::WriteState(slot, image) => {
                        // The glm5 backend checks that a continued slot holds the state of the step's
                        // start position, so a failed write normally fails the next step loudly.
                        if let Err(e) = backend.write_state_slot(slot, &image) {
                            tracing::error!(slot, error = %e, "restoring a recurrent-state snapshot failed");
                        }
                    }
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
            ExecutorMsg::Run(plan) => send(state, Job::Step(plan))?,
            ExecutorMsg::Resume { step_id } => send(state, Job::Resume(step_id))?,
            ExecutorMsg::ReadPages { pages, spill, sync } => send(state, Job::Read(pages, spill, sync))?,
            ExecutorMsg::ReadSlices { batch, pages } => send(state, Job::ReadSlices(batch, pages))?,
            ExecutorMsg::WritePage { hash, blocks, image } => send(state, Job::Write(hash, blocks, image))?,
            ExecutorMsg::WriteState { slot, image } => send(state, Job::WriteState(slot, image))?,
            ExecutorMsg::CommitVerified { step_id, slots } => send(state, Job::CommitVerified(step_id, slots))?,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_seq(seq: SeqId, tokens: Vec<u32>, start_pos: usize, num_draft: usize, sample: bool) -> PlanSeq {
        PlanSeq {
            follows_previous: false,
            seq,
            tokens,
            start_pos,
            block_table: vec![0],
            state_slot: 0,
            num_draft,
            sample: sample.then(|| SampleSpec {
                params: Arc::new(SamplingParams::default()),
                step: 0,
                penalties: None,
                grammar: None,
            }),
            snapshot_after: Vec::new(),
            images: Vec::new(),
        }
    }

    #[test]
    fn only_kept_tokens_hidden_states_are_handed_on() {
        // Row r of the step holds the value r in every column (two layers of width 2).
        let taps = HiddenTaps {
            layers: vec![3, 5],
            hidden: 2,
            data: (0..9).flat_map(|r| [r as f32; 4]).collect(),
            offsets: vec![0, 3, 7, 9],
        };
        let plan = StepPlan {
            step_id: 1,
            yield_signal: None,
            seqs: vec![
                plan_seq(1, vec![10, 11, 12], 0, 0, false),     // a prefill chunk: every row
                plan_seq(2, vec![20, 21, 22, 23], 40, 3, true), // last token + 3 drafts, 1 accepted
                plan_seq(3, vec![30, 31], 8, 1, true),          // last token + 1 draft, all rejected
            ],
        };
        let emitted = |accepted| StepTokens { tokens: Vec::new(), drafted: 0, accepted };
        let sampled = vec![(2, emitted(1)), (3, emitted(0))];
        let kept = kept_hidden(&taps, &plan, &sampled);
        let rows = |c: &HiddenChunk| c.data.chunks(4).map(|r| r[0] as usize).collect::<Vec<_>>();
        assert_eq!(kept.len(), 3);
        assert_eq!((kept[0].0, kept[0].1.start_pos, rows(&kept[0].1)), (1, 0, vec![0, 1, 2]));
        assert_eq!((kept[1].0, kept[1].1.start_pos, rows(&kept[1].1)), (2, 40, vec![3, 4]));
        assert_eq!((kept[2].0, kept[2].1.start_pos, rows(&kept[2].1)), (3, 8, vec![7]));
        assert_eq!(&*kept[0].1.layers, &[3, 5]);
    }
}
