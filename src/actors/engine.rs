//! Starting the engine (scheduler + executor actors over a loaded model) and the handle the
//! HTTP layer holds. Admission checks that need no round trip (unknown lane, not ready, too
//! long, lane queue full) happen here, synchronously, so they map to status codes directly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ractor::{Actor, ActorRef};

use super::drafter::{sources_for, DrafterActor, DrafterMsg, LanePricing};
use super::executor::{ExecutorActor, ExecutorArgs, ExecutorMsg};
use super::handle::{EngineError, EventStream, GenerationRequest, InferenceEngine, ModelInfo};
use super::kvpool::PoolStats;
use super::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg, SchedulerStats, SharedCounters};
use crate::backend::KvGeometry;
use crate::config::engine::EngineConfig;
use crate::generate::{rank_backend_makers, DeviceSelection, ResolvedKind};
use crate::kv::PoolIdentity;
use crate::model::ModelBundle;
use crate::sched::admission::{Admission, LaneQueue};
use crate::sched::{
    align_budget_to_pages, DeviceDefaults, LaneTarget, Pacing, PolicyConfig, StepCostModel, COST_DECAY,
};
use crate::spec::draft_model::{DraftModelOptions, VocabIdentity};
use crate::spec::SpeculativeMethod;

/// Prefix-cache page size for llama-family models when the configuration does not set one: 16
/// blocks of 16 tokens. Small enough that a follow-up turn loses at most 255 tokens of reuse and
/// that chunk cuts at page boundaries cost little on the CPU (a 256-row GEMM is already
/// efficient); large enough that the index stays small (a 32k context is 128 pages).
pub const DEFAULT_LLAMA_PAGE_TOKENS: usize = 256;

/// Identifies the weights for the prefix cache and the spill index: a SHA-256 over the model
/// configuration, every tensor's name, dtype and shape, and the first and last 4 KiB of every
/// tensor's bytes (memory-mapped, so this costs a few page reads, not a pass over the weights).
/// Two models that differ in any tensor's edges, shape or config never share pages.
pub fn model_fingerprint(bundle: &ModelBundle) -> String {
    use sha2::{Digest, Sha256};
    const EDGE: usize = 4096;
    let mut h = Sha256::new();
    h.update(format!("{:?}", bundle.config).as_bytes());
    let mut names = bundle.weights.tensor_names();
    names.sort_unstable();
    for name in names {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        if let Some(t) = bundle.weights.tensor(&name) {
            h.update(format!("{:?}{:?}", t.dtype, t.shape).as_bytes());
            h.update((t.data.len() as u64).to_le_bytes());
            h.update(&t.data[..t.data.len().min(EDGE)]);
            h.update(&t.data[t.data.len().saturating_sub(EDGE)..]);
        }
    }
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Events buffered per request before the request actor waits for the client.
const EVENT_BUFFER: usize = 256;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Which device the executor runs on (and its CPU threads / CUDA settings).
    pub device: DeviceSelection,
    /// Name clients use in `model`.
    pub served_model_name: String,
}

/// The running engine: a cheap handle to the scheduler plus admission state.
pub struct Engine {
    info: ModelInfo,
    config: EngineConfig,
    counters: Arc<SharedCounters>,
    scheduler: ActorRef<SchedulerMsg>,
    /// One per tensor-parallel rank, rank 0 first.
    executors: Vec<ActorRef<ExecutorMsg>>,
    drafter: Option<ActorRef<DrafterMsg>>,
}

/// What the startup capacity card reports. Computed before the weights are loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapacityCard {
    pub weight_bytes: u64,
    /// f32 K and V for every layer and KV head.
    pub kv_bytes_per_token: u64,
    pub pool_tokens: usize,
    /// The longest prompt + reply one sequence can have: the model's context or the pool,
    /// whichever is smaller.
    pub max_context: usize,
    pub page_tokens: usize,
    pub spill_budget: u64,
    /// Host bytes of one page's recurrent-state snapshot (hybrid models; 0 otherwise). Every
    /// cached page of a hybrid model keeps one, so a pool full of cached pages holds
    /// `pool_tokens / page_tokens` of them (for GLM-5.3-Flash 146 MiB each against 39 MiB of KV
    /// per 3584-token page: the snapshots, not the KV, decide what fits).
    pub snapshot_bytes_per_page: u64,
}

