//! Starting the engine (scheduler + executor actors over a loaded model) and the handle the
//! HTTP layer holds. Admission checks that need no round trip (unknown lane, not ready, too
//! long, lane queue full) happen here, synchronously, so they map to status codes directly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ractor::{Actor, ActorRef};

use super::drafter::{sources_for, DrafterActor, DrafterMsg, LanePricing};
use super::executor::{ExecutorActor, ExecutorArgs, ExecutorMsg, WorkspaceProbe};
use super::handle::{EngineError, EventStream, GenerationRequest, InferenceEngine, ModelInfo, VisionInfo};
use super::kvpool::PoolStats;
use super::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg, SchedulerStats, SharedCounters};
use crate::backend::KvGeometry;
use crate::config::engine::EngineConfig;
use crate::config::layers::ModelFamily;
use crate::generate::{rank_backend_makers, DeviceSelection, ResolvedDevice, ResolvedKind};
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

/// How the API prepares images for this model: `None` when its checkpoint has no vision tower
/// (a GGUF file, a text-only config).
pub fn vision_info(bundle: &ModelBundle) -> Result<Option<VisionInfo>, EngineError> {
    use crate::model::glm5_next::vision::read_vision_config;
    let dir = bundle.weights.origin();
    if !dir.join("config.json").is_file() {
        return Ok(None);
    }
    let Some((vc, ids)) = read_vision_config(dir).map_err(|e| EngineError::Invalid(e.to_string()))? else {
        return Ok(None);
    };
    let processor = crate::media::ImageProcessor::from_dir(dir).map_err(|e| EngineError::Invalid(e.to_string()))?;
    if processor.patch_size != vc.patch_size
        || processor.merge_size != vc.spatial_merge_size
        || processor.temporal_patch_size != vc.temporal_patch_size
    {
        return Err(EngineError::Invalid(format!(
            "preprocessor_config.json (patch {}, merge {}, temporal {}) disagrees with the vision config \
             (patch {}, merge {}, temporal {})",
            processor.patch_size,
            processor.merge_size,
            processor.temporal_patch_size,
            vc.patch_size,
            vc.spatial_merge_size,
            vc.temporal_patch_size
        )));
    }
    let video = video_info(dir, &vc)?;
    Ok(Some(VisionInfo {
        image_token_id: ids.image_token_id,
        merge_size: vc.spatial_merge_size,
        processor,
        video,
        refused: None,
    }))
}

/// Video needs the template's video token and the image markers each frame pair is wrapped in
/// (`video_token_id`, `image_start_token_id`, `image_end_token_id` in `config.json`); a config
/// without them takes images only.
fn video_info(
    dir: &std::path::Path,
    vc: &crate::model::glm5_next::vision::VisionConfig,
) -> Result<Option<crate::actors::handle::VideoInfo>, EngineError> {
    let text = std::fs::read_to_string(dir.join("config.json")).map_err(|e| EngineError::Invalid(e.to_string()))?;
    let root: serde_json::Value = serde_json::from_str(&text).map_err(|e| EngineError::Invalid(e.to_string()))?;
    let id = |k: &str| root.get(k).and_then(serde_json::Value::as_u64).map(|v| v as u32);
    let (Some(video_token_id), Some(image_start_token_id), Some(image_end_token_id)) =
        (id("video_token_id"), id("image_start_token_id"), id("image_end_token_id"))
    else {
        return Ok(None);
    };
    let processor = crate::media::VideoProcessor::from_dir(dir).map_err(|e| EngineError::Invalid(e.to_string()))?;
    if processor.patch_size != vc.patch_size
        || processor.merge_size != vc.spatial_merge_size
        || processor.temporal_patch_size != vc.temporal_patch_size
    {
        return Err(EngineError::Invalid(format!(
            "video_preprocessor_config.json (patch {}, merge {}, temporal {}) disagrees with the vision config",
            processor.patch_size, processor.merge_size, processor.temporal_patch_size
        )));
    }
    Ok(Some(crate::actors::handle::VideoInfo { video_token_id, image_start_token_id, image_end_token_id, processor }))
}

