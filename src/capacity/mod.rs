//! The startup capacity card and the KV pool's size: what one token and one sequence cost in the
//! cache as each backend really lays it out (llama K+V per layer in the device's KV dtype;
//! glm5_next MLA latents + indexer records per token and KDA state per sequence), the weights
//! as they sit in memory, and the memory they are sized against (host RAM on the CPU; on CUDA
//! each rank's device memory under `--gpu-memory-utilization`). A configuration that cannot fit
//! is refused here, with the numbers, before any weight is loaded.
//!
//! Owns pricing and sizing only: it reads the model's description and the resolved device, never
//! allocates, and knows no actor messages. The backends own the allocation this mirrors; tests
//! compare the two.

pub mod gpu;

use crate::backend::cpu::{default_kv_precision, KvPrecision};
use crate::backend::cuda::Precision;
use crate::config::engine::SchedulerConfig;
use crate::config::layers::ModelFamily;
use crate::generate::{ResolvedDevice, ResolvedKind};
use crate::model::ModelBundle;
use crate::parallel::{LlamaShard, TpRank};

pub use gpu::{estimated_workspace, pool_blocks_after_probe, GpuMemoryPlan, StepShape, LIBRARY_RESERVE};

/// Storage type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    Bf16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        }
    }
}

/// What the cache costs per token and per sequence on the resolved device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCost {
    pub dtype: KvDtype,
    /// Bytes one token position takes, summed over tensor-parallel ranks.
    pub bytes_per_token: u64,
    /// Bytes one token takes on the rank that holds the most (what a rank's memory must hold).
    pub rank_bytes_per_token: u64,
    /// Bytes of one sequence's recurrent-state slot (hybrid models; 0 otherwise). A cached page
    /// of a hybrid model keeps one snapshot of this size.
    pub state_slot_bytes: u64,
    /// The layout in words, for the card.
    pub layout: String,
}

/// How the cache of `bundle` is laid out on `device`.
pub fn kv_cost(bundle: &ModelBundle, device: &ResolvedDevice) -> Result<KvCost, String> {
    let c = &bundle.config;
    if ModelFamily::of_model_type(&c.model_type) == ModelFamily::Glm5Next {
        let g = crate::model::glm5_next::read_config(bundle.weights.origin()).map_err(|e| e.to_string())?;
        let (token, slot) = crate::model::glm5_next::cache_layout::CacheLayout::new(&g).bytes();
        // Under tensor parallelism every rank caches the whole per-token records (the MLA latent
        // is shared by all heads) and its own heads' share of the KDA state: the records cost
        // `world` times, the state slots add up to one model's.
        let world = device.tensor_parallel.max(1) as u64;
        let replicated =
            if world > 1 { format!(", records replicated on each of {world} ranks") } else { String::new() };
        return Ok(KvCost {
            dtype: KvDtype::F32,
            bytes_per_token: token as u64 * world,
            rank_bytes_per_token: token as u64,
            state_slot_bytes: slot as u64,
            layout: format!(
                "MLA latent + indexer key, gate and pooled key per DSA layer per token; KDA conv window + state \
                 per sequence{replicated}"
            ),
        });
    }
    let dtype = match device.kind {
        ResolvedKind::Cpu => match default_kv_precision(c, bundle.weights.as_ref()) {
            KvPrecision::F16 => KvDtype::F16,
            KvPrecision::F32 => KvDtype::F32,
        },
        ResolvedKind::Cuda => match device.cuda_precision {
            Precision::Bf16 => KvDtype::Bf16,
            Precision::F32 => KvDtype::F32,
        },
    };
    let world = device.tensor_parallel.max(1);
    let mut kv_heads = Vec::with_capacity(world);
    for rank in 0..world {
        let tp = TpRank::new(rank, world).map_err(|e| e.to_string())?;
        let plan = LlamaShard::new(tp, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
            .map_err(|e| e.to_string())?;
        kv_heads.push(plan.kv_heads.len() as u64);
    }
    let per_head = 2 * c.num_hidden_layers as u64 * c.head_dim as u64 * dtype.bytes();
    Ok(KvCost {
        dtype,
        bytes_per_token: kv_heads.iter().sum::<u64>() * per_head,
        rank_bytes_per_token: kv_heads.iter().copied().max().unwrap_or(0) * per_head,
        state_slot_bytes: 0,
        layout: format!(
            "K+V x {} layers x {} kv heads x {} dims in {}",
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            dtype.as_str()
        ),
    })
}

/// Bytes the weights take once loaded on `device`, all ranks together: the CPU keeps GGML
/// quantized blocks and a quantized safetensors checkpoint's codes as stored and widens everything
/// else to f32 (glm5_next: all f32); CUDA stores every tensor in its precision (and refuses
/// quantized safetensors checkpoints).
pub fn resident_weight_bytes(bundle: &ModelBundle, device: &ResolvedDevice) -> u64 {
    let glm = ModelFamily::of_model_type(&bundle.config.model_type) == ModelFamily::Glm5Next;
    let w = bundle.weights.as_ref();
    let names = w.tensor_names();
    // Codes of a quantized safetensors checkpoint (packed ints, FP8) stay as stored on the CPU.
    let packed: u64 = names
        .iter()
        .filter(|n| w.tensor(n).is_none())
        .filter_map(|n| w.raw_tensor(n))
        .map(|t| t.data.len() as u64)
        .sum();
    packed
        + names
            .iter()
            .filter_map(|n| w.tensor(n))
            .map(|t| {
                let elems: u64 = t.shape.iter().map(|&d| d as u64).product();
                match device.kind {
                    ResolvedKind::Cpu if !glm && crate::backend::cpu::linear::stays_quantized(t.dtype) => {
                        t.data.len() as u64
                    }
                    ResolvedKind::Cpu => elems * 4,
                    ResolvedKind::Cuda => elems * device.cuda_precision.bytes() as u64,
                }
            })
            .sum::<u64>()
}

/// The memory the pool is sized against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Memory {
    /// Host RAM: `MemAvailable` (None where it cannot be read: no check).
    Host { available: Option<u64> },
    /// The smallest of the ranks' devices: total and free bytes before loading.
    Device { total: u64, free: u64 },
}

