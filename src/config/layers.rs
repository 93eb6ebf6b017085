//! Where each scheduler knob's value comes from. Precedence, highest first:
//! command-line flag > environment variable > configuration file > model-family default >
//! device default. Flags and environment variables are settled by clap (a flag beats its
//! variable; neither has a clap default, so an absent flag never masks the file); this module
//! layers the rest. Plain data and functions, no I/O.

use serde::{Deserialize, Serialize};

use super::engine::{ConfigError, EngineConfig, LaneConfig, SchedulerConfig};

/// The model families whose defaults differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// Llama, Mistral, Qwen2/3, SmolLM: paged K/V per layer.
    Llama,
    /// GLM-5.3-Flash: MLA latents + indexer keys per token, KDA state per sequence.
    Glm5Next,
}

impl ModelFamily {
    /// The family of an HF `model_type` (or GGUF architecture).
    pub fn of_model_type(model_type: &str) -> Self {
        if crate::model::glm5_next::MODEL_TYPES.contains(&model_type) {
            ModelFamily::Glm5Next
        } else {
            ModelFamily::Llama
        }
    }
}

/// The device class whose defaults differ (`auto` already settled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceClass {
    Cpu,
    Cuda,
}

/// Where a knob's value came from, for the startup log and for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag or its environment variable (clap already let the flag win).
    CommandLine,
    File,
    Family,
    Device,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::CommandLine => "flag/env",
            Source::File => "file",
            Source::Family => "family",
            Source::Device => "device",
        }
    }
}

/// Scheduler knobs as one source states them; `None` where that source is silent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerKnobs {
    pub max_num_batched_tokens: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub block_size: Option<usize>,
    pub kv_pool_tokens: Option<usize>,
    pub page_tokens: Option<usize>,
    pub spill_dir: Option<String>,
    pub spill_budget: Option<u64>,
    pub spill_host_bytes: Option<u64>,
    pub gpu_memory_utilization: Option<f64>,
    pub lane_pacing: Option<bool>,
    pub overlap_scheduling: Option<bool>,
    pub yield_lower_prefill: Option<bool>,
    pub separate_lane_decodes: Option<bool>,
}

/// GPU scheduler defaults: a step wide enough to keep an H200 busy at 256 decoding streams
/// (issue 25: 128 streams at the CPU defaults preempted and ran at two thirds of the rate).
pub const CUDA_MAX_NUM_SEQS: usize = 256;
pub const CUDA_MAX_NUM_BATCHED_TOKENS: usize = 8192;
/// vLLM's meaning: the share of the device's total memory this engine may use.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.90;
/// A lane's queue holds this many requests per sequence a step can carry unless the file says
/// otherwise, so a burst of `max_num_seqs` requests always fits the queue.
pub const QUEUE_PER_SEQUENCE: usize = 2;

/// Host memory for recently evicted pages in front of the spill directory on a GPU: a restore
/// from it is a copy to the device (6k tokens of an 8B model, 805 MB, in well under the time to
/// recompute them), where a read from disk is slower than recomputing. Filled only as pages are
/// evicted, and capped at a quarter of the host's available memory at startup.
pub const CUDA_SPILL_HOST_BYTES: u64 = 16 << 30;

/// The device's defaults: CPU values are today's small budgets; CUDA's fit a GPU.
pub fn device_defaults(device: DeviceClass) -> SchedulerKnobs {
    let (seqs, batched) = match device {
        DeviceClass::Cpu => (32, 512),
        DeviceClass::Cuda => (CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS),
    };
    SchedulerKnobs {
        max_num_batched_tokens: Some(batched),
        max_num_seqs: Some(seqs),
        block_size: Some(16),
        // 0: sized by the engine (host budget on the CPU, device memory on CUDA).
        kv_pool_tokens: Some(0),
        page_tokens: None,
        spill_dir: None,
        spill_budget: Some(0),
        // On the CPU the pool is host memory already: a bigger pool beats a copy of its pages.
        spill_host_bytes: Some(match device {
            DeviceClass::Cpu => 0,
            DeviceClass::Cuda => CUDA_SPILL_HOST_BYTES,
        }),
        gpu_memory_utilization: Some(DEFAULT_GPU_MEMORY_UTILIZATION),
        lane_pacing: Some(true),
        // On a GPU the host time between steps idles the device; on the CPU the host is the
        // device, and a step there lasts far longer than the planning it would hide.
        overlap_scheduling: Some(device == DeviceClass::Cuda),
        yield_lower_prefill: Some(true),
        // A step's fixed cost is small next to the CPU's ITL target, but on a GPU a decode step is
        // mostly the weights' read, so a step of its own would cost lower lanes a whole pass.
        separate_lane_decodes: Some(device == DeviceClass::Cpu),
    }
}