/// A request's images must sit on runs of the model's placeholder id, in order, one placeholder
/// per merged patch group of their grid, inside the prompt.
fn check_images(req: &GenerationRequest, vision: Option<&VisionInfo>) -> Result<(), String> {
    let Some(v) = vision else { return Err("this model has no vision tower, so it takes no images".into()) };
    if let Some(why) = &v.refused {
        return Err(why.clone());
    }
    let mut end = 0;
    for (k, img) in req.images.iter().enumerate() {
        let tokens = img.grid.iter().product::<usize>() / (v.merge_size * v.merge_size);
        let ok = img.span.start >= end
            && img.span.end <= req.prompt.len()
            && img.span.len() == tokens
            && tokens > 0
            && req.prompt[img.span.clone()].iter().all(|&t| t == v.image_token_id);
        if !ok {
            return Err(format!("image {k} does not match a run of {tokens} placeholder tokens in the prompt"));
        }
        end = img.span.end;
    }
    Ok(())
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
    /// Set by [`Engine::drain`]: new requests are refused (`shutting_down`, 503), `/health` is 503.
    draining: AtomicBool,
}

/// What a drained shutdown did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// Requests still live at the timeout, failed with `shutting_down`.
    pub cancelled: usize,
    /// Cached pages not yet on disk were written to the spill tier and synced (false: spill is
    /// off, or it failed or ran out of time).
    pub flushed: bool,
}

pub use crate::capacity::CapacityCard;

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

/// `--speculative mtp` runs the MTP layer on the CPU beside a CPU target (one rank or a
/// tensor-parallel group, whose rank 0 taps it); the CUDA backend is refused at startup rather
/// than failing later.
fn refuse_mtp_where_unsupported(config: &EngineConfig, device: &ResolvedDevice) -> Result<(), EngineError> {
    let Some(lane) = config.lanes.iter().find(|l| l.speculative == SpeculativeMethod::Mtp) else { return Ok(()) };
    if device.kind == ResolvedKind::Cpu {
        return Ok(());
    }
    Err(EngineError::Invalid(format!(
        "lane `{}`: --speculative mtp is not supported on the CUDA backend yet; it runs on the CPU backend",
        lane.name
    )))
}

pub async fn start_engine(
    bundle: ModelBundle,
    config: EngineConfig,
    opts: EngineOptions,
) -> Result<Arc<Engine>, EngineError> {
    start_engine_with(bundle, config, opts, None).await
}

