//! Scheduling policy as plain data: which sequences run in the next step, how many tokens each
//! gets, and who is preempted when KV blocks run out. No actors, no async, no tensors: the
//! SchedulerActor holds a `Policy`, feeds it requests and executor results, and forwards the
//! `StepPlanOut` it returns.

pub mod policy;

pub use policy::{NewSeq, PlannedSeq, Policy, PolicyConfig, PolicyError, SeqId, SeqView, StepPlanOut};
