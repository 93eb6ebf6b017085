//! The GPU memory budget of one rank, vLLM's `--gpu-memory-utilization` meaning: the engine may
//! use `utilization × total` bytes of the device; the weights and the step workspace come
//! first, then the recurrent-state slots, and the KV pool takes the rest. Plain arithmetic on
//! numbers the caller measured; no device calls.

/// One rank's memory, what must live in it, and what a KV token costs there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuMemoryPlan {
    /// Device total bytes.
    pub total: u64,
    /// Free bytes before this engine loads anything (others' allocations and our context already
    /// taken).
    pub free: u64,
    /// Share of `total` the engine may use, in (0, 1].
    pub utilization: f64,
    /// This rank's weights on the device.
    pub weights: u64,
    /// Activations and scratch of the largest step (`max_num_batched_tokens`), plus library
    /// workspaces (cuBLAS, graphs, NCCL).
    pub workspace: u64,
    /// Recurrent-state slots of every sequence a step may carry (hybrid models; 0 otherwise).
    pub state: u64,
    /// KV bytes one token takes on this rank.
    pub kv_per_token: u64,
    /// Tokens per KV block: the pool is a whole number of blocks.
    pub block_size: usize,
}

impl GpuMemoryPlan {
    /// Bytes the engine may use on this device.
    pub fn budget(&self) -> u64 {
        (self.total as f64 * self.utilization) as u64
    }

    /// Bytes left for the KV pool, or why there are none.
    pub fn kv_room(&self) -> Result<u64, String> {
        let mib = |b: u64| b >> 20;
        let budget = self.budget();
        if self.free < budget {
            let could = self.free as f64 / self.total.max(1) as f64;
            return Err(format!(
                "--gpu-memory-utilization {:.2} asks for {} MiB of the device's {} MiB, but only {} MiB are free \
                 (another process holds the rest): lower it to at most {:.2} or free the device",
                self.utilization,
                mib(budget),
                mib(self.total),
                mib(self.free),
                (could * 100.0).floor() / 100.0
            ));
        }
        let fixed = self.weights + self.workspace + self.state;
        if fixed >= budget {
            return Err(format!(
                "weights ({} MiB) + step workspace ({} MiB) + recurrent state ({} MiB) = {} MiB leave no room for a KV \
                 pool in the {} MiB that --gpu-memory-utilization {:.2} allows: raise it, lower \
                 --max-num-batched-tokens / --max-num-seqs, or add --tensor-parallel-size",
                mib(self.weights),
                mib(self.workspace),
                mib(self.state),
                mib(fixed),
                mib(budget),
                self.utilization
            ));
        }
        Ok(budget - fixed)
    }

    /// The pool that fills the room: whole blocks, at least one.
    pub fn pool_tokens(&self) -> Result<usize, String> {
        let room = self.kv_room()?;
        let block_bytes = self.kv_per_token.max(1) * self.block_size.max(1) as u64;
        let blocks = room / block_bytes;
        if blocks == 0 {
            return Err(format!(
                "{} MiB are left for the KV pool, less than one block of {} tokens ({} bytes)",
                room >> 20,
                self.block_size,
                block_bytes
            ));
        }
        Ok(blocks as usize * self.block_size)
    }

    /// Refuse an explicit pool that does not fit the budget, naming the largest that does.
    pub fn check_pool(&self, pool_tokens: usize) -> Result<(), String> {
        let room = self.kv_room()?;
        let need = pool_tokens as u64 * self.kv_per_token;
        if need > room {
            return Err(format!(
                "--kv-pool-tokens {pool_tokens} needs {} MiB of KV ({} bytes/token) but {} MiB are left on the device \
                 after weights ({} MiB) and workspace ({} MiB) within --gpu-memory-utilization {:.2}: lower it to at \
                 most {}",
                need >> 20,
                self.kv_per_token,
                room >> 20,
                self.weights >> 20,
                self.workspace >> 20,
                self.utilization,
                room / self.kv_per_token.max(1)
            ));
        }
        Ok(())
    }
}

/// The shapes the CUDA llama forward's step scratch is sized from (one rank's share).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub hidden: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes of a stored activation element (bf16 2, f32 4).
    pub elem_bytes: usize,
}

/// cuBLAS/cuBLASLt workspaces, captured decode graphs, NCCL buffers and the sampler: measured
/// on the H200 as a few hundred MiB beyond the step buffers; reserved whole.
pub const LIBRARY_RESERVE: u64 = 512 << 20;
/// Split-K partitions of decode attention the planner may use per decoding row (its partial
/// sums are part of the scratch; prefill rows are not split).
const ATTENTION_SPLITS: usize = 16;

/// The step workspace before it is measured: the scratch buffers the CUDA forward allocates for
/// a step of `tokens` rows of which `logit_rows` need logits (`backend/cuda/forward.rs`, each
/// with its 1/8 regrowth headroom), plus [`LIBRARY_RESERVE`].
pub fn estimated_workspace(s: &StepShape, tokens: usize, logit_rows: usize) -> u64 {
    let (t, m, eb) = (tokens as u64, logit_rows.max(1) as u64, s.elem_bytes as u64);
    let u = |x: usize| x as u64;
    let per_token = u(s.hidden) * 4
        + u(s.hidden.max(s.q_dim)) * eb
        + u(s.q_dim + 2 * s.kv_dim) * 4
        + u(s.q_dim) * 4
        + u(s.q_dim) * eb
        + u(2 * s.intermediate) * 4
        + u(s.intermediate) * eb
        + u(s.kv_heads) * 4;
    let splits = u(ATTENTION_SPLITS) * m * u(s.heads) * (u(s.head_dim) * 4 + 8);
    let rows = m * (u(s.hidden) * eb + u(s.vocab) * 4 + 4);
    let buffers = t * per_token + splits + rows;
    buffers + buffers / 8 + LIBRARY_RESERVE
}

