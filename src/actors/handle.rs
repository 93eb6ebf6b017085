//! The engine boundary the HTTP layer sees: submit a tokenized request to a lane, receive a
//! stream of events, drop the stream to cancel. Nothing here knows about actors' internals,
//! backends or HTTP.

use std::sync::Arc;

use crate::sampling::loop_guard::LoopGuardConfig;
use crate::sampling::SamplingParams;
use crate::structured::GrammarHandle;
use crate::tokenizer::TokenizerBundle;

/// A generation request after the API layer validated and tokenized it.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Lane name (`voice`, `agent`, …): decides priority and queue.
    pub lane: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens (already capped by the lane maximum and the context).
    pub max_tokens: usize,
    /// OpenAI `stop` strings, matched on the detokenized text across token boundaries.
    pub stop_strings: Vec<String>,
    /// Extra ids that end generation, in addition to the model's end-of-generation ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating through end-of-generation ids (benchmarks).
    pub ignore_eos: bool,
    /// Drop special tokens from the text (OpenAI default).
    pub skip_special_tokens: bool,
    /// Stop a generation that keeps repeating one span (the lane's setting).
    pub loop_guard: LoopGuardConfig,
    /// Structured output: the compiled grammar the reply must follow (one per request: a clone
    /// of the request shares it, so each choice gets its own).
    pub grammar: Option<GrammarHandle>,
    /// Images whose embeddings replace runs of placeholder tokens in `prompt` (in prompt order,
    /// spans disjoint); empty for text.
    pub images: Vec<PromptImage>,
}

/// One image of a prompt, processed by the API (`media::ImageProcessor`) and handed on as plain
/// data: the executor runs the vision tower on `pixel_values` and writes the embeddings into the
/// rows of `span`; the KV pool keys the pages `span` touches by `hash`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PromptImage {
    /// Placeholder positions in the prompt (`t·h·w / merge²` of them).
    pub span: std::ops::Range<usize>,
    /// `(t, h, w)` in patches.
    pub grid: [usize; 3],
    /// `[t·h·w, C·T·P·P]` row-major; shared by every choice of the request.
    pub pixel_values: Arc<[f32]>,
    /// `media::content_hash` of the processed image.
    pub hash: u64,
}

impl GenerationRequest {
    /// A greedy request that always runs to `max_tokens` (end-of-generation ids ignored, no stop
    /// strings): the fixed-length request of benchmarks and engine tests.
    pub fn greedy_fixed_length(lane: impl Into<String>, prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerationRequest {
            lane: lane.into(),
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_strings: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            skip_special_tokens: true,
            loop_guard: LoopGuardConfig::off(),
            grammar: None,
            images: Vec::new(),
        }
    }
}

/// One generated token as the client may see it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    /// Log-probability of `id` (present when the request asked for logprobs).
    pub logprob: Option<f32>,
    /// Top alternatives `(id, logprob)`, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The loop guard stopped a generation that kept repeating itself.
    Repetition,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// New text (may be empty while a stop string or a multi-byte character is pending) and the
    /// tokens that produced it.
    Delta { text: String, tokens: Vec<TokenInfo> },
    /// The last event of a successful request.
    Finished { reason: FinishReason, usage: Usage },
    /// The request failed; the last event.
    Error(EngineError),
}

/// Why a request could not be admitted or did not finish. `kind()` is a stable label for
/// metrics and for mapping to HTTP status codes in exactly one place (the API layer).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("unknown lane `{0}`")]
    UnknownLane(String),
    #[error("lane `{lane}` queue is full ({capacity} waiting requests); retry later")]
    QueueFull { lane: String, capacity: usize },
    #[error("the engine is not ready: {0}")]
    NotReady(String),
    #[error("{needed} tokens (prompt {prompt} + max_tokens {max_tokens}) exceed the {limit}-token limit")]
    TooLong { needed: usize, prompt: usize, max_tokens: usize, limit: usize },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("executor failed: {0}")]
    Executor(String),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl EngineError {
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::UnknownLane(_) => "unknown_lane",
            EngineError::QueueFull { .. } => "queue_full",
            EngineError::NotReady(_) => "not_ready",
            EngineError::TooLong { .. } => "context_length_exceeded",
            EngineError::Invalid(_) => "invalid_request",
            EngineError::Executor(_) => "executor_failed",
            EngineError::ShuttingDown => "shutting_down",
        }
    }
}

/// Receives a request's events; dropping it cancels the request (its pages are freed at the
/// next step boundary).
pub type EventStream = tokio::sync::mpsc::Receiver<StreamEvent>;

/// Static facts about the served model, for `/v1/models` and request validation.
#[derive(Clone)]
pub struct ModelInfo {
    /// The id clients use in `model` (plus `default` as an alias).
    pub id: String,
    pub max_context: usize,
    pub vocab_size: usize,
    pub tokenizer: Option<Arc<TokenizerBundle>>,
    pub eos_token_ids: Vec<u32>,
    /// How the model takes images; `None` for a model without a vision tower.
    pub vision: Option<VisionInfo>,
}

/// What the API needs to turn images into prompt input for a model with a vision tower.
#[derive(Clone, Debug)]
pub struct VisionInfo {
    /// The placeholder id the chat template writes once per image and the engine repeats.
    pub image_token_id: u32,
    /// Side of the square of patches one placeholder token stands for.
    pub merge_size: usize,
    /// The checkpoint's `preprocessor_config.json` (or transformers' defaults).
    pub processor: crate::media::ImageProcessor,
    /// How the model takes video; `None` when its config names no video tokens.
    pub video: Option<VideoInfo>,
    /// Why this engine refuses images and video although the model has a tower (tensor
    /// parallelism: the ranks would have to agree on every image's encoding).
    pub refused: Option<String>,
}

/// What the API needs to turn a video into prompt input: the template writes one `video_token_id`
/// per video, which the API replaces with one `<|begin_of_image|>` run of placeholders
/// `<|end_of_image|>` plus timestamp text per frame pair, as `Glm5NextProcessor` does.
#[derive(Clone, Debug)]
pub struct VideoInfo {
    pub video_token_id: u32,
    pub image_start_token_id: u32,
    pub image_end_token_id: u32,
    /// The checkpoint's `video_preprocessor_config.json` (or transformers' defaults).
    pub processor: crate::media::VideoProcessor,
}

/// What the HTTP layer needs from the engine.
pub trait InferenceEngine: Send + Sync + 'static {
    fn model(&self) -> &ModelInfo;
    /// True once the model is loaded and the executors are up (and not draining).
    fn is_ready(&self) -> bool;
    /// True once a drained shutdown began: new requests are refused with `shutting_down`.
    fn is_draining(&self) -> bool {
        false
    }
    /// Why the engine can no longer serve (an executor failed, at load or later), if it can't:
    /// readiness then reports this instead of "still loading", which would never end.
    fn failure(&self) -> Option<String> {
        None
    }
    /// Whether requests are taken now, and if not, why: shutting down, a failed executor, or a
    /// model still loading (checked in that order). `/health` and `submit` both answer with it.
    fn readiness(&self) -> Result<(), EngineError> {
        if self.is_draining() {
            Err(EngineError::ShuttingDown)
        } else if let Some(e) = self.failure() {
            Err(EngineError::NotReady(format!("the executor failed ({e}); restart the engine")))
        } else if !self.is_ready() {
            Err(EngineError::NotReady("the model is still loading".into()))
        } else {
            Ok(())
        }
    }
    /// Queue a request. Errors that are known before queueing (unknown lane, full queue, too
    /// long, not ready) are returned here; later failures arrive as `StreamEvent::Error`.
    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError>;
}
