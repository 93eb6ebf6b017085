//! The scheduling planner: waiting queues per priority, the running set, the per-step token
//! budget, chunked prefill, draft tokens, and preemption when KV blocks run out. It does not own
//! the KV pool (`kv::KvPool`, behind the `KvPoolActor`): it plans against an exact *view* of the
//! pool (available blocks, and per sequence the blocks only it references) and commits each
//! step's pool work as one list of `PoolOp`s; the pool's reply (`PoolReply`) carries the block
//! tables, where each admitted sequence really starts (its prefix hit) and the next view. So
//! planning costs one request/reply round trip with the pool per step. `sched::Policy` composes a
//! `Planner` with a `KvPool` synchronously (tests, benches); the `SchedulerActor` does the same
//! through messages. The only way a sequence leaves is `remove_seq`, which releases it in the
//! pool, so a finished, aborted or preempted sequence can never leak blocks. Taking blocks,
//! making room, preemption, release and draft blocks are in `room.rs`; lookahead and yielding steps
//! in `lookahead.rs` and `yielding.rs`; a higher lane's decodes apart from lower prefill in
//! `lane_split.rs`.
//!
//! # Prefix hits
//! An admission is planned as if nothing were cached (a chunk from position 0); the pool looks
//! the prefix up when it applies the `Admit`, and the chunk then starts after the hit and is cut
//! to the tokens left. Prefill chunks are sized by the budget, not by pages: a chunk may cross page
//! boundaries, and the pool publishes every page it completes when its `Advance` arrives (a hybrid
//! model's backend snapshots the recurrent state at the page ends inside the chunk). Only with
//! `page_aligned_chunks` (a backend that can read the state only at a step's end) does a chunk stop
//! at the next page boundary, so every page end is a step end. If the
//! view turned out optimistic (sharing changed within the step) and the pool cannot grant a
//! sequence its blocks, that sequence sits this step out and is planned again next step.
//!
//! # Sequence state
//! A sequence's `tokens` are its prompt followed by everything generated so far; `num_computed`
//! counts the leading tokens whose KV is written. A running sequence always has at least one token
//! not yet computed: it is *decoding* when exactly one is left (the last sampled token, its next
//! input), and *prefilling* when more are left. A step gives a sequence the tokens
//! `num_computed..num_computed + n` at positions starting at `num_computed`; when that chunk reaches
//! the end of the known tokens the executor samples (`wants_logits`). Preemption frees the blocks
//! and resets `num_computed` to 0 but keeps the generated tokens; its finished pages stay cached,
//! so a resumed sequence starts after them (or re-prefills what was evicted) and continues exactly
//! where it stopped.
//!
//! # One step, in order
//! 1. Every running decoding sequence gets its one token (higher priority first, then admission
//!    order). `max_num_batched_tokens >= max_num_seqs` is enforced, so this always fits the budget:
//!    a decode never waits behind a long prefill.
//! 2. Prefill work, one priority level at a time (highest first): at each level, running sequences
//!    mid-prefill get their next chunk (admission order), then waiting sequences of that level are
//!    admitted (FIFO) while the budget and `max_num_seqs` allow. A chunk is whatever budget is left
//!    when it is bigger than that. Going level by level (rather than all running chunks before any
//!    admission) is what lets a high-priority request start at the next step while low-priority
//!    prefills would otherwise take the whole budget. Admission stops at the first waiting
//!    sequence that cannot be admitted, so nobody overtakes within a level.
//!    With lane pacing on (`set_pacing`), a level's prefill chunks are also capped by time: the
//!    step cost model predicts what the step planned so far costs, and a lower level's chunk gets
//!    only what is left of the cap that lanes above it set (`sched::pacing`); a running prefill
//!    whose allowance is 0 sits the step out at its chunk boundary (running, KV kept), and an
//!    admission whose allowance is 0 waits (nobody is preempted for it).
//! 3. Draft tokens (`set_draft`) of planned decodes, from whatever budget and free blocks are left.
//!    Drafts never preempt anyone and never displace prefill work.
//!
//! # Blocks and preemption
//! A planned chunk holds blocks for `start_pos + tokens.len()` positions. When the pool is short,
//! the sequence that needs room (the *needy* one) may preempt only sequences *behind* it in the
//! running order (priority descending, then admission ascending), always taking the last one
//! first: that is the lowest-priority, most recently admitted running sequence, and it is never of
//! higher priority than the needy one. Strictly lower-priority sequences are preempted for the full
//! chunk; sequences of the same priority (admitted later) only when the needy one could not
//! otherwise get even one token. If the room still is not there the chunk shrinks to what fits; if
//! not one token fits the needy sequence waits for this step without preempting anybody.
//! A waiting sequence counts as admitted after every running one, so it can only preempt strictly
//! lower priorities: a high-priority request takes a slot and blocks from lower-priority work,
//! while an equal-priority one waits its turn.
//!
//! A decode that cannot get a block and has nobody behind it to preempt **waits, keeping its
//! blocks; it never preempts itself.** Everyone ahead of it may still preempt it when they need
//! room, and whoever is first in the order can always preempt everybody else, while `add` refuses
//! sequences that could not fit in the whole pool; so the first sequence always progresses and the
//! system cannot deadlock. Self-preemption would only free blocks for sequences behind it, which
//! must not overtake it. A sequence preempted in a step is not re-admitted in that same step.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use super::cost::StepShape;
use super::pacing::{Pacing, StepCap};
use crate::kv::{PoolOp, PoolReply};