/// `MemAvailable` from /proc/meminfo, in bytes (None where it cannot be read).
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Probe the memory of the resolved device: host RAM for the CPU; for CUDA the least total and
/// least free memory over the ranks' devices.
pub fn probe(device: &ResolvedDevice) -> Result<Memory, String> {
    match device.kind {
        ResolvedKind::Cpu => Ok(Memory::Host { available: host_available() }),
        ResolvedKind::Cuda => {
            let (mut total, mut free) = (u64::MAX, u64::MAX);
            for rank in 0..device.tensor_parallel.max(1) {
                let ordinal = device.cuda_ordinal + rank;
                let (f, t) = crate::backend::cuda::device_memory(ordinal).map_err(|e| e.to_string())?;
                total = total.min(t as u64);
                free = free.min(f as u64);
            }
            Ok(Memory::Device { total, free })
        }
    }
}

/// Where the pool's size came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSizedBy {
    /// `kv_pool_tokens` was set.
    Configured,
    /// CPU default: two full contexts (4096..16384 tokens each).
    ContextRule,
    /// CUDA default: what `gpu_memory_utilization` leaves.
    DeviceMemory,
    /// CUDA default, capped: the device could hold more than the scheduler can ever use
    /// (`max_num_seqs` full contexts), so the pool stops there.
    SchedulerLimit,
}

/// What the startup capacity card reports. Computed before the weights are loaded.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityCard {
    /// Weights as loaded on the device (all ranks).
    pub weight_bytes: u64,
    pub kv: KvCost,
    /// Tokens the pool holds (whole blocks).
    pub pool_tokens: usize,
    pub pool_sized_by: PoolSizedBy,
    /// Recurrent-state slots (one per sequence a step may carry; hybrid models).
    pub state_slots: usize,
    /// The longest prompt + reply one sequence can have: the model's context or the pool,
    /// whichever is smaller.
    pub max_context: usize,
    pub page_tokens: usize,
    pub spill_budget: u64,
    /// Host memory the spill tier may fill with recently evicted pages (only with spill on).
    pub spill_host_bytes: u64,
    pub memory: Memory,
    /// On CUDA: the per-rank budget the pool was sized in (utilization, weights, workspace).
    pub gpu: Option<GpuMemoryPlan>,
}

impl CapacityCard {
    pub fn kv_pool_bytes(&self) -> u64 {
        self.kv.bytes_per_token * self.pool_tokens as u64
    }

    /// Every recurrent-state slot the backend allocates.
    pub fn state_bytes(&self) -> u64 {
        self.kv.state_slot_bytes * self.state_slots as u64
    }

