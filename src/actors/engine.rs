//! Starting the engine (scheduler + executor actors over a loaded model) and the handle the
//! HTTP layer holds. Admission checks that need no round trip (unknown lane, not ready, too
//! long, lane queue full) happen here, synchronously, so they map to status codes directly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ractor::{Actor, ActorRef};

use super::drafter::{sources_for, DrafterActor, DrafterMsg};
use super::executor::{ExecutorActor, ExecutorArgs, ExecutorMsg};
use super::handle::{EngineError, EventStream, GenerationRequest, InferenceEngine, ModelInfo};
use super::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg, SchedulerStats, SharedCounters};
use crate::backend::KvGeometry;
use crate::config::engine::EngineConfig;
use crate::generate::{make_backend, DeviceSelection};
use crate::model::ModelBundle;
use crate::sched::PolicyConfig;
use crate::spec::SpeculativeMethod;

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
    executor: ActorRef<ExecutorMsg>,
    drafter: Option<ActorRef<DrafterMsg>>,
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
pub async fn start_engine(
    bundle: ModelBundle,
    config: EngineConfig,
    opts: EngineOptions,
) -> Result<Arc<Engine>, EngineError> {
    config.validate().map_err(EngineError::Invalid)?;
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
        queued: config.lanes.iter().map(|_| AtomicUsize::new(0)).collect(),
        failed: parking_lot::Mutex::new(None),
    });
    let policy = PolicyConfig {
        max_num_batched_tokens: s.max_num_batched_tokens,
        max_num_seqs: s.max_num_seqs,
        block_size: kv.block_size,
        num_blocks: kv.num_blocks,
    };
    // Unnamed actors: ractor's registry is process-wide, and tests run several engines.
    let methods: Vec<_> = config.lanes.iter().map(|l| l.speculative.clone()).collect();
    let drafter = if methods.iter().any(|m| *m != SpeculativeMethod::None) {
        let sources = sources_for(&methods).map_err(|e| EngineError::Invalid(e.to_string()))?;
        let (d, _) =
            Actor::spawn(None, DrafterActor, sources).await.map_err(|e| EngineError::Executor(e.to_string()))?;
        for l in config.lanes.iter().filter(|l| l.speculative != SpeculativeMethod::None) {
            tracing::info!(lane = %l.name, method = %String::from(l.speculative.clone()), k = l.num_speculative_tokens, "speculative decoding on");
        }
        Some(d)
    } else {
        None
    };
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
        },
    )
    .await
    .map_err(|e| EngineError::Executor(e.to_string()))?;
    let device = opts.device;
    let make_backend = Box::new(move || make_backend(&bundle, &device, kv).map_err(|e| e.to_string()));
    let (executor, _) =
        Actor::spawn(None, ExecutorActor, ExecutorArgs { make_backend, scheduler: scheduler.clone(), rank: 0 })
            .await
            .map_err(|e| EngineError::Executor(e.to_string()))?;
    scheduler.cast(SchedulerMsg::AttachExecutor(executor.clone())).map_err(|e| EngineError::Executor(e.to_string()))?;
    Ok(Arc::new(Engine { info, config, counters, scheduler, executor, drafter }))
}

impl Engine {
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Scheduler counters (waiting, running, blocks) — for tests and diagnostics.
    pub async fn stats(&self) -> Option<SchedulerStats> {
        ractor::call_t!(self.scheduler, SchedulerMsg::Stats, 5000).ok()
    }

    /// Stop the actors; the executor thread ends after its current step and frees the weights
    /// and KV memory.
    pub fn shutdown(&self) {
        self.counters.ready.store(false, Ordering::SeqCst);
        self.scheduler.stop(None);
        self.executor.stop(None);
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
        let queued = &self.counters.queued[lane_idx];
        if queued.fetch_add(1, Ordering::SeqCst) >= lane.max_queue {
            queued.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::QueueFull { lane: lane.name.clone(), capacity: lane.max_queue });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(EVENT_BUFFER);
        if self.scheduler.cast(SchedulerMsg::Submit { req, lane: lane_idx, events: tx }).is_err() {
            queued.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::ShuttingDown);
        }
        Ok(rx)
    }
}