pub use super::types::{NewSeq, PlannedSeq, PolicyConfig, PolicyError, SeqId, SeqView, StepPlanOut};

/// Sequence ids are assigned by the engine, not chosen by clients, so a multiplicative hash is
/// enough here and several times cheaper than SipHash on the per-step path (the step-planning
/// bench measures it).
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

type IdMap<V> = HashMap<SeqId, V, BuildHasherDefault<IdHasher>>;

/// Position in the running order: higher priority first, then earlier admission. Preemption
/// victims come from the back of this order.
type RunKey = (Reverse<i32>, u64);

#[derive(Debug)]
struct Seq {
    priority: i32,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    num_computed: usize,
    /// Blocks its table holds (as of the last pool reply plus this step's plan).
    held: usize,
    /// Of those, the ones only it references: what preempting or ending it makes available.
    exclusive: usize,
    /// Blocks its cached prefix pinned when an admission was last refused for lack of room:
    /// reserved on top of its chunk the next time it is admitted.
    admit_extra: usize,
    /// Draft tokens for the next step only.
    draft: Vec<u32>,
    /// Admission number while running; `None` while waiting.
    admitted: Option<u64>,
    /// The step that last preempted it: it is not re-admitted within that step.
    preempted_at: Option<u64>,
    /// Steps in flight (planned and not yet done) that carry it: one, or two when a lookahead
    /// step continues it (`plan_lookahead`).
    in_flight: u8,
}

impl Seq {
    fn is_decode(&self) -> bool {
        self.tokens.len() == self.num_computed + 1
    }

    /// A decode not carried by a step in flight (only a suspended step's sequences are, while
    /// another step is planned).
    fn is_plannable_decode(&self) -> bool {
        self.is_decode() && self.in_flight == 0
    }
}

/// A sequence's share of the step being planned (turned into a `PlannedSeq` at the end) and,
/// after `plan_step`, of the step in flight.
#[derive(Debug)]
struct Planned {
    id: SeqId,
    start: usize,
    /// Known tokens in the chunk (drafts excluded).
    n_base: usize,
    wants_logits: bool,
    draft: Vec<u32>,
    /// Admitted by this step (its chunk moves past the prefix hit when the pool replies).
    admission: bool,
}

struct StepBuild {
    budget: usize,
    /// Planned by `plan_lookahead`: every chunk is one token the step in flight will sample.
    lookahead: bool,
    planned: Vec<Planned>,
    preempted: Vec<SeqId>,
}

impl StepBuild {
    /// What the step planned so far computes (admissions counted from position 0).
    fn shape(&self) -> StepShape {
        let mut shape = StepShape::default();
        for p in &self.planned {
            shape.add(p.start, p.n_base, p.wants_logits && p.n_base == 1);
            shape.add(p.start + p.n_base, p.draft.len(), false);
        }
        shape
    }
}