    /// Host bytes of one page's recurrent-state snapshot (0 without pages or recurrent state).
    /// Every cached page of a hybrid model keeps one, so a pool full of cached pages holds
    /// `pool_tokens / page_tokens` of them (for GLM-5.3-Flash 146 MiB each against 39 MiB of KV
    /// per 3584-token page: the snapshots, not the KV, decide what fits).
    pub fn snapshot_bytes_per_page(&self) -> u64 {
        if self.page_tokens > 0 {
            self.kv.state_slot_bytes
        } else {
            0
        }
    }

    /// Host bytes of recurrent-state snapshots when every page of the pool is a cached page.
    pub fn max_snapshot_bytes(&self) -> u64 {
        match self.page_tokens {
            0 => 0,
            p => (self.pool_tokens / p) as u64 * self.snapshot_bytes_per_page(),
        }
    }

    /// Refuses a configuration whose weights, KV pool, state slots and page snapshots cannot fit
    /// in `available` host bytes, naming the number to change.
    pub fn check_host_fits(&self, available: Option<u64>) -> Result<(), String> {
        let Some(avail) = available else { return Ok(()) };
        let need = self.weight_bytes + self.kv_pool_bytes() + self.state_bytes();
        let with_snapshots = need + self.max_snapshot_bytes();
        if need <= avail && with_snapshots > avail {
            let pages = avail.saturating_sub(need) / self.snapshot_bytes_per_page().max(1);
            return Err(format!(
                "weights and KV pool fit, but the recurrent-state snapshots of a pool full of cached pages ({} pages x \
                 {} MiB = {} MiB) do not: {} MiB available. Lower --kv-pool-tokens (kv_pool_tokens) or raise \
                 --page-tokens (page_tokens) so that at most {pages} pages fit",
                self.pool_tokens / self.page_tokens.max(1),
                self.snapshot_bytes_per_page() >> 20,
                self.max_snapshot_bytes() >> 20,
                avail >> 20
            ));
        }
        if need > avail {
            let kv_room = avail.saturating_sub(self.weight_bytes + self.state_bytes()) / self.kv.bytes_per_token.max(1);
            return Err(format!(
                "weights ({} MiB) + KV pool ({} tokens x {} bytes {} = {} MiB) + recurrent state ({} MiB) need {} MiB \
                 but only {} MiB of host memory is available: lower --kv-pool-tokens (kv_pool_tokens) to at most \
                 {kv_room}",
                self.weight_bytes >> 20,
                self.pool_tokens,
                self.kv.bytes_per_token,
                self.kv.dtype.as_str(),
                self.kv_pool_bytes() >> 20,
                self.state_bytes() >> 20,
                need >> 20,
                avail >> 20
            ));
        }
        Ok(())
    }

    pub fn log(&self) {
        let sized_against = match (self.memory, &self.gpu) {
            (Memory::Host { available: Some(a) }, _) => format!("host RAM, {} MiB available", a >> 20),
            (Memory::Host { available: None }, _) => "host RAM (unknown size: not checked)".into(),
            (Memory::Device { total, free }, Some(g)) => format!(
                "GPU memory per rank: {} MiB total, {} MiB free, budget {} MiB ({:.2}) = weights {} MiB + workspace {} \
                 MiB + state {} MiB + KV",
                total >> 20,
                free >> 20,
                g.budget() >> 20,
                g.utilization,
                g.weights >> 20,
                g.workspace >> 20,
                g.state >> 20
            ),
            (Memory::Device { total, free }, None) => {
                format!("GPU memory: {} MiB total, {} MiB free", total >> 20, free >> 20)
            }
        };
        tracing::info!(
            weights_mib = self.weight_bytes >> 20,
            kv_dtype = self.kv.dtype.as_str(),
            kv_bytes_per_token = self.kv.bytes_per_token,
            kv_layout = %self.kv.layout,
            pool_tokens = self.pool_tokens,
            pool_sized_by = ?self.pool_sized_by,
            kv_pool_mib = self.kv_pool_bytes() >> 20,
            state_mib = self.state_bytes() >> 20,
            max_context = self.max_context,
            page_tokens = self.page_tokens,
            spill_budget_mib = self.spill_budget >> 20,
            spill_host_mib = self.spill_host_bytes >> 20,
            snapshot_mib_per_page = self.snapshot_bytes_per_page() >> 20,
            max_snapshot_mib = self.max_snapshot_bytes() >> 20,
            sized_against = %sized_against,
            "capacity"
        );
    }
}

