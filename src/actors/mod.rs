//! The engine's actors (ractor): `SchedulerActor` (all serving decisions), one `RequestActor`
//! per request (detokenization, stop strings, the client's stream), and one `ExecutorActor` per
//! rank (a backend on its own OS thread). `actors.md` at the top of the repository lists every
//! message. This module wires them together and exposes the `InferenceEngine` boundary; it
//! holds no policy (that is `sched`) and no compute (that is `backend`).

pub mod drafter;
mod encoders;
pub mod engine;
pub mod executor;
pub mod handle;
pub mod kvpool;
pub mod previous_samples;
pub mod rank_pages;
pub mod rank_state;
pub mod ranks;
pub mod request;
pub mod scheduler;
pub mod spill;
mod workspace_probe;
mod yielding;

pub use engine::{start_engine, DrainReport, Engine, EngineOptions};
pub use handle::{
    EngineError, FinishReason, GenerationRequest, InferenceEngine, ModelInfo, PromptImage, StreamEvent, TokenInfo,
    Usage, VideoInfo, VisionInfo,
};
