//! KV cache bookkeeping, as plain data: which fixed-size blocks of the KV memory are free and which
//! sequence holds which. Nothing here touches tensors (executors own the memory itself) or makes
//! scheduling decisions (`crate::sched` asks this module for blocks). Prefix caching and spill
//! build on `BlockPool` later as separate types.

pub mod blocks;

pub use blocks::{BlockPool, BlockTable};

/// Misuse of the block pool. These indicate a bookkeeping bug in the caller, never bad user input,
/// so callers that cannot recover log them and fail loudly in debug builds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("invalid KV block pool: {0}")]
    InvalidPool(String),
    #[error("KV block {block} is out of range: the pool has {num_blocks} blocks")]
    OutOfRange { block: u32, num_blocks: usize },
    #[error("KV block {block} was freed while it was already free (double free)")]
    DoubleFree { block: u32 },
}

impl KvError {
    /// Stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            KvError::InvalidPool(_) => "invalid_pool",
            KvError::OutOfRange { .. } => "block_out_of_range",
            KvError::DoubleFree { .. } => "block_double_free",
        }
    }
}