pub struct Planner {
    cfg: PolicyConfig,
    /// Blocks free or evictable, per the last pool view minus what planning has taken since.
    avail: usize,
    /// Pool work not yet sent: registrations, progress, releases, preemptions.
    pending: Vec<PoolOp>,
    /// Blocks that `pending` releases give back (counted in `avail` already; re-added when a
    /// reply's view, which predates them, replaces `avail`).
    pending_credit: usize,
    /// A planned step waiting for the pool's reply.
    awaiting: Option<StepBuild>,
    seqs: IdMap<Seq>,
    /// Sequences given a draft since the last plan (so planning need not scan everyone).
    with_draft: Vec<SeqId>,
    waiting: BTreeMap<Reverse<i32>, VecDeque<SeqId>>,
    /// Sorted by `RunKey`.
    running: Vec<(RunKey, SeqId)>,
    next_admission: u64,
    /// Counts planned steps; tags preemptions so they are not undone in the same step.
    step: u64,
    /// Steps dispatched and not yet done, oldest first: at most one, plus a lookahead step
    /// continuing it.
    in_flight: VecDeque<Vec<Planned>>,
    /// Lane latency targets and the step cost model that shrink lower lanes' prefill chunks
    /// (`sched::pacing`); `None` plans by the token budget alone.
    pacing: Option<Pacing>,
    /// Mark steps of lower-lane prefill yieldable (`sched::yielding`).
    yielding: bool,
    /// The yieldable step in flight or suspended, and cancellations that wait for it.
    yield_state: yielding::YieldState,
    /// Alternate a decoding higher lane's steps with lower lanes' prefill (`sched::lane_split`).
    separate_decodes: bool,
    split: lane_split::SplitState,
}

impl std::fmt::Debug for Planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner")
            .field("cfg", &self.cfg)
            .field("waiting", &self.num_waiting())
            .field("running", &self.running.len())
            .field("blocks_available", &self.avail)
            .field("in_flight", &self.in_flight.iter().map(Vec::len).collect::<Vec<_>>())
            .finish()
    }
}

