//! Serving configuration: lanes (port, priority, reasoning defaults, token limits, queue bound)
//! and scheduler budgets, resolved from a TOML file (`configs/default.toml`), flags and
//! defaults by [`super::layers`]. Parsing and validation only.

use serde::{Deserialize, Serialize};

use crate::sampling::loop_guard::LoopGuardConfig;
use std::path::Path;

/// A lane: one listen port with its own priority and request defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneConfig {
    pub name: String,
    pub port: u16,
    /// Higher is more urgent; a higher-priority request may preempt lower-priority decodes.
    pub priority: i32,
    /// Default `reasoning_effort` put into `chat_template_kwargs` unless the request sets it.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// Default `thinking` / `enable_thinking` template switch unless the request sets it.
    #[serde(default)]
    pub thinking: Option<bool>,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// Largest `max_tokens` a request may ask for (larger is a 400).
    pub max_tokens_limit: usize,
    /// Waiting requests beyond this get HTTP 429. Unset (0) in the file: twice `max_num_seqs`,
    /// so a burst the scheduler can run at once is never refused.
    #[serde(default)]
    pub max_queue: usize,
    /// Speculative decoding for this lane: `none`, `ngram` (model-free suffix match),
    /// `draft:PATH` or `dflash:DIR`.
    #[serde(default)]
    pub speculative: crate::spec::SpeculativeMethod,
    /// Draft tokens verified per step (1..=7) when `speculative` is on.
    #[serde(default = "default_num_speculative_tokens")]
    pub num_speculative_tokens: usize,
    /// Cost of verifying one more draft token, in decode steps, for the n-gram drafter's adaptive
    /// draft length. Unset: measured defaults for the device (CPU 0.25, CUDA 0.05); lower drafts
    /// longer and more often.
    #[serde(default)]
    pub speculative_row_cost: Option<f64>,
    /// Cost of one token proposed by a `draft:PATH` model, in target decode steps, for the
    /// adaptive draft length. Unset: the draft's weight bytes over the target's (right when both
    /// run on the CPU; set a measured step-time ratio for a CUDA target). 0 prices verification
    /// only.
    #[serde(default)]
    pub speculative_draft_cost: Option<f64>,
    /// Stop generations that repeat one span (default on: 3 copies of >= 32 tokens).
    #[serde(default)]
    pub loop_guard: LoopGuardConfig,
    /// Time to first token this lane aims at, in ms: lower-priority prefill is sized by the
    /// measured step cost so that a request arriving here meets it (`sched::pacing`). Unset: the
    /// device's default (CPU 300, CUDA 50).
    #[serde(default)]
    pub target_ttft_ms: Option<f64>,
    /// Gap between tokens this lane aims at, in ms: while the lane has work, no step carrying
    /// lower-priority prefill lasts longer. Unset: the device's default (CPU 150, CUDA 20).
    #[serde(default)]
    pub target_itl_ms: Option<f64>,
}

fn default_num_speculative_tokens() -> usize {
    crate::spec::MAX_SPECULATIVE_TOKENS
}