/// Blocks of a pool of `blocks` once the step workspace is known: the reserve was `reserved`
/// bytes (step buffers as estimated plus the library allowance); the probe measured `used` for
/// the step buffers and whatever the libraries allocated on the way. The library allowance stays
/// whole (decode graphs and samplers come later); the difference between estimate and measure
/// goes to, or comes from, the pool.
pub fn pool_blocks_after_probe(blocks: usize, block_bytes: u64, used: u64, reserved: u64) -> usize {
    let keep = used + LIBRARY_RESERVE;
    let block_bytes = block_bytes.max(1);
    if keep > reserved {
        blocks.saturating_sub((keep - reserved).div_ceil(block_bytes) as usize).max(1)
    } else {
        blocks + ((reserved - keep) / block_bytes) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// An 8B bf16 llama on one H200 (the issue-25 setup): 140 GiB total, 139 free.
    fn h200_8b() -> GpuMemoryPlan {
        GpuMemoryPlan {
            total: 140 * GIB,
            free: 139 * GIB,
            utilization: 0.90,
            weights: 15 * GIB,
            workspace: 2 * GIB,
            state: 0,
            kv_per_token: 131_072,
            block_size: 16,
        }
    }

    #[test]
    fn the_pool_takes_what_weights_and_workspace_leave_of_the_budget() {
        let p = h200_8b();
        assert_eq!(p.budget(), 135_291_469_824, "0.9 x 140 GiB");
        let room = p.budget() - 17 * GIB;
        assert_eq!(p.kv_room(), Ok(room));
        let tokens = p.pool_tokens().unwrap();
        assert_eq!(tokens % 16, 0);
        assert_eq!(tokens, (room / (131_072 * 16)) as usize * 16);
        // About 870k tokens: far above the 16,384 the context rule gave, and above the 300k the
        // issue measured as preemption-free at 128 streams.
        assert!(tokens > 800_000, "{tokens}");
        assert!(p.check_pool(tokens).is_ok());
        let e = p.check_pool(tokens + 16).unwrap_err();
        assert!(e.contains(&format!("at most {}", room / 131_072)), "{e}");
    }

    #[test]
    fn another_tenant_or_a_fat_step_is_refused_with_the_numbers() {
        let busy = GpuMemoryPlan { free: 100 * GIB, ..h200_8b() };
        let e = busy.kv_room().unwrap_err();
        assert!(e.contains("only 102400 MiB are free") && e.contains("at most 0.71"), "{e}");
        let fat = GpuMemoryPlan { workspace: 120 * GIB, ..h200_8b() };
        let e = fat.pool_tokens().unwrap_err();
        assert!(e.contains("no room for a KV pool") && e.contains("15360 MiB"), "{e}");
        let tp2 = GpuMemoryPlan { weights: 15 * GIB / 2, kv_per_token: 65_536, ..h200_8b() };
        assert!(tp2.pool_tokens().unwrap() > 2 * h200_8b().pool_tokens().unwrap(), "half the KV per token per rank");
    }

    #[test]
    fn the_workspace_estimate_grows_with_the_step_and_counts_the_logits() {
        let s = StepShape {
            hidden: 4096,
            q_dim: 4096,
            kv_dim: 1024,
            intermediate: 14336,
            vocab: 49_152,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            elem_bytes: 2,
        };
        let small = estimated_workspace(&s, 512, 32);
        let big = estimated_workspace(&s, 8192, 256);
        assert!(small > LIBRARY_RESERVE && big > small);
        // 8192 tokens x ~212 KiB of step buffers + 256 decoding rows' split partials and
        // logits: about 2 GiB, small next to the pool.
        assert!((GIB..4 * GIB).contains(&(big - LIBRARY_RESERVE)), "{}", big >> 20);
    }

    #[test]
    fn the_measured_workspace_moves_the_difference_between_pool_and_reserve() {
        let block = 16 * 131_072u64; // 2 MiB blocks
        let reserved = 2 * GIB;
        // Measured exactly at the estimate: unchanged.
        assert_eq!(pool_blocks_after_probe(1000, block, reserved - LIBRARY_RESERVE, reserved), 1000);
        // The step took 1 GiB less than estimated: the pool gains 512 two-MiB blocks.
        assert_eq!(pool_blocks_after_probe(1000, block, GIB - LIBRARY_RESERVE, reserved), 1512);
        // 3 MiB more than estimated: two blocks go (rounded up), never the last one.
        assert_eq!(pool_blocks_after_probe(1000, block, reserved - LIBRARY_RESERVE + (3 << 20), reserved), 998);
        assert_eq!(pool_blocks_after_probe(4, block, 100 * GIB, reserved), 1);
    }
}