/// The most KV the scheduler can ever hold at once: `max_num_seqs` sequences of the whole context.
/// A pool sized from device memory stops here; what is left of the budget stays free.
pub fn scheduler_pool_limit(max_num_seqs: usize, context: usize) -> usize {
    max_num_seqs.max(1).saturating_mul(context.max(1))
}

/// The CPU's pool when none is configured: two sequences of the model's context, each clamped
/// to 4096..16384 tokens.
pub fn context_rule_pool(context: usize) -> usize {
    context.clamp(4096, 16384) * 2
}

/// One rank's step shapes for the CUDA workspace estimate.
fn step_shape(bundle: &ModelBundle, device: &ResolvedDevice) -> Result<StepShape, String> {
    let c = &bundle.config;
    let world = device.tensor_parallel.max(1);
    let tp = TpRank::new(0, world).map_err(|e| e.to_string())?;
    let plan = LlamaShard::new(tp, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
        .map_err(|e| e.to_string())?;
    Ok(StepShape {
        hidden: c.hidden_size,
        q_dim: plan.q_heads.len() * c.head_dim,
        kv_dim: plan.kv_heads.len() * c.head_dim,
        intermediate: plan.intermediate.len(),
        vocab: plan.vocab.len(),
        heads: plan.q_heads.len(),
        kv_heads: plan.kv_heads.len(),
        head_dim: c.head_dim,
        elem_bytes: device.cuda_precision.bytes(),
    })
}

/// Size the KV pool for `bundle` on `device` under scheduler settings `s` and `memory`, and
/// refuse what cannot fit. `page_tokens` is the resolved page size (0 = prefix cache off).
pub fn plan(
    bundle: &ModelBundle,
    device: &ResolvedDevice,
    s: &SchedulerConfig,
    page_tokens: usize,
    memory: Memory,
) -> Result<CapacityCard, String> {
    let kv = kv_cost(bundle, device)?;
    let weight_bytes = resident_weight_bytes(bundle, device);
    let block = s.block_size.max(1);
    let whole_blocks = |tokens: usize| tokens.div_ceil(block) * block;
    let mut gpu = None;
    let (pool_tokens, pool_sized_by) = match memory {
        Memory::Host { .. } if s.kv_pool_tokens > 0 => (whole_blocks(s.kv_pool_tokens), PoolSizedBy::Configured),
        Memory::Host { .. } => {
            (whole_blocks(context_rule_pool(bundle.config.max_position_embeddings)), PoolSizedBy::ContextRule)
        }
        Memory::Device { total, free } => {
            let world = device.tensor_parallel.max(1) as u64;
            let shape = step_shape(bundle, device)?;
            let p = GpuMemoryPlan {
                total,
                free,
                utilization: s.gpu_memory_utilization,
                weights: weight_bytes.div_ceil(world),
                workspace: estimated_workspace(&shape, s.max_num_batched_tokens, s.max_num_seqs),
                state: kv.state_slot_bytes * s.max_num_seqs as u64,
                kv_per_token: kv.rank_bytes_per_token,
                block_size: block,
            };
            gpu = Some(p);
            if s.kv_pool_tokens > 0 {
                let tokens = whole_blocks(s.kv_pool_tokens);
                p.check_pool(tokens)?;
                (tokens, PoolSizedBy::Configured)
            } else {
                let fits = p.pool_tokens()?;
                let usable = whole_blocks(scheduler_pool_limit(s.max_num_seqs, bundle.config.max_position_embeddings));
                if fits > usable {
                    (usable, PoolSizedBy::SchedulerLimit)
                } else {
                    (fits, PoolSizedBy::DeviceMemory)
                }
            }
        }
    };
    let card = CapacityCard {
        weight_bytes,
        kv,
        pool_tokens,
        pool_sized_by,
        state_slots: s.max_num_seqs,
        max_context: bundle.config.max_position_embeddings.min(pool_tokens),
        page_tokens,
        spill_budget: s.spill_budget,
        spill_host_bytes: if s.spill_budget > 0 && s.spill_dir.is_some() {
            crate::spill::host::budget(s.spill_host_bytes, crate::capacity::host_available())
        } else {
            0
        },
        memory,
        gpu,
    };
    if let Memory::Host { available } = memory {
        card.check_host_fits(available)?;
    }
    Ok(card)
}

#[cfg(test)]
mod tests;