/// The family's defaults: its prefix-cache page and block, and for GLM a step of two whole
/// pages, so prefill chunks end on page boundaries without a startup correction.
pub fn family_defaults(family: ModelFamily) -> SchedulerKnobs {
    match family {
        ModelFamily::Llama => SchedulerKnobs { page_tokens: Some(256), ..Default::default() },
        ModelFamily::Glm5Next => SchedulerKnobs {
            block_size: Some(64),
            page_tokens: Some(3584),
            max_num_batched_tokens: Some(2 * 3584),
            ..Default::default()
        },
    }
}

/// Which layer gave each knob, by knob name (TOML key).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Provenance(pub Vec<(&'static str, Source)>);

impl Provenance {
    pub fn of(&self, knob: &str) -> Option<Source> {
        self.0.iter().find(|(k, _)| *k == knob).map(|(_, s)| *s)
    }

    /// `knob=source` pairs, for the log.
    pub fn summary(&self) -> String {
        self.0.iter().map(|(k, s)| format!("{k}={}", s.as_str())).collect::<Vec<_>>().join(" ")
    }
}

/// A configuration file as written: every scheduler knob optional, lanes whole.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineFile {
    pub host: Option<String>,
    #[serde(default)]
    pub scheduler: SchedulerKnobs,
    #[serde(rename = "lane", default)]
    pub lanes: Vec<LaneConfig>,
}