/// The scheduler knobs as resolved (every value settled; see [`super::layers`] for where each
/// comes from and `SchedulerKnobs` for the file's form).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Tokens (prefill + decode + draft) one step may carry.
    pub max_num_batched_tokens: usize,
    /// Sequences one step may carry.
    pub max_num_seqs: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in tokens (0 = sized by the engine: on CUDA what
    /// `gpu_memory_utilization` leaves after weights and workspace, on the CPU room for a few
    /// full contexts).
    pub kv_pool_tokens: usize,
    /// Prefix-cache page size in tokens, a multiple of `block_size` (0 = the model family's
    /// default: 256 for llama-family models).
    #[serde(default)]
    pub page_tokens: usize,
    /// Directory for evicted KV pages (none = spill off).
    #[serde(default)]
    pub spill_dir: Option<String>,
    /// Bytes the spill directory may hold (0 = spill off).
    #[serde(default)]
    pub spill_budget: u64,
    /// Bytes of evicted page images the spill tier keeps in host memory in front of the
    /// directory (0 = none; only with spill on).
    #[serde(default)]
    pub spill_host_bytes: u64,
    /// Share of the GPU's total memory the engine may use (weights + workspace + KV pool), per
    /// rank; vLLM's `--gpu-memory-utilization`. Ignored on the CPU.
    #[serde(default = "default_gpu_memory_utilization")]
    pub gpu_memory_utilization: f64,
    /// Size lower lanes' prefill to higher lanes' latency targets (`target_ttft_ms`,
    /// `target_itl_ms`); off plans by the token budget alone.
    #[serde(default = "default_lane_pacing")]
    pub lane_pacing: bool,
    /// Plan a decode step while the executor runs the one before it, when that step can only be
    /// continued (SGLang's overlap scheduler; `sched::lookahead`). One rank only.
    #[serde(default = "default_overlap_scheduling")]
    pub overlap_scheduling: bool,
    /// With lane pacing: a step that carries lower-lane prefill (with at most those lanes' decodes) stops at a layer boundary
    /// when a higher lane gets work, and resumes after that lane's prefill, in slices between its
    /// decodes (`sched::yielding`; CPU
    /// llama-family backends, one rank).
    #[serde(default = "default_yield_lower_prefill")]
    pub yield_lower_prefill: bool,
    /// With yielding: while a lane with targets decodes and a lower lane prefills, the lane's
    /// decodes run in steps of their own, so the lower steps between them can yield to its next
    /// request (`sched::lane_split`; the CPU default).
    #[serde(default)]
    pub separate_lane_decodes: bool,
}

fn default_gpu_memory_utilization() -> f64 {
    super::layers::DEFAULT_GPU_MEMORY_UTILIZATION
}

fn default_lane_pacing() -> bool {
    true
}

fn default_overlap_scheduling() -> bool {
    true
}

fn default_yield_lower_prefill() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Listen address for every lane port.
    pub host: String,
    pub scheduler: SchedulerConfig,
    #[serde(rename = "lane")]
    pub lanes: Vec<LaneConfig>,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {msg}")]
pub struct ConfigError {
    pub path: String,
    pub msg: String,
}

/// The built-in configuration (`configs/default.toml`, compiled in so a bare binary works).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/default.toml");

impl EngineConfig {
    /// A configuration file resolved with no flags, for a llama-family model on the CPU (what
    /// tests and tools that build an engine directly want).
    pub fn from_toml(text: &str, path: &str) -> Result<Self, ConfigError> {
        use super::layers::{DeviceClass, EngineFile, ModelFamily, SchedulerKnobs};
        let file = EngineFile::from_toml(text, path)?;
        let (cfg, _) = file
            .resolve(&SchedulerKnobs::default(), None, ModelFamily::Llama, DeviceClass::Cpu)
            .map_err(|msg| ConfigError { path: path.into(), msg })?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError { path: path.display().to_string(), msg: e.to_string() })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    pub fn builtin() -> Self {
        Self::from_toml(DEFAULT_CONFIG_TOML, "configs/default.toml").expect("the built-in config is valid")
    }

    pub fn lane(&self, name: &str) -> Option<&LaneConfig> {
        self.lanes.iter().find(|l| l.name == name)
    }

