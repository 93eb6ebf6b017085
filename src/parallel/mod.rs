//! Tensor parallelism: the sharding plan (which slice of each weight a rank holds) and the
//! collectives that join the slices (all-reduce, all-gather), behind a trait with an in-process
//! implementation for CPU ranks and an NCCL one for CUDA ranks.
//!
//! Owns: rank/world arithmetic, tensor slicing rules, the CPU communicator. Must not touch:
//! scheduling (every rank runs the same step plan in lockstep; the scheduler drives them all),
//! model math (backends apply the plan to their own weights).

pub mod collective;
pub mod plan;

pub use collective::{Collective, CollectiveError, DeviceCollective, LocalComm};
pub use plan::{LlamaShard, PlanError, Split, TpRank};
