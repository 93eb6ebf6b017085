//! The live grammar of one sequence and the masks it gives the sampler.
//!
//! The scheduler owns one [`GrammarHandle`] per constrained sequence. When it dispatches a step
//! it starts a [`PendingMasks`] job on its mask pool: the job computes the mask of every row the
//! step samples (the next position, and one more per draft token being verified, walking the
//! matcher through the drafts and rolling it back), while the executor runs the forward pass.
//! The executor waits for the masks only when the logits are there, then samples. After the step
//! the scheduler feeds the accepted tokens to the matcher ([`GrammarState::consume`]), so the
//! matcher always sits at the accepted prefix.
//!
//! With reasoning the grammar may start after a marker (`</think>`): until the reply's tokens end
//! with the marker's ids, every token is allowed (the block is bounded by `max_tokens`).

use std::sync::{Arc, OnceLock};

use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use parking_lot::Mutex;

/// Allowed ids of one position; ids at or past its length are forbidden.
pub type TokenMask = SimpleVob;

/// Shared between the scheduler (consume, draft checks) and the step's mask job.
pub type GrammarHandle = Arc<Mutex<GrammarState>>;

/// Where the constrained part starts.
#[derive(Clone, Debug)]
struct Gate {
    marker: Vec<u32>,
    /// The last `marker.len()` tokens seen while closed.
    tail: Vec<u32>,
    open: bool,
}

impl Gate {
    fn push(&mut self, token: u32) {
        self.tail.push(token);
        if self.tail.len() > self.marker.len() {
            self.tail.remove(0);
        }
        self.open = self.tail == self.marker;
    }
}

pub struct GrammarState {
    matcher: Matcher,
    gate: Option<Gate>,
    eos: Vec<u32>,
    vocab_size: usize,
    /// Logged once: the matcher refused a token it had allowed (an llguidance or tokenizer bug).
    reported_error: bool,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarState")
            .field("started", &self.constrained())
            .field("finished", &self.is_finished())
            .finish_non_exhaustive()
    }
}

impl GrammarState {
    /// `start_after`: the ids after which the grammar applies (empty or `None`: from the first
    /// token). `eos`: every id that ends generation (allowed wherever the grammar may end).
    pub fn new(matcher: Matcher, start_after: Option<Vec<u32>>, eos: Vec<u32>, vocab_size: usize) -> Self {
        let gate = start_after.filter(|m| !m.is_empty()).map(|marker| Gate { marker, tail: Vec::new(), open: false });
        Self { matcher, gate, eos, vocab_size, reported_error: false }
    }

    pub fn into_handle(self) -> GrammarHandle {
        Arc::new(Mutex::new(self))
    }

    fn constrained(&self) -> bool {
        self.gate.as_ref().is_none_or(|g| g.open)
    }

    /// Only the end-of-generation ids.
    pub fn eos_only(&self) -> TokenMask {
        eos_mask(&self.eos, self.vocab_size)
    }

    /// The mask of the next position; `None` while the grammar has not started.
    pub fn next_mask(&mut self) -> Option<TokenMask> {
        if !self.constrained() {
            return None;
        }
        Some(match self.matcher.compute_mask_or_eos() {
            Ok(mut m) => {
                // The trie knows every EOS, but a grammar's end allows only its first: any of
                // them ends the reply the same way.
                if self.eos.iter().any(|&e| m.is_allowed(e)) {
                    let len = m.len();
                    self.eos.iter().filter(|&&e| (e as usize) < len).for_each(|&e| m.allow_token(e));
                }
                m
            }
            Err(e) => {
                self.report(&e.to_string());
                self.eos_only()
            }
        })
    }

    fn report(&mut self, error: &str) {
        if !self.reported_error {
            self.reported_error = true;
            tracing::warn!(error, "grammar matcher failed; the reply ends here");
        }
    }

    /// Advance by one token. `false` when the grammar refuses it (nothing changes then) or the
    /// token ends the reply.
    fn try_advance(&mut self, token: u32) -> bool {
        if let Some(g) = self.gate.as_mut().filter(|g| !g.open) {
            g.push(token);
            return true;
        }
        if self.eos.contains(&token) {
            return false;
        }
        matches!(self.matcher.try_consume_tokens(&[token]), Ok(1))
    }