    /// Check cross-field rules, naming the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if self.lanes.is_empty() {
            return Err("at least one [[lane]] is required".into());
        }
        for (i, l) in self.lanes.iter().enumerate() {
            if self.lanes[..i].iter().any(|o| o.name == l.name) {
                return Err(format!("lane name `{}` is used twice", l.name));
            }
            if l.port != 0 && self.lanes[..i].iter().any(|o| o.port == l.port) {
                return Err(format!("port {} is used by two lanes", l.port));
            }
            if l.default_max_tokens == 0 || l.default_max_tokens > l.max_tokens_limit {
                return Err(format!(
                    "lane `{}`: default_max_tokens ({}) must be in 1..=max_tokens_limit ({})",
                    l.name, l.default_max_tokens, l.max_tokens_limit
                ));
            }
            if l.max_queue == 0 {
                return Err(format!("lane `{}`: max_queue must be positive", l.name));
            }
            l.loop_guard.validate().map_err(|e| format!("lane `{}`: {e}", l.name))?;
            crate::spec::validate_num_tokens(l.num_speculative_tokens)
                .map_err(|e| format!("lane `{}`: {e}", l.name))?;
            for (knob, value) in
                [("speculative_row_cost", l.speculative_row_cost), ("speculative_draft_cost", l.speculative_draft_cost)]
            {
                if let Some(c) = value.filter(|c| !(0.0..=4.0).contains(c)) {
                    return Err(format!("lane `{}`: {knob} ({c}) must be in 0..=4", l.name));
                }
            }
            for (knob, value) in [("target_ttft_ms", l.target_ttft_ms), ("target_itl_ms", l.target_itl_ms)] {
                if let Some(ms) = value.filter(|ms| !(ms.is_finite() && *ms > 0.0)) {
                    return Err(format!("lane `{}`: {knob} ({ms}) must be a positive number of milliseconds", l.name));
                }
            }
        }
        let s = &self.scheduler;
        if !(s.gpu_memory_utilization > 0.0 && s.gpu_memory_utilization <= 1.0) {
            return Err(format!("scheduler: gpu_memory_utilization ({}) must be in (0, 1]", s.gpu_memory_utilization));
        }
        if s.max_num_seqs == 0 || s.max_num_batched_tokens == 0 || s.block_size == 0 {
            return Err("scheduler: max_num_seqs, max_num_batched_tokens and block_size must be positive".into());
        }
        if !s.page_tokens.is_multiple_of(s.block_size) {
            return Err(format!(
                "scheduler: page_tokens ({}) must be a multiple of block_size ({})",
                s.page_tokens, s.block_size
            ));
        }
        if s.max_num_batched_tokens < s.max_num_seqs {
            return Err(format!(
                "scheduler: max_num_batched_tokens ({}) must be at least max_num_seqs ({}) so every running sequence can decode each step",
                s.max_num_batched_tokens, s.max_num_seqs
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_config_has_voice_and_agent_lanes() {
        let c = EngineConfig::builtin();
        let voice = c.lane("voice").unwrap();
        let agent = c.lane("agent").unwrap();
        assert_eq!((voice.port, agent.port), (8888, 8889));
        assert!(voice.priority > agent.priority);
        assert_eq!(voice.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(agent.thinking, Some(true));
    }

    #[test]
    fn invalid_configs_name_the_problem() {
        let mut c = EngineConfig::builtin();
        c.lanes[1].port = c.lanes[0].port;
        assert!(c.validate().unwrap_err().contains("port 8888"));
        let mut c = EngineConfig::builtin();
        c.lanes[0].speculative_row_cost = Some(-0.5);
        assert!(c.validate().unwrap_err().contains("speculative_row_cost (-0.5)"));
        c.lanes[0].speculative_row_cost = Some(0.05);
        assert!(c.validate().is_ok());
        c.lanes[0].speculative_draft_cost = Some(f64::NAN);
        assert!(c.validate().unwrap_err().contains("speculative_draft_cost (NaN) must be in 0..=4"));
        c.lanes[0].speculative_draft_cost = Some(0.0);
        assert!(c.validate().is_ok());
        c.lanes[0].target_itl_ms = Some(0.0);
        assert!(c.validate().unwrap_err().contains("target_itl_ms (0) must be a positive"));
        c.lanes[0].target_itl_ms = Some(40.0);
        c.lanes[0].target_ttft_ms = Some(f64::INFINITY);
        assert!(c.validate().unwrap_err().contains("target_ttft_ms (inf)"));
        let e = EngineConfig::from_toml("host = 1", "x.toml").unwrap_err().to_string();
        assert!(e.starts_with("x.toml"), "{e}");
    }
}