impl EngineFile {
    pub fn from_toml(text: &str, path: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError { path: path.into(), msg: e.to_string() })
    }

    /// Layer `command_line` over this file over the family's and the device's defaults, and
    /// give every lane without a `max_queue` one that holds a burst of `max_num_seqs`.
    pub fn resolve(
        &self,
        command_line: &SchedulerKnobs,
        host: Option<&str>,
        family: ModelFamily,
        device: DeviceClass,
    ) -> Result<(EngineConfig, Provenance), String> {
        let layers = [
            (Source::CommandLine, command_line.clone()),
            (Source::File, self.scheduler.clone()),
            (Source::Family, family_defaults(family)),
            (Source::Device, device_defaults(device)),
        ];
        let mut prov = Provenance::default();
        // The first layer that states the knob gives its value (and is recorded as its source).
        macro_rules! pick {
            ($field:ident) => {{
                let found = layers.iter().find_map(|(src, k)| k.$field.clone().map(|v| (*src, v)));
                found.map(|(src, v)| {
                    prov.0.push((stringify!($field), src));
                    v
                })
            }};
        }
        // Every knob but spill_dir has a device default, so the fallbacks below are never used.
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: pick!(max_num_batched_tokens).unwrap_or_default(),
            max_num_seqs: pick!(max_num_seqs).unwrap_or_default(),
            block_size: pick!(block_size).unwrap_or_default(),
            kv_pool_tokens: pick!(kv_pool_tokens).unwrap_or_default(),
            page_tokens: pick!(page_tokens).unwrap_or_default(),
            spill_dir: pick!(spill_dir),
            spill_budget: pick!(spill_budget).unwrap_or_default(),
            spill_host_bytes: pick!(spill_host_bytes).unwrap_or_default(),
            gpu_memory_utilization: pick!(gpu_memory_utilization).unwrap_or(DEFAULT_GPU_MEMORY_UTILIZATION),
            lane_pacing: pick!(lane_pacing).unwrap_or(true),
            overlap_scheduling: pick!(overlap_scheduling).unwrap_or(true),
            yield_lower_prefill: pick!(yield_lower_prefill).unwrap_or(true),
            separate_lane_decodes: pick!(separate_lane_decodes).unwrap_or(false),
        };
        let mut lanes = self.lanes.clone();
        for lane in lanes.iter_mut().filter(|l| l.max_queue == 0) {
            lane.max_queue = QUEUE_PER_SEQUENCE * scheduler.max_num_seqs;
        }
        for lane in lanes.iter().filter(|l| l.max_queue < scheduler.max_num_seqs) {
            tracing::warn!(
                lane = %lane.name,
                max_queue = lane.max_queue,
                max_num_seqs = scheduler.max_num_seqs,
                "this lane's max_queue is smaller than max_num_seqs: a burst the scheduler could run at once gets 429s"
            );
        }
        let cfg = EngineConfig {
            host: host.map(str::to_string).or_else(|| self.host.clone()).unwrap_or_else(|| "127.0.0.1".into()),
            scheduler,
            lanes,
        };
        cfg.validate()?;
        Ok((cfg, prov))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
        [scheduler]
        block_size = 32
        max_num_seqs = 8
        [[lane]]
        name = "voice"
        port = 8888
        priority = 10
        default_max_tokens = 16
        max_tokens_limit = 64
    "#;

    fn file() -> EngineFile {
        EngineFile::from_toml(FILE, "t.toml").unwrap()
    }

    #[test]
    fn the_file_beats_family_and_device_defaults_and_a_flag_beats_the_file() {
        let (cfg, prov) =
            file().resolve(&SchedulerKnobs::default(), None, ModelFamily::Glm5Next, DeviceClass::Cuda).unwrap();
        let s = &cfg.scheduler;
        assert_eq!((s.block_size, prov.of("block_size")), (32, Some(Source::File)), "file over family's 64");
        assert_eq!((s.max_num_seqs, prov.of("max_num_seqs")), (8, Some(Source::File)), "file over device's 256");
        assert_eq!((s.page_tokens, prov.of("page_tokens")), (3584, Some(Source::Family)));
        assert_eq!((s.max_num_batched_tokens, prov.of("max_num_batched_tokens")), (7168, Some(Source::Family)));
        assert_eq!((s.gpu_memory_utilization, prov.of("gpu_memory_utilization")), (0.9, Some(Source::Device)));
        let flags = SchedulerKnobs { block_size: Some(64), ..Default::default() };
        let (cfg, prov) = file().resolve(&flags, Some("0.0.0.0"), ModelFamily::Glm5Next, DeviceClass::Cuda).unwrap();
        assert_eq!((cfg.scheduler.block_size, prov.of("block_size")), (64, Some(Source::CommandLine)));
        assert_eq!(cfg.host, "0.0.0.0");
    }

    #[test]
    fn device_defaults_differ_and_lane_queues_hold_a_full_burst() {
        let empty = EngineFile { lanes: file().lanes, ..Default::default() };
        let none = SchedulerKnobs::default();
        let (cpu, _) = empty.resolve(&none, None, ModelFamily::Llama, DeviceClass::Cpu).unwrap();
        let s = &cpu.scheduler;
        assert_eq!((s.max_num_seqs, s.max_num_batched_tokens, s.block_size, s.page_tokens), (32, 512, 16, 256));
        let (gpu, prov) = empty.resolve(&none, None, ModelFamily::Llama, DeviceClass::Cuda).unwrap();
        let s = &gpu.scheduler;
        assert_eq!((s.max_num_seqs, s.max_num_batched_tokens, s.block_size, s.page_tokens), (256, 8192, 16, 256));
        assert_eq!(prov.of("max_num_seqs"), Some(Source::Device));
        assert!(gpu.lanes.iter().all(|l| l.max_queue >= s.max_num_seqs), "{:?}", gpu.lanes);
        // A queue the file sets stays what the file says.
        let mut explicit = empty.clone();
        explicit.lanes[0].max_queue = 5;
        let (c, _) = explicit.resolve(&none, None, ModelFamily::Llama, DeviceClass::Cuda).unwrap();
        assert_eq!(c.lanes[0].max_queue, 5);
    }

    #[test]
    fn an_unknown_key_and_a_bad_resolved_value_are_named() {
        let e = EngineFile::from_toml("[scheduler]\nblok_size = 3\n", "x.toml").unwrap_err().to_string();
        assert!(e.contains("x.toml") && e.contains("blok_size"), "{e}");
        let flags = SchedulerKnobs { page_tokens: Some(100), ..Default::default() };
        let e = file().resolve(&flags, None, ModelFamily::Llama, DeviceClass::Cpu).unwrap_err();
        assert!(e.contains("page_tokens (100) must be a multiple of block_size (32)"), "{e}");
    }
}