impl Planner {
    pub fn new(cfg: PolicyConfig) -> Result<Self, PolicyError> {
        cfg.validate()?;
        Ok(Self {
            avail: cfg.num_blocks,
            pending: Vec::new(),
            pending_credit: 0,
            awaiting: None,
            cfg,
            seqs: IdMap::default(),
            with_draft: Vec::new(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            next_admission: 0,
            step: 0,
            in_flight: VecDeque::new(),
            pacing: None,
            yielding: false,
            yield_state: yielding::YieldState::default(),
            separate_decodes: false,
            split: lane_split::SplitState::default(),
        })
    }

    /// Turns lane pacing on (or off with `None`): from the next step, prefill below a lane with
    /// latency targets is sized by the step cost model (see `sched::pacing`).
    pub fn set_pacing(&mut self, pacing: Option<Pacing>) {
        self.pacing = pacing;
    }

    pub fn pacing(&self) -> Option<&Pacing> {
        self.pacing.as_ref()
    }

    /// A dispatched step of this shape took `secs` on the device: refits the step cost model.
    pub fn observe_step(&mut self, shape: &StepShape, secs: f64) {
        if let Some(p) = self.pacing.as_mut() {
            p.observe(shape, secs);
        }
    }

    /// Tokens a prefill chunk of a paced level may take, starting at `start`.
    fn paced_allowance(&self, cap: Option<&StepCap>, b: &StepBuild, start: usize) -> usize {
        match (cap, &self.pacing) {
            (Some(cap), Some(pacing)) => pacing.chunk_allowance(cap, &b.shape(), start),
            _ => usize::MAX,
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Blocks free or evictable as the planner sees them.
    pub fn blocks_available(&self) -> usize {
        self.avail
    }

    /// Pool work queued since the last commit (sent with the next step, or alone by a flush).
    pub fn take_pending(&mut self) -> Vec<PoolOp> {
        self.pending_credit = 0;
        std::mem::take(&mut self.pending)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// A planned step is waiting for the pool's reply.
    pub fn is_awaiting_pool(&self) -> bool {
        self.awaiting.is_some()
    }

    /// Takes a pool view that reflects every op sent so far (a flush reply).
    pub fn apply_view(&mut self, reply: &PoolReply) {
        self.avail = reply.view.available + self.pending_credit;
        for s in self.seqs.values_mut() {
            s.exclusive = 0;
        }
        for &(id, n) in &reply.view.exclusive {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.exclusive = n;
            }
        }
    }

    /// Queues a sequence at the back of its priority's waiting queue. Refuses sequences that could
    /// not fit in the whole pool even alone, so an admitted sequence can always finish.
    pub fn add(&mut self, seq: NewSeq) -> Result<(), PolicyError> {
        self.add_with_images(seq, Vec::new())
    }

    /// [`Self::add`] for a prompt with images: their placeholder spans and content hashes go to
    /// the pool with the sequence, where they key its pages. Their placeholder tokens are
    /// prefill tokens like any other: the step's token budget pays for encoding them.
    pub fn add_with_images(&mut self, seq: NewSeq, images: Vec<crate::kv::ImageKey>) -> Result<(), PolicyError> {
        if self.seqs.contains_key(&seq.id) {
            return Err(PolicyError::DuplicateId(seq.id));
        }
        if seq.prompt.is_empty() {
            return Err(PolicyError::EmptyPrompt(seq.id));
        }
        if seq.max_tokens == 0 {
            return Err(PolicyError::ZeroMaxTokens(seq.id));
        }
        let needed_tokens = seq.prompt.len().saturating_add(seq.max_tokens);
        if needed_tokens.div_ceil(self.cfg.block_size) > self.cfg.num_blocks {
            return Err(PolicyError::NeverFits {
                prompt_tokens: seq.prompt.len(),
                max_tokens: seq.max_tokens,
                needed_tokens,
                pool_tokens: self.cfg.num_blocks * self.cfg.block_size,
            });
        }
        let prompt_len = seq.prompt.len();
        if let Some(p) = self.pacing.as_mut() {
            p.note_arrival(seq.priority, prompt_len);
        }
        self.pending.push(PoolOp::Register { seq: seq.id, tokens: seq.prompt.clone(), images });
        self.seqs.insert(
            seq.id,
            Seq {
                priority: seq.priority,
                tokens: seq.prompt,
                prompt_len,
                max_tokens: seq.max_tokens,
                num_computed: 0,
                held: 0,
                exclusive: 0,
                admit_extra: 0,
                draft: Vec::new(),
                admitted: None,
                preempted_at: None,
                in_flight: 0,
            },
        );
        self.waiting.entry(Reverse(seq.priority)).or_default().push_back(seq.id);
        Ok(())
    }

    /// Cancels a sequence wherever it is and frees its blocks now. If it is part of the step in
    /// flight, its results are ignored when they arrive (the blocks are not handed out again
    /// before `on_step_done`, since planning waits for it). Unknown ids return false.
    pub fn abort(&mut self, id: SeqId) -> bool {
        // The suspended step still writes its KV when resumed: its blocks go after that.
        if self.defer_release_if_suspended(id) {
            return true;
        }
        self.remove_seq(id)
    }

    /// Offers draft tokens to verify in the next step for a running, decoding sequence that is
    /// not in flight. Drafts that would run past `max_tokens` are cut. Returns how many tokens
    /// were kept (0 when the sequence cannot take a draft now). A draft is for one step only.
    pub fn set_draft(&mut self, id: SeqId, mut draft: Vec<u32>) -> usize {
        let Some(seq) = self.seqs.get_mut(&id) else { return 0 };
        if seq.admitted.is_none() || seq.in_flight > 0 || !seq.is_decode() {
            return 0;
        }
        // Accepting every draft plus the bonus token adds draft.len() + 1 tokens.
        let headroom = (seq.prompt_len + seq.max_tokens).saturating_sub(seq.tokens.len() + 1);
        draft.truncate(headroom);
        seq.draft = draft;
        self.with_draft.push(id);
        seq.draft.len()
    }

    /// Plans the next step (see the module doc for the rules) and returns the pool work to commit
    /// for it, in order: everything pending, preemptions, then each planned sequence's admission
    /// or growth. Hand the pool's reply to `finish_step`. `None` when there is nothing to do, or
    /// while a planned step has not been finished or reported (`on_step_done` / `on_step_failed`).
    pub fn plan_step(&mut self) -> Option<Vec<PoolOp>> {
        if !self.in_flight.is_empty() || self.awaiting.is_some() {
            tracing::warn!("plan_step called while the previous step is still in flight");
            return None;
        }
        if self.seqs.is_empty() {
            return None;
        }
        self.step += 1;
        let mut b = StepBuild {
            budget: self.cfg.max_num_batched_tokens,
            lookahead: false,
            planned: Vec::with_capacity(self.running.len() + 1),
            preempted: Vec::new(),
        };

        let turn = self.split_turn();
        // 1. Decodes.
        let decodes: Vec<SeqId> = self
            .running
            .iter()
            .filter(|((p, _), id)| turn.admits(p.0) && self.seqs.get(id).is_some_and(Seq::is_plannable_decode))
            .map(|&(_, id)| id)
            .collect();
        for id in decodes {
            if b.budget == 0 {
                break;
            }
            self.plan_running(id, 1, &mut b);
        }

        // 2. Prefill work, level by level.
        let mut levels: BTreeSet<Reverse<i32>> = self.waiting.keys().copied().collect();
        levels.extend(
            self.running.iter().filter(|(_, id)| self.seqs.get(id).is_some_and(|s| !s.is_decode())).map(|(k, _)| k.0),
        );
        levels.retain(|l| turn.admits(l.0));
        // Priorities with work waiting or running: their lanes' targets bound lower prefill.
        let active: BTreeSet<i32> = match self.pacing {
            Some(_) => self.waiting.keys().chain(self.running.iter().map(|(k, _)| &k.0)).map(|r| r.0).collect(),
            None => BTreeSet::new(),
        };
        let mut admitting = true;
        'levels: for level in levels {
            let cap = turn.cap(self.pacing.as_ref().and_then(|p| p.step_cap(level.0, |prio| active.contains(&prio))));
            let mids: Vec<SeqId> = self
                .running
                .iter()
                .filter(|((p, _), id)| {
                    *p == level && self.seqs.get(id).is_some_and(|s| !s.is_decode() && s.in_flight == 0)
                })
                .map(|&(_, id)| id)
                .collect();
            for id in mids {
                if b.budget == 0 {
                    break 'levels;
                }
                let Some(seq) = self.seqs.get(&id) else { continue };
                let want = (seq.tokens.len() - seq.num_computed).min(b.budget);
                // Paused at this chunk boundary (its KV kept) when a lane above needs the time.
                let want = want.min(self.paced_allowance(cap.as_ref(), &b, seq.num_computed));
                if want == 0 {
                    continue;
                }
                self.plan_running(id, want, &mut b);
            }
            while admitting {
                if b.budget == 0 {
                    break 'levels;
                }
                let Some(&id) = self.waiting.get(&level).and_then(VecDeque::front) else { break };
                let preempted_now = self.seqs.get(&id).is_some_and(|s| s.preempted_at == Some(self.step));
                if preempted_now || !self.admit(id, cap.as_ref(), &mut b) {
                    admitting = false;
                }
            }
        }

        // 3. Drafts from what is left.
        self.plan_drafts(&mut b, &active);

        if b.planned.is_empty() && b.preempted.is_empty() {
            if matches!(turn, lane_split::SplitTurn::Below { .. }) {
                // Nothing below fits: the higher lane's next decode must not wait for it.
                self.forget_split();
                return self.plan_step();
            }
            return None;
        }
        self.note_split(turn, &b);
        let mut ops = self.take_pending();
        for p in &b.planned {
            let new_tokens = p.n_base + p.draft.len();
            ops.push(if p.admission {
                PoolOp::Admit { seq: p.id, new_tokens }
            } else {
                PoolOp::Grow { seq: p.id, new_tokens }
            });
        }
        self.awaiting = Some(b);
        Some(ops)
    }

    /// Completes the step planned by `plan_step` with the pool's reply to its ops: moves admitted
    /// chunks past their prefix hits, drops sequences the pool could not grant blocks (they run
    /// next step), takes the new view, and returns the step to execute.
    pub fn finish_step(&mut self, reply: PoolReply) -> StepPlanOut {
        let Some(mut b) = self.awaiting.take() else {
            tracing::warn!("finish_step without a planned step");
            return StepPlanOut::default();
        };
        self.apply_view(&reply);
        let grants: IdMap<&crate::kv::SeqGrant> = reply.grants.iter().map(|g| (g.seq, g)).collect();
        let bs = self.cfg.block_size;
        let mut out = Vec::with_capacity(b.planned.len());
        let mut kept = Vec::with_capacity(b.planned.len());
        let mut unadmit = Vec::new();
        let mut prefix_hits = Vec::new();
        for mut p in std::mem::take(&mut b.planned) {
            let Some(seq) = self.seqs.get_mut(&p.id) else { continue };
            let Some(g) = grants.get(&p.id).filter(|g| g.ok) else {
                tracing::debug!(seq = p.id, "the pool could not grant the planned blocks; retried next step");
                if let Some(g) = grants.get(&p.id) {
                    seq.held = g.blocks.len();
                    // An admission refused after its prefix hit pinned the last available
                    // blocks: next time it asks for room for those pinned blocks too, so the
                    // planner preempts or waits instead of retrying in vain.
                    if p.admission {
                        seq.admit_extra = g.blocks.len();
                    }
                }
                seq.draft.clear();
                if p.admission {
                    unadmit.push(p.id);
                }
                continue;
            };
            seq.held = g.blocks.len();
            if p.admission {
                // The chunk was planned from 0; the prefix hit moves it (never past the last token,
                // never past the blocks granted).
                seq.admit_extra = 0;
                seq.num_computed = g.start;
                p.start = g.start;
                p.n_base = p.n_base.min(seq.tokens.len() - g.start).min(g.blocks.len() * bs - g.start);
                p.wants_logits = p.start + p.n_base == seq.tokens.len();
                prefix_hits.push((p.id, g.start));
            }
            seq.in_flight += 1;
            let tokens = if b.lookahead {
                // The token the step in flight samples: the executor puts it in.
                vec![0]
            } else {
                let mut tokens = Vec::with_capacity(p.n_base + p.draft.len());
                tokens.extend_from_slice(&seq.tokens[p.start..p.start + p.n_base]);
                tokens.extend_from_slice(&p.draft);
                tokens
            };
            let nb = (p.start + tokens.len()).div_ceil(bs).min(g.blocks.len());
            out.push(PlannedSeq {
                id: p.id,
                tokens,
                start_pos: p.start,
                block_table: g.blocks[..nb].to_vec(),
                state_slot: g.slot,
                wants_logits: p.wants_logits,
                num_draft: p.draft.len(),
                follows_previous: b.lookahead,
            });
            kept.push(p);
        }
        for id in unadmit {
            self.unadmit(id);
        }
        for e in &reply.errors {
            tracing::error!(error = %e, "the KV pool refused an operation");
            if cfg!(debug_assertions) {
                panic!("the KV pool refused an operation: {e}");
            }
        }
        // A step that runs nothing is not in flight (nothing will report it done).
        if !kept.is_empty() {
            self.in_flight.push_back(kept);
        }
        let mut shape = StepShape::default();
        for s in &out {
            shape.add(s.start_pos, s.tokens.len(), s.is_decode() && s.num_draft == 0);
        }
        let yield_level = if b.lookahead || out.is_empty() { None } else { self.mark_yieldable() };
        StepPlanOut { seqs: out, preempted: b.preempted, prefix_hits, shape, yield_level }
    }

    /// Records the results of the step in flight. `sampled` holds, for each sequence that wanted
    /// logits, the tokens the executor produced: the accepted draft tokens followed by one newly
    /// sampled token (exactly one token without drafts). Tokens are appended and become the next
    /// decode input; only leading tokens that agree with the planned drafts count as accepted, and
    /// anything after the first disagreement is ignored. Chunks that did not want logits just
    /// advance. A sequence that wanted logits but has no entry keeps its state, so its chunk is
    /// computed again. `finished` ids are removed wherever they are and their blocks freed.
    ///
    /// Returns the sequences the policy itself ended because they reached `max_tokens` (it keeps at
    /// most `max_tokens` generated tokens); they may overlap with `finished`.
    pub fn on_step_done(&mut self, sampled: &[(SeqId, Vec<u32>)], finished: &[SeqId]) -> Vec<SeqId> {
        let planned = self.in_flight.pop_front().unwrap_or_else(|| {
            if !sampled.is_empty() {
                tracing::warn!("on_step_done without a step in flight: sampled tokens ignored");
            }
            Vec::new()
        });
        let samples: IdMap<&[u32]> = sampled.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        let mut length_finished = Vec::new();
        for p in planned {
            if self.release_deferred(p.id) {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&p.id) else { continue };
            seq.in_flight = seq.in_flight.saturating_sub(1);
            let before = seq.tokens.len();
            if !p.wants_logits {
                if samples.contains_key(&p.id) {
                    tracing::warn!(seq = p.id, "sampled tokens for a chunk that wanted no logits: ignored");
                }
                seq.num_computed = p.start + p.n_base;
            } else if let Some(toks) = samples.get(&p.id).filter(|t| !t.is_empty()) {
                let accepted = toks.iter().zip(&p.draft).take_while(|(a, b)| a == b).count().min(toks.len() - 1);
                if toks.len() > accepted + 1 {
                    tracing::debug!(seq = p.id, "tokens after the first rejected draft ignored");
                }
                let room = (seq.prompt_len + seq.max_tokens).saturating_sub(seq.tokens.len());
                let take = (accepted + 1).min(room);
                seq.tokens.extend_from_slice(&toks[..take]);
                // KV is now written for the chunk's known tokens and the accepted drafts.
                seq.num_computed = (p.start + p.n_base + accepted).min(seq.tokens.len() - 1);
                if seq.tokens.len() >= seq.prompt_len + seq.max_tokens {
                    length_finished.push(p.id);
                }
            } else if !finished.contains(&p.id) {
                tracing::warn!(seq = p.id, "no sampled token for a chunk that wanted logits; it will be recomputed");
            }
            self.pending.push(PoolOp::Advance {
                seq: p.id,
                new_tokens: seq.tokens[before..].to_vec(),
                computed: seq.num_computed,
            });
        }
        for &id in finished.iter().chain(&length_finished) {
            self.remove_seq(id);
        }
        self.release_cancelled();
        self.count_step_while_suspended();
        length_finished
    }

    /// The step in flight failed: nothing it computed counts; its sequences stay where they were
    /// and will be planned again. Returns their ids so the caller can fail or retry them.
    pub fn on_step_failed(&mut self) -> Vec<SeqId> {
        let planned = self.in_flight.pop_front().unwrap_or_default();
        let mut ids = Vec::with_capacity(planned.len());
        for p in planned {
            if self.release_deferred(p.id) {
                continue;
            }
            if let Some(seq) = self.seqs.get_mut(&p.id) {
                seq.in_flight = seq.in_flight.saturating_sub(1);
                ids.push(p.id);
            }
        }
        self.release_cancelled();
        self.count_step_while_suspended();
        ids
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    pub fn num_waiting_for(&self, priority: i32) -> usize {
        self.waiting.get(&Reverse(priority)).map_or(0, VecDeque::len)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// No sequence waiting or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn seq(&self, id: SeqId) -> Option<SeqView<'_>> {
        self.seqs.get(&id).map(|s| SeqView {
            id,
            priority: s.priority,
            tokens: &s.tokens,
            prompt_len: s.prompt_len,
            max_tokens: s.max_tokens,
            num_computed: s.num_computed,
            running: s.admitted.is_some(),
            held_blocks: s.held,
            block_table: &[],
        })
    }

    /// Panics unless waiting sequences hold nothing, running ones hold blocks for their computed
    /// tokens, the queues and the sequence map agree, and the available count is within the pool.
    /// O(sequences); for tests and debugging (`sched::Policy` adds the checks against the pool).
    pub fn assert_accounting(&self) {
        let bs = self.cfg.block_size;
        for (id, s) in &self.seqs {
            assert!(s.num_computed < s.tokens.len(), "seq {id}: every token computed, nothing to feed");
            assert!(s.exclusive <= s.held, "seq {id}: more exclusive blocks than held");
            match s.admitted {
                None => {
                    assert_eq!(s.held, 0, "waiting seq {id} holds blocks");
                    assert_eq!(s.num_computed, 0, "waiting seq {id} has computed tokens");
                }
                Some(_) => assert!(s.held * bs >= s.num_computed, "seq {id}: KV beyond its blocks"),
            }
        }
        assert!(self.avail <= self.cfg.num_blocks, "more blocks available than the pool has");
        assert!(self.running.len() <= self.cfg.max_num_seqs, "more running sequences than max_num_seqs");
        assert!(self.running.windows(2).all(|w| w[0] < w[1]), "running order is not sorted");
        for &((Reverse(p), adm), id) in &self.running {
            let s = self.seqs.get(&id).expect("running id is a known sequence");
            assert_eq!((s.priority, s.admitted), (p, Some(adm)), "running entry of {id} is stale");
        }
        for (&Reverse(p), q) in &self.waiting {
            assert!(!q.is_empty(), "empty waiting queue kept for priority {p}");
            for id in q {
                let s = self.seqs.get(id).expect("waiting id is a known sequence");
                assert_eq!((s.priority, s.admitted), (p, None), "waiting entry of {id} is stale");
            }
        }
        assert_eq!(self.running.len() + self.num_waiting(), self.seqs.len(), "a sequence is lost or queued twice");
    }

    /// Plans up to `want` tokens of a running sequence, making room as the module doc describes.
    fn plan_running(&mut self, id: SeqId, want: usize, b: &mut StepBuild) {
        let Some(key) = self.seqs.get(&id).and_then(|s| Some((Reverse(s.priority), s.admitted?))) else { return };
        let n = self.make_room(id, key, want, b);
        if n == 0 {
            return;
        }
        let Some(seq) = self.seqs.get(&id) else { return };
        let start = seq.num_computed;
        b.planned.push(Planned {
            id,
            start,
            n_base: n,
            wants_logits: start + n == seq.tokens.len(),
            draft: Vec::new(),
            admission: false,
        });
        b.budget -= n;
    }

    /// Admits the head of a waiting queue with a first chunk (at most what the lane pacing `cap`
    /// allows). False when it cannot start now.
    fn admit(&mut self, id: SeqId, cap: Option<&StepCap>, b: &mut StepBuild) -> bool {
        let Some(prio) = self.seqs.get(&id).map(|s| s.priority) else { return false };
        let allowance = self.paced_allowance(cap, b, 0);
        if allowance == 0 {
            return false;
        }
        // Counts as admitted after everyone running: only strictly lower priorities are behind it.
        let key = (Reverse(prio), u64::MAX);
        if self.running.len() >= self.cfg.max_num_seqs {
            match self.running.last() {
                // A running sequence holds at least one block, so this also guarantees the chunk
                // below gets at least one token: the preemption is never in vain.
                Some(&((Reverse(victim_prio), _), victim))
                    if victim_prio < prio && self.seqs.get(&victim).is_some_and(|s| s.in_flight == 0) =>
                {
                    self.preempt(victim, b)
                }
                _ => return false,
            }
        }
        let Some(len) = self.seqs.get(&id).map(|s| s.tokens.len()) else { return false };
        let n = self.make_room(id, key, len.min(b.budget).min(self.page_room(0)).min(allowance), b);
        if n == 0 {
            return false;
        }
        if let Some(q) = self.waiting.get_mut(&Reverse(prio)) {
            debug_assert_eq!(q.front(), Some(&id), "admitting a sequence that is not at the head of its queue");
            q.pop_front();
            if q.is_empty() {
                self.waiting.remove(&Reverse(prio));
            }
        }
        let adm = self.next_admission;
        self.next_admission += 1;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.admitted = Some(adm);
        }
        let entry = ((Reverse(prio), adm), id);
        let pos = self.running.partition_point(|e| *e < entry);
        self.running.insert(pos, entry);
        b.planned.push(Planned { id, start: 0, n_base: n, wants_logits: n == len, draft: Vec::new(), admission: true });
        b.budget -= n;
        tracing::trace!(seq = id, priority = prio, first_chunk = n, "admitted");
        true
    }
}

#[path = "lane_split.rs"]
mod lane_split;
#[path = "lookahead.rs"]
mod lookahead;
#[path = "room.rs"]
mod room;
#[path = "yielding.rs"]
mod yielding;