impl CapacityCard {
    pub fn new(bundle: &ModelBundle, pool_tokens: usize, page_tokens: usize, spill_budget: u64) -> Self {
        let c = &bundle.config;
        let weight_bytes = bundle.stored_weight_bytes();
        let kv_bytes_per_token = (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4) as u64;
        // The CPU backend's slot image: f32 KDA states and conv windows.
        let snapshot_bytes_per_page = if crate::model::glm5_next::MODEL_TYPES.contains(&c.model_type.as_str()) {
            crate::model::glm5_next::read_config(bundle.weights.origin())
                .map(|g| crate::model::glm5_next::accounting::decode_cost(&g, 1, 4.0, 4).recurrent_state_bytes)
                .unwrap_or(0)
        } else {
            0
        };
        Self {
            weight_bytes,
            kv_bytes_per_token,
            pool_tokens,
            max_context: c.max_position_embeddings.min(pool_tokens),
            page_tokens,
            spill_budget,
            snapshot_bytes_per_page: if page_tokens > 0 { snapshot_bytes_per_page } else { 0 },
        }
    }

    pub fn kv_pool_bytes(&self) -> u64 {
        self.kv_bytes_per_token * self.pool_tokens as u64
    }

    /// Host bytes of recurrent-state snapshots when every page of the pool is a cached page.
    pub fn max_snapshot_bytes(&self) -> u64 {
        match self.page_tokens {
            0 => 0,
            p => (self.pool_tokens / p) as u64 * self.snapshot_bytes_per_page,
        }
    }

    /// Refuses a configuration that cannot fit in `mem_available` bytes, naming the number to
    /// change.
    pub fn check_fits(&self, mem_available: Option<u64>) -> Result<(), String> {
        let Some(avail) = mem_available else { return Ok(()) };
        let need = self.weight_bytes + self.kv_pool_bytes();
        let with_snapshots = need + self.max_snapshot_bytes();
        if need <= avail && with_snapshots > avail {
            let pages = avail.saturating_sub(need) / self.snapshot_bytes_per_page.max(1);
            return Err(format!(
                "weights and KV pool fit, but the recurrent-state snapshots of a pool full of cached pages ({} pages x \
                 {} MiB = {} MiB) do not: {} MiB available. Lower --kv-pool-tokens (kv_pool_tokens) or raise \
                 --page-tokens (page_tokens) so that at most {pages} pages fit",
                self.pool_tokens / self.page_tokens.max(1),
                self.snapshot_bytes_per_page >> 20,
                self.max_snapshot_bytes() >> 20,
                avail >> 20
            ));
        }
        if need > avail {
            let kv_room = avail.saturating_sub(self.weight_bytes) / self.kv_bytes_per_token.max(1);
            return Err(format!(
                "weights ({} MiB) + KV pool ({} tokens x {} bytes = {} MiB) need {} MiB but only {} MiB of memory \
                 is available: lower --kv-pool-tokens (kv_pool_tokens) to at most {kv_room}",
                self.weight_bytes >> 20,
                self.pool_tokens,
                self.kv_bytes_per_token,
                self.kv_pool_bytes() >> 20,
                need >> 20,
                avail >> 20
            ));
        }
        Ok(())
    }

