//! The planner's public data: its configuration, a request handed to it, the step it plans,
//! read-only views of a sequence, and its errors.

pub type SeqId = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Tokens one step may carry: decode tokens + prefill chunks + draft tokens.
    pub max_num_batched_tokens: usize,
    /// Sequences that may be running (admitted, holding blocks) at once.
    pub max_num_seqs: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Prefix-cache page size in tokens (a multiple of `block_size`); 0 turns the cache off.
    /// A prefill chunk may cross page boundaries (unless `page_aligned_chunks`): every page it
    /// completes is published when it finishes.
    pub page_tokens: usize,
    /// The model keeps recurrent state (hybrid models): with pages, verification runs are capped
    /// to end at most on a page boundary too (`sched::drafts`).
    pub recurrent_state: bool,
    /// Prefill chunks end at every page boundary: a hybrid model on a backend that can read its
    /// recurrent state only at the end of a step (so a page's snapshot needs a step ending there).
    /// Backends that snapshot the state at offsets inside a step leave it off, and chunks are
    /// sized by the token budget alone.
    pub page_aligned_chunks: bool,
}

impl PolicyConfig {
    pub fn validate(&self) -> Result<(), PolicyError> {
        let invalid = |msg: String| Err(PolicyError::InvalidConfig(msg));
        if self.block_size == 0 {
            return invalid("block_size must be at least 1 token".into());
        }
        if self.num_blocks == 0 {
            return invalid("num_blocks must be at least 1".into());
        }
        if self.max_num_seqs == 0 {
            return invalid("max_num_seqs must be at least 1".into());
        }
        if !self.page_tokens.is_multiple_of(self.block_size) {
            return invalid(format!(
                "page_tokens ({}) must be a multiple of block_size ({})",
                self.page_tokens, self.block_size
            ));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return invalid(format!(
                "max_num_batched_tokens ({}) must be at least max_num_seqs ({}): every running \
                 sequence needs room for its decode token in every step",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        Ok(())
    }
}

/// A request handed to the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSeq {
    pub id: SeqId,
    /// Higher runs first and may preempt lower.
    pub priority: i32,
    pub prompt: Vec<u32>,
    /// Generated tokens after which the policy ends the sequence itself (see `on_step_done`).
    pub max_tokens: usize,
}

/// One sequence's share of a step: everything an executor needs besides weights and sampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSeq {
    pub id: SeqId,
    /// Query tokens this step, in position order. The last `num_draft` of them are draft tokens
    /// to verify.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; KV for positions `0..start_pos` is already in the blocks.
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + tokens.len()`, in position order.
    pub block_table: Vec<u32>,
    /// Recurrent-state slot (distinct per running sequence).
    pub state_slot: u32,
    /// True when this chunk ends the known tokens, so tokens must be sampled: one from the
    /// position before the drafts, plus one per draft position when drafts are present.
    pub wants_logits: bool,
    /// Trailing draft tokens in `tokens` (0 without speculative decoding).
    pub num_draft: usize,
    /// A lookahead step's chunk (`Planner::plan_lookahead`): its one token is the one the step
    /// before samples for this sequence, which only the executor knows when it runs this step
    /// (`tokens` holds a placeholder).
    pub follows_previous: bool,
}

impl PlannedSeq {
    /// A one-token step on a sequence whose tokens were all computed but the last (possibly with
    /// drafts); a prefill chunk otherwise.
    pub fn is_decode(&self) -> bool {
        self.wants_logits && self.tokens.len() == self.num_draft + 1
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlanOut {
    pub seqs: Vec<PlannedSeq>,
    /// Sequences preempted while planning this step (now waiting again, recompute on resume):
    /// the actor may notify or count them.
    pub preempted: Vec<SeqId>,
    /// Sequences admitted by this step and the tokens the prefix cache served them.
    pub prefix_hits: Vec<(SeqId, usize)>,
    /// What the step computes, for the step cost model (`Planner::observe_step` with its time).
    pub shape: crate::sched::cost::StepShape,
    /// `Some(priority)` when the step carries prefill (and maybe decodes) of lanes at or below `priority` and a
    /// lane above has latency targets: it may stop at a layer boundary when such a lane gets work
    /// (`sched::yielding`). `None` when yielding is off or the step must run whole.
    pub yield_level: Option<i32>,
}

impl StepPlanOut {
    /// Query tokens in the step (what `max_num_batched_tokens` bounds).
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// A read-only view of one sequence, for callers' bookkeeping and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView<'a> {
    pub id: SeqId,
    pub priority: i32,
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub num_computed: usize,
    /// Admitted and holding blocks (otherwise waiting).
    pub running: bool,
    /// Blocks its table holds.
    pub held_blocks: usize,
    /// Its block table (filled by `sched::Policy`, which holds the pool; empty from a `Planner`).
    pub block_table: &'a [u32],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(String),
    #[error("sequence id {0} is already queued or running")]
    DuplicateId(SeqId),
    #[error("sequence {0} has an empty prompt")]
    EmptyPrompt(SeqId),
    #[error("sequence {0} asks for max_tokens = 0; at least one token must be generated")]
    ZeroMaxTokens(SeqId),
    #[error(
        "the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs {needed_tokens} \
         tokens of KV cache, but the whole KV pool holds only {pool_tokens} tokens"
    )]
    NeverFits { prompt_tokens: usize, max_tokens: usize, needed_tokens: usize, pool_tokens: usize },
}

impl PolicyError {
    /// Stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            PolicyError::InvalidConfig(_) => "invalid_config",
            PolicyError::DuplicateId(_) => "duplicate_id",
            PolicyError::EmptyPrompt(_) => "empty_prompt",
            PolicyError::ZeroMaxTokens(_) => "zero_max_tokens",
            PolicyError::NeverFits { .. } => "never_fits",
        }
    }
}