/// [`start_engine`], as the head of a cluster when `head` is given (`serve --head`): rank 0 runs
/// here, ranks 1.. are `shelfserve worker` processes that join it (`cluster`).
pub async fn start_engine_with(
    bundle: ModelBundle,
    config: EngineConfig,
    opts: EngineOptions,
    head: Option<crate::cluster::head::HeadOptions>,
) -> Result<Arc<Engine>, EngineError> {
    config.validate().map_err(EngineError::Invalid)?;
    // The one place `auto` is settled (probing the driver once): the drafter's verification
    // price, the pool's KV layout and every rank's backend read this.
    let device = opts.device.resolve();
    refuse_mtp_where_unsupported(&config, &device)?;
    let s = &config.scheduler;
    let page_tokens = if s.page_tokens > 0 { s.page_tokens } else { DEFAULT_LLAMA_PAGE_TOKENS };
    // The pool is sized and checked against the device's memory before any weight loads.
    let memory = crate::capacity::probe(&device).map_err(EngineError::Invalid)?;
    let card = crate::capacity::plan(&bundle, &device, s, page_tokens, memory).map_err(EngineError::Invalid)?;
    card.log();
    let pool = card.pool_tokens;
    let kv =
        KvGeometry { block_size: s.block_size, num_blocks: pool.div_ceil(s.block_size), state_slots: s.max_num_seqs };
    let max_context = card.max_context;
    let tokenizer = bundle.tokenizer.clone().map(Arc::new);
    let eos = bundle.eos_token_ids();
    let info = ModelInfo {
        id: opts.served_model_name.clone(),
        max_context,
        vocab_size: bundle.config.vocab_size,
        tokenizer: tokenizer.clone(),
        eos_token_ids: eos.clone(),
        vision: vision_info(&bundle)?.map(|mut v| {
            if opts.device.tensor_parallel > 1 {
                v.refused = Some(format!(
                    "images and video are not served under tensor parallelism (--tp {}): the vision tower runs \
                     on one device only; start the server without --tp to send media",
                    opts.device.tensor_parallel
                ));
            }
            v
        }),
    };
    let counters = Arc::new(SharedCounters {
        ready: AtomicBool::new(false),
        admission: parking_lot::Mutex::new(Admission::new(
            config.lanes.iter().map(|l| LaneQueue { priority: l.priority, max_queue: l.max_queue }).collect(),
            s.max_num_seqs,
        )),
        failed: parking_lot::Mutex::new(None),
    });
    // Only a hybrid model may need page-aligned chunks (its backend may read the recurrent state
    // only at a step's end); an attention-only model's chunks cross pages freely.
    let hybrid = ModelFamily::of_model_type(&bundle.config.model_type) == ModelFamily::Glm5Next;
    let budget = if hybrid {
        align_budget_to_pages(s.max_num_batched_tokens, page_tokens, s.max_num_seqs).map_err(EngineError::Invalid)?
    } else {
        s.max_num_batched_tokens
    };
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
        page_aligned_chunks: false,
    };
    let fingerprint = model_fingerprint(&bundle);
    let pool_identity = PoolIdentity {
        model_fingerprint: fingerprint.clone(),
        // The resolved device and its precision decide the bytes of a block image.
        kv_layout: device.kv_layout(kv.block_size),
        rank: 0,
    };
    let spill_dir = s.spill_dir.as_ref().map(std::path::PathBuf::from);
    let spill = crate::spill::open_store(
        spill_dir.as_ref(),
        s.spill_budget,
        &pool_identity.model_fingerprint,
        &pool_identity.kv_layout,
    );
    // Unnamed actors: ractor's registry is process-wide, and tests run several engines.
    let methods: Vec<_> = config.lanes.iter().map(|l| l.speculative.clone()).collect();
    let bundle = Arc::new(bundle);
    // Target layers some lane's drafter reads: every rank's backend taps them.
    let mut hidden_taps: Vec<usize> = Vec::new();
    let drafter = if methods.iter().any(|m| *m != SpeculativeMethod::None) {
        // A draft model shares the target's vocabulary (checked here, before anything runs), gets
        // a KV store as large as the target's pool, and loads on the blocking pool.
        let target_vocab = VocabIdentity::of(&bundle);
        let draft_opts = DraftModelOptions {
            threads: opts.device.threads,
            pool_tokens: pool,
            dflash_cuda: crate::spec::dflash::device_for(&device),
        };
        let device_row_cost = crate::spec::adaptive::verify_row_cost_for(device.kind);
        let pricing: Vec<LanePricing> = config
            .lanes
            .iter()
            .map(|l| LanePricing {
                row_cost: l.speculative_row_cost.unwrap_or(device_row_cost),
                draft_cost: l.speculative_draft_cost,
            })
            .collect();
        let target_weight_bytes = bundle.stored_weight_bytes();
        let target = Arc::clone(&bundle);
        let sources = tokio::task::spawn_blocking(move || {
            sources_for(&methods, &pricing, &target, &target_vocab, target_weight_bytes, draft_opts)
        })
        .await
        .map_err(|e| EngineError::Executor(format!("loading the draft model: {e}")))?
        .map_err(|e| EngineError::Invalid(e.to_string()))?;
        for src in sources.iter().flatten() {
            hidden_taps.extend(src.hidden_taps());
        }
        hidden_taps.sort_unstable();
        hidden_taps.dedup();
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
    let (makers, head) = match head {
        None => (rank_backend_makers(bundle, &device, kv).map_err(|e| EngineError::Invalid(e.to_string()))?, None),
        Some(h) => {
            let (setup, rank0) = crate::cluster::head::head_rank0(h, bundle, &device, kv, &fingerprint)
                .await
                .map_err(EngineError::Invalid)?;
            (vec![rank0], Some(setup))
        }
    };
    // Every rank, those of other processes included.
    let world = head.as_ref().map_or(makers.len(), |h| h.world);
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
            // The card's figure: the configured bytes capped by the host's available memory.
            spill_host_bytes: card.spill_host_bytes,
            world,
            cluster_group: head.as_ref().map(|h| h.group.clone()),
            pacing: lane_pacing(&config, device.kind),
            overlap: config.scheduler.overlap_scheduling,
            yield_lower_prefill: config.scheduler.yield_lower_prefill,
            separate_lane_decodes: config.scheduler.separate_lane_decodes,
        },
    )
    .await
    .map_err(|e| EngineError::Executor(e.to_string()))?;
    if let Some(head) = head {
        head.attach(scheduler.clone(), kv, fingerprint).await.map_err(EngineError::Executor)?;
    }
    // One rank alone can run a profiling step; ranks joined by collectives would each have to.
    let workspace_probe =
        card.gpu.filter(|_| world == 1).map(|g| WorkspaceProbe { tokens: budget, reserved: g.workspace });
    let mut executors = Vec::with_capacity(makers.len());
    for (rank, make) in makers.into_iter().enumerate() {
        let taps = hidden_taps.clone();
        let make_backend = Box::new(move || {
            let mut backend = make().map_err(|e| e.to_string())?;
            backend.set_hidden_taps(&taps).map_err(|e| format!("hidden-state taps for the drafter: {e}"))?;
            Ok(backend)
        });
        let (executor, _) = Actor::spawn(
            None,
            ExecutorActor,
            ExecutorArgs { make_backend, scheduler: scheduler.clone(), rank, workspace_probe, group: None },
        )
        .await
        .map_err(|e| EngineError::Executor(e.to_string()))?;
        executors.push(executor);
    }
    Ok(Arc::new(Engine { info, config, counters, scheduler, executors, drafter, draining: AtomicBool::new(false) }))
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

    /// Drained shutdown: refuse new requests from now on, let the live ones finish for up to
    /// `timeout` (then fail them with `shutting_down`), and write the cached pages the spill tier
    /// lacks to disk, synced, within another `timeout`. Call [`shutdown`](Self::shutdown) after.
    pub async fn drain(&self, timeout: std::time::Duration) -> DrainReport {
        use std::time::{Duration, Instant};
        self.draining.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        let mut cancelled = 0;
        // Only while shutting down: the scheduler's counters are the one place that knows when
        // the last live request ended, and a short poll keeps the scheduler free of drain state.
        loop {
            let live = self.stats().await.map(|s| s.waiting + s.running).unwrap_or(0);
            if live == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(live, "shutdown timeout: cancelling the requests still in flight");
                cancelled = live;
                let _ = self.scheduler.cast(SchedulerMsg::CancelAll);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let flush_ms = timeout.as_millis().clamp(1, u64::MAX as u128) as u64;
        let flushed = ractor::call_t!(self.scheduler, SchedulerMsg::FlushToSpill, flush_ms).unwrap_or(false);
        DrainReport { cancelled, flushed }
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
        self.counters.ready.load(Ordering::SeqCst) && !self.is_draining()
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn failure(&self) -> Option<String> {
        self.counters.failed.lock().clone()
    }

    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        let lane_idx = self
            .config
            .lanes
            .iter()
            .position(|l| l.name == req.lane)
            .ok_or_else(|| EngineError::UnknownLane(req.lane.clone()))?;
        self.readiness()?;
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        if !req.images.is_empty() {
            check_images(&req, self.info.vision.as_ref()).map_err(EngineError::Invalid)?;
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