    pub fn log(&self) {
        tracing::info!(
            weights_mib = self.weight_bytes >> 20,
            kv_bytes_per_token = self.kv_bytes_per_token,
            pool_tokens = self.pool_tokens,
            kv_pool_mib = self.kv_pool_bytes() >> 20,
            max_context = self.max_context,
            page_tokens = self.page_tokens,
            spill_budget_mib = self.spill_budget >> 20,
            snapshot_mib_per_page = self.snapshot_bytes_per_page >> 20,
            max_snapshot_mib = self.max_snapshot_bytes() >> 20,
            "capacity"
        );
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes (None where it cannot be read).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// KV pool size in tokens: the configured size, or room for a few full-context sequences.
pub fn pool_tokens(cfg: &EngineConfig, context: usize) -> usize {
    if cfg.scheduler.kv_pool_tokens > 0 {
        cfg.scheduler.kv_pool_tokens
    } else {
        context.clamp(4096, 16384) * 2
    }
}

/// Spawn the actors and start loading the model on the executor thread. Returns at once;
/// `is_ready()` turns true when the weights are loaded.
/// Lane pacing for this configuration on `device`: each lane's targets (its own, else the
/// device's defaults) and the device's starting step cost; `None` when `lane_pacing` is off.
pub fn lane_pacing(config: &EngineConfig, device: ResolvedKind) -> Option<Pacing> {
    if !config.scheduler.lane_pacing {
        return None;
    }
    let d = match device {
        ResolvedKind::Cuda => DeviceDefaults::CUDA,
        ResolvedKind::Cpu => DeviceDefaults::CPU,
    };
    let targets = config
        .lanes
        .iter()
        .map(|l| LaneTarget {
            priority: l.priority,
            ttft: l.target_ttft_ms.map_or(d.ttft, |ms| ms / 1e3),
            itl: l.target_itl_ms.map_or(d.itl, |ms| ms / 1e3),
        })
        .collect();
    Some(Pacing::new(targets, StepCostModel::new(d.cost, COST_DECAY), config.scheduler.block_size))
}

pub async fn start_engine(
    bundle: ModelBundle,
    config: EngineConfig,
    opts: EngineOptions,
) -> Result<Arc<Engine>, EngineError> {
    config.validate().map_err(EngineError::Invalid)?;
    // The one place `auto` is settled (probing the driver once): the drafter's verification
    // price, the pool's KV layout and every rank's backend read this.
    let device = opts.device.resolve();
    let s = &config.scheduler;
    let model_ctx = bundle.config.max_position_embeddings;
    let pool = pool_tokens(&config, model_ctx);
    let kv =
        KvGeometry { block_size: s.block_size, num_blocks: pool.div_ceil(s.block_size), state_slots: s.max_num_seqs };
    let max_context = model_ctx.min(kv.capacity_tokens());
    let tokenizer = bundle.tokenizer.clone().map(Arc::new);
    let eos = bundle.eos_token_ids();
    let info = ModelInfo {
        id: opts.served_model_name.clone(),
        max_context,
        vocab_size: bundle.config.vocab_size,
        tokenizer: tokenizer.clone(),
        eos_token_ids: eos.clone(),
    };
    let counters = Arc::new(SharedCounters {
        ready: AtomicBool::new(false),
        admission: parking_lot::Mutex::new(Admission::new(
            config.lanes.iter().map(|l| LaneQueue { priority: l.priority, max_queue: l.max_queue }).collect(),
            s.max_num_seqs,
        )),
        failed: parking_lot::Mutex::new(None),
    });
    let page_tokens = if s.page_tokens > 0 { s.page_tokens } else { DEFAULT_LLAMA_PAGE_TOKENS };
    let budget =
        align_budget_to_pages(s.max_num_batched_tokens, page_tokens, s.max_num_seqs).map_err(EngineError::Invalid)?;
    if budget != s.max_num_batched_tokens {
        tracing::warn!(
            configured = s.max_num_batched_tokens,
            corrected = budget,
            page_tokens,
            "max_num_batched_tokens corrected so that prefill chunks fill whole pages (every page \
             boundary is a chunk boundary; a misaligned budget would waste each step's tail)"
        );
    }
    let policy = PolicyConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: s.max_num_seqs,
        block_size: kv.block_size,
        num_blocks: kv.num_blocks,
        page_tokens,
        // Known once the backend is built (`ExecutorReady` reports its state-slot size).
        recurrent_state: false,
    };
    let card = CapacityCard::new(&bundle, kv.capacity_tokens(), page_tokens, s.spill_budget);
    card.log();
    card.check_fits(mem_available()).map_err(EngineError::Invalid)?;
    let fingerprint = model_fingerprint(&bundle);
    let spill_dir = s.spill_dir.as_ref().map(std::path::PathBuf::from);
    let spill = crate::spill::open_store(spill_dir.as_ref(), s.spill_budget, &fingerprint);
    let pool_identity = PoolIdentity {
        model_fingerprint: fingerprint,
        // The resolved device and its precision decide the bytes of a block image.
        kv_layout: device.kv_layout(kv.block_size),
        rank: 0,
    };
    // Unnamed actors: ractor's registry is process-wide, and tests run several engines.
    let methods: Vec<_> = config.lanes.iter().map(|l| l.speculative.clone()).collect();
    let drafter = if methods.iter().any(|m| *m != SpeculativeMethod::None) {
        // A draft model shares the target's vocabulary (checked here, before anything runs), gets
        // a KV store as large as the target's pool, and loads on the blocking pool.
        let target_vocab = VocabIdentity::of(&bundle);
        let draft_opts = DraftModelOptions { threads: opts.device.threads, pool_tokens: pool };
        let device_row_cost = crate::spec::adaptive::verify_row_cost_for(device.kind);
        let pricing: Vec<LanePricing> = config
            .lanes
            .iter()
            .map(|l| LanePricing {
                row_cost: l.speculative_row_cost.unwrap_or(device_row_cost),
                draft_cost: l.speculative_draft_cost,
            })
            .collect();
        let target_weight_bytes = card.weight_bytes;
        let sources = tokio::task::spawn_blocking(move || {
            sources_for(&methods, &pricing, &target_vocab, target_weight_bytes, draft_opts)
        })
        .await
        .map_err(|e| EngineError::Executor(format!("loading the draft model: {e}")))?
        .map_err(|e| EngineError::Invalid(e.to_string()))?;
        let (d, _) =
            Actor::spawn(None, DrafterActor, sources).await.map_err(|e| EngineError::Executor(e.to_string()))?;
        for l in config.lanes.iter().filter(|l| l.speculative != SpeculativeMethod::None) {
            tracing::info!(lane = %l.name, method = %String::from(l.speculative.clone()), k = l.num_speculative_tokens, "speculative decoding on");
        }
        Some(d)
    } else {
        None
    };
    // One executor per tensor-parallel rank, each loading its shard on its own thread; the
    // scheduler learns them from their ready reports and sends every step to all of them.
    let makers = rank_backend_makers(Arc::new(bundle), &device, kv).map_err(|e| EngineError::Invalid(e.to_string()))?;
    let (scheduler, _) = Actor::spawn(
        None,
        SchedulerActor,
        SchedulerArgs {
            lanes: config.lanes.clone(),
            policy,
            counters: Arc::clone(&counters),
            tokenizer,
            eos_token_ids: eos,
            max_context,
            drafter: drafter.clone(),
            pool_identity,
            spill,
            world: makers.len(),
            pacing: lane_pacing(&config, device.kind),
        },
    )
    .await
    .map_err(|e| EngineError::Executor(e.to_string()))?;
    let mut executors = Vec::with_capacity(makers.len());
    for (rank, make) in makers.into_iter().enumerate() {
        let make_backend = Box::new(move || make().map_err(|e| e.to_string()));
        let (executor, _) =
            Actor::spawn(None, ExecutorActor, ExecutorArgs { make_backend, scheduler: scheduler.clone(), rank })
                .await
                .map_err(|e| EngineError::Executor(e.to_string()))?;
        executors.push(executor);
    }
    Ok(Arc::new(Engine { info, config, counters, scheduler, executors, drafter }))
}

impl Engine {
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Scheduler counters (waiting, running, blocks) — for tests and diagnostics.
    pub async fn stats(&self) -> Option<SchedulerStats> {
        ractor::call_t!(self.scheduler, SchedulerMsg::Stats, 5000).ok()
    }

