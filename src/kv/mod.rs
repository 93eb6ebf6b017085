//! KV cache bookkeeping, as plain data: which fixed-size blocks of the KV memory are free, which
//! sequence holds which, and which computed pages are cached for prefix reuse (`KvPool`, owned by
//! the `KvPoolActor`). Nothing here touches tensors (executors own the memory itself), does disk
//! I/O (that is `crate::spill`) or makes scheduling decisions (`crate::sched` decides who runs).

pub mod blocks;
pub mod ledger;
pub mod ops;
pub mod page;
pub mod pool;
pub mod restore_cost;

pub use blocks::{BlockPool, BlockTable};
pub use ops::{apply_ops, view, PoolOp, PoolReply, PoolView, Restore, SeqGrant};
pub use page::{ImageKey, MissReason, PageHash, PageHasher, PoolIdentity, PrefixHit};
pub use pool::snapshot::{SlotSnapshot, StateWrite};
pub use pool::{Allocation, EvictedPage, KvPool, KvPoolConfig, PoolCounters};

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
    #[error("{wanted} KV blocks wanted but only {available} are free or evictable")]
    OutOfBlocks { wanted: usize, available: usize },
    #[error("sequence {0} is already registered with the KV pool")]
    DuplicateSeq(u64),
    #[error("sequence {0} is not registered with the KV pool")]
    UnknownSeq(u64),
    #[error("sequence {0} already holds blocks; its prefix can only be looked up on admission")]
    AlreadyAdmitted(u64),
    #[error(
        "sequence {seq}: {computed} computed tokens exceed its blocks ({capacity} slots) or its known tokens ({known})"
    )]
    BeyondBlocks { seq: u64, computed: usize, capacity: usize, known: usize },
}

impl KvError {
    /// Stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            KvError::InvalidPool(_) => "invalid_pool",
            KvError::OutOfRange { .. } => "block_out_of_range",
            KvError::DoubleFree { .. } => "block_double_free",
            KvError::OutOfBlocks { .. } => "out_of_blocks",
            KvError::DuplicateSeq(_) => "duplicate_seq",
            KvError::UnknownSeq(_) => "unknown_seq",
            KvError::AlreadyAdmitted(_) => "already_admitted",
            KvError::BeyondBlocks { .. } => "beyond_blocks",
        }
    }
}