    /// Masks for a step that verifies `drafts`: row `i` is the mask after `drafts[..i]`. The
    /// matcher ends where it started. Rows after a draft the grammar refuses repeat that row's
    /// mask: the refused draft is rejected there, so later rows are never used.
    pub fn masks_for(&mut self, drafts: &[u32]) -> Vec<Option<TokenMask>> {
        let gate = self.gate.clone();
        let mut in_matcher = 0;
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        masks.push(self.next_mask());
        for &d in drafts {
            let was_constrained = self.constrained();
            if self.try_advance(d) {
                in_matcher += usize::from(was_constrained);
                masks.push(self.next_mask());
            } else {
                break;
            }
        }
        while masks.len() < drafts.len() + 1 {
            let last = masks.last().cloned().flatten();
            masks.push(last);
        }
        if in_matcher > 0 {
            if let Err(e) = self.matcher.rollback(in_matcher) {
                self.report(&e.to_string());
            }
        }
        self.gate = gate;
        masks
    }

    /// How many leading drafts the grammar allows (an EOS it allows counts, and ends the count).
    pub fn valid_prefix(&mut self, drafts: &[u32]) -> usize {
        let gate = self.gate.clone();
        let mut i = 0;
        while i < drafts.len() && !self.constrained() {
            self.try_advance(drafts[i]);
            i += 1;
        }
        let valid = if i < drafts.len() { i + self.matcher.validate_tokens(&drafts[i..]).unwrap_or(0) } else { i };
        self.gate = gate;
        valid
    }

    /// Feed the tokens the sequence accepted (never an EOS: the reply ended there).
    pub fn consume(&mut self, tokens: &[u32]) {
        for &t in tokens {
            if let Some(g) = self.gate.as_mut().filter(|g| !g.open) {
                g.push(t);
            } else if let Err(e) = self.matcher.consume_token(t) {
                // The next mask is EOS only: the reply ends rather than leave the grammar.
                self.report(&e.to_string());
            }
        }
    }

    /// The grammar is complete and allows nothing but the end of the reply.
    pub fn is_finished(&self) -> bool {
        self.constrained() && self.matcher.is_stopped()
    }
}

fn eos_mask(eos: &[u32], vocab_size: usize) -> TokenMask {
    let mut m = SimpleVob::alloc(vocab_size);
    eos.iter().filter(|&&e| (e as usize) < vocab_size).for_each(|&e| m.allow_token(e));
    m
}

/// Forbid (set to -inf) every logit the mask does not allow, ids past the mask included.
pub fn apply_mask(mask: &TokenMask, logits: &mut [f32]) {
    let covered = mask.len().min(logits.len());
    mask.iter_unset_entries(|i| {
        if i < covered {
            logits[i] = f32::NEG_INFINITY;
        }
    });
    logits[covered..].fill(f32::NEG_INFINITY);
}

/// The masks of one sequence's rows for one step, computed on the scheduler's mask pool while
/// the step's forward pass runs.
pub struct PendingMasks {
    eos: TokenMask,
    rx: flume::Receiver<Vec<Option<TokenMask>>>,
    done: OnceLock<Vec<Option<TokenMask>>>,
}

impl std::fmt::Debug for PendingMasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingMasks").field("done", &self.done.get().is_some()).finish_non_exhaustive()
    }
}

impl PendingMasks {
    /// Start computing the masks of a step that verifies `drafts` (empty: one row).
    pub fn start(pool: &rayon::ThreadPool, grammar: &GrammarHandle, drafts: Vec<u32>) -> Arc<Self> {
        let (tx, rx) = flume::bounded(1);
        let eos = grammar.lock().eos_only();
        let job = Arc::clone(grammar);
        pool.spawn(move || {
            let masks = job.lock().masks_for(&drafts);
            let _ = tx.send(masks);
        });
        Arc::new(Self { eos, rx, done: OnceLock::new() })
    }

    /// Masks already known (tests, and callers with nothing to overlap).
    pub fn ready(masks: Vec<Option<TokenMask>>, eos: TokenMask) -> Arc<Self> {
        let (_, rx) = flume::bounded(1);
        let done = OnceLock::new();
        let _ = done.set(masks);
        Arc::new(Self { eos, rx, done })
    }

    /// Block until the masks are there. A job that died (it cannot, short of a panic in
    /// llguidance) yields EOS-only masks: the reply ends instead of leaving the grammar.
    pub fn wait(&self, rows: usize) -> Vec<Option<TokenMask>> {
        let masks = self.done.get_or_init(|| self.rx.recv().unwrap_or_default());
        (0..rows).map(|i| masks.get(i).cloned().unwrap_or_else(|| Some(self.eos.clone()))).collect()
    }
}
