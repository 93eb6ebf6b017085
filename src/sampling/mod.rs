//! Token sampling: the per-request sampling parameters, the token history that penalties need, and
//! the pure function that turns one row of logits into one token (plus logprobs). Owns no model,
//! no tensors beyond a logits row, and no randomness state: every draw is derived from
//! `(seed, step)` so a request samples the same tokens whether it runs alone, batched, drafted or
//! resumed.
//!
//! Processing order follows vLLM: logit bias → repetition penalty (HF/CTRL) → presence/frequency
//! penalties → (greedy: argmax) → temperature → top-k → top-p → min-p → softmax → inverse-CDF draw
//! over token ids in ascending order with `uniform(seed, step)`.

pub mod loop_guard;
mod pipeline;
#[cfg(test)]
mod tests;
mod vector;

use std::collections::{HashMap, HashSet};

/// Temperatures below this are greedy, as in vLLM (`_SAMPLING_EPS`): dividing by a near-zero
/// temperature only reproduces argmax with extra rounding risk.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;
/// OpenAI's cap on `top_logprobs`.
pub const MAX_LOGPROBS: usize = 20;
/// OpenAI's range for a `logit_bias` value.
pub const MAX_ABS_LOGIT_BIAS: f32 = 100.0;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 (below [`GREEDY_TEMPERATURE_EPS`]) => greedy (argmax, ties -> lowest id).
    pub temperature: f32,
    /// 0 => off.
    pub top_k: usize,
    /// 1.0 => off.
    pub top_p: f32,
    /// 0.0 => off.
    pub min_p: f32,
    /// 1.0 => off; HF/CTRL style over prompt + output tokens.
    pub repetition_penalty: f32,
    /// OpenAI style over output tokens.
    pub presence_penalty: f32,
    /// OpenAI style over output tokens.
    pub frequency_penalty: f32,
    /// Added to the logit of each listed id; an id listed twice gets both biases; ids outside the
    /// vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    /// Always set (the API layer draws one when the client gives none).
    pub seed: u64,
    /// None => none (`Sampled::logprob` is NaN: computing it costs a pass of `exp` over the
    /// vocabulary, as much as greedy decoding itself); Some(n) => chosen token's logprob + top n
    /// alternatives.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
            logprobs: None,
        }
    }
}

/// A sampling parameter outside its accepted range. The message names the field and the value so
/// the API layer can return it verbatim as a 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}` = {value}: {expected}")]
pub struct SamplingError {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl SamplingError {
    fn new(field: &'static str, value: impl std::fmt::Display, expected: &'static str) -> Self {
        Self { field, value: value.to_string(), expected }
    }
}

impl SamplingParams {
    /// Greedy when the temperature is (near) zero. A NaN temperature also counts as greedy so an
    /// unvalidated value can never poison the distribution.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE_EPS
    }

    /// Ranges follow OpenAI / vLLM. Every check is written so that NaN fails it (`contains` and
    /// `>`/`<=` are false for NaN).
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::new("temperature", self.temperature, "must be a finite number >= 0"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::new("top_p", self.top_p, "must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::new("min_p", self.min_p, "must be in [0, 1]"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingError::new(
                "repetition_penalty",
                self.repetition_penalty,
                "must be a finite number > 0",
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplingError::new("presence_penalty", self.presence_penalty, "must be in [-2, 2]"));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplingError::new("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]"));
        }
        for &(id, bias) in &self.logit_bias {
            if !(-MAX_ABS_LOGIT_BIAS..=MAX_ABS_LOGIT_BIAS).contains(&bias) {
                return Err(SamplingError::new("logit_bias", format!("{bias} (token {id})"), "must be in [-100, 100]"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(SamplingError::new("logprobs", n, "must be at most 20"));
            }
        }
        Ok(())
    }

    /// Whether any knob changes the logits before argmax / temperature (lets greedy skip a copy).
    fn adjusts_logits(&self, state: &PenaltyState) -> bool {
        !self.logit_bias.is_empty()
            || (self.repetition_penalty != 1.0 && !state.seen.is_empty())
            || ((self.presence_penalty != 0.0 || self.frequency_penalty != 0.0) && !state.output_counts.is_empty())
    }
}

/// Token history for penalties, updated incrementally (O(1) per token).
///
/// Only the distinct ids matter (and, for output tokens, their counts), so applying penalties
/// costs O(distinct tokens), never O(history) or O(vocab).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct PenaltyState {
    /// Distinct ids of prompt + output: the repetition penalty's domain.
    seen: HashSet<u32>,
    /// Output ids and how often each was generated: presence/frequency's domain.
    output_counts: HashMap<u32, u32>,
}

impl PenaltyState {
    pub fn new(prompt: &[u32]) -> Self {
        Self { seen: prompt.iter().copied().collect(), output_counts: HashMap::new() }
    }

    pub fn push_output(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// Distinct ids of prompt + output (the repetition penalty's domain), in no particular order.
    pub fn seen_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.seen.iter().copied()
    }

    /// Distinct output ids with how often each was generated, in no particular order.
    pub fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.output_counts.iter().map(|(&id, &n)| (id, n))
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the model's raw distribution (log_softmax of the
    /// unmodified logits, vLLM's default). NaN when `params.logprobs` is None (not computed).
    pub logprob: f32,
    /// Top alternatives under the raw distribution, by logprob desc then id asc; empty unless
    /// `params.logprobs` is `Some(n)` with n > 0.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Deterministic: same (logits, params, state, step) -> same token. `step` = index of the generated
/// token.
///
/// Never panics on odd input: NaN logits are never chosen; when processing leaves nothing finite
/// (everything -inf or NaN) the token is the argmax of the raw logits; an empty row gives token 0.
pub fn sample(logits: &[f32], params: &SamplingParams, state: &PenaltyState, step: u64) -> Sampled {
    let token = pipeline::choose(logits, params, state, step);
    match params.logprobs {
        Some(n) => {
            let (logprob, top_logprobs) = pipeline::raw_logprobs(logits, token, n);
            Sampled { token, logprob, top_logprobs }
        }
        None => Sampled { token, logprob: f32::NAN, top_logprobs: Vec::new() },
    }
}

/// `token` as if [`sample`] had chosen it: its raw logprob and the top `params.logprobs`
/// alternatives (NaN / empty when logprobs were not requested). Speculative verification uses it
/// for tokens chosen by acceptance rather than by a draw.
pub fn sampled_as(logits: &[f32], token: u32, params: &SamplingParams) -> Sampled {
    match params.logprobs {
        Some(n) => {
            let (logprob, top_logprobs) = pipeline::raw_logprobs(logits, token, n);
            Sampled { token, logprob, top_logprobs }
        }
        None => Sampled { token, logprob: f32::NAN, top_logprobs: Vec::new() },
    }
}

/// The uniform draw in [0, 1) used for `step`: ChaCha8 keyed by `seed`, with `step` as the stream
/// number, so the value depends on nothing else (not batching, not other requests, not how many
/// draws came before).
pub fn uniform(seed: u64, step: u64) -> f32 {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(step);
    // 24 random bits fill an f32 mantissa exactly, so every value is representable and < 1.
    (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Full processed distribution (after penalties, bias, temperature, top-k/p, min-p), as
/// probabilities, for rejection-sampling verification later. Greedy → one-hot on the token
/// [`sample`] would pick.
pub fn processed_probs(logits: &[f32], params: &SamplingParams, state: &PenaltyState) -> Vec<f32> {
    pipeline::processed_probs(logits, params, state)
}