    /// KV pool occupancy and prefix-cache counters (`None` while loading).
    pub async fn pool_stats(&self) -> Option<PoolStats> {
        ractor::call_t!(self.scheduler, SchedulerMsg::PoolStats, 5000).ok()
    }

    /// Sequences each lane's draft source holds state for (`None` without drafting lanes); all
    /// zero once no drafted request is live.
    pub async fn drafter_sequences(&self) -> Option<Vec<usize>> {
        let d = self.drafter.as_ref()?;
        ractor::call_t!(d, |reply| DrafterMsg::Held { reply }, 5000).ok()
    }

    /// Stop the actors; the executor thread ends after its current step and frees the weights
    /// and KV memory.
    pub fn shutdown(&self) {
        self.counters.ready.store(false, Ordering::SeqCst);
        self.scheduler.stop(None);
        self.executors.iter().for_each(|e| e.stop(None));
        if let Some(d) = &self.drafter {
            d.stop(None);
        }
    }
}

impl InferenceEngine for Engine {
    fn model(&self) -> &ModelInfo {
        &self.info
    }

    fn is_ready(&self) -> bool {
        self.counters.ready.load(Ordering::SeqCst)
    }

    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        let lane_idx = self
            .config
            .lanes
            .iter()
            .position(|l| l.name == req.lane)
            .ok_or_else(|| EngineError::UnknownLane(req.lane.clone()))?;
        if let Some(e) = self.counters.failed.lock().clone() {
            return Err(EngineError::NotReady(format!("the executor failed ({e}); restart the engine")));
        }
        if !self.is_ready() {
            return Err(EngineError::NotReady("the model is still loading".into()));
        }
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        let needed = req.prompt.len() + req.max_tokens;
        if needed > self.info.max_context {
            return Err(EngineError::TooLong {
                needed,
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit: self.info.max_context,
            });
        }
        let lane = &self.config.lanes[lane_idx];
        if let Err(full) = self.counters.admission.lock().try_admit(lane_idx) {
            return Err(EngineError::QueueFull { lane: lane.name.clone(), capacity: full.capacity });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(EVENT_BUFFER);
        if self.scheduler.cast(SchedulerMsg::Submit { req, lane: lane_idx, events: tx }).is_err() {
            self.counters.admission.lock().release(lane_idx);
            return Err(EngineError::ShuttingDown);
        }
        Ok(rx)
    }
}
