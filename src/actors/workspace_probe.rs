//! The profiling step a lone CUDA rank runs once its weights are loaded, before it reports ready:
//! it measures the step workspace the KV pool was sized around and resizes the pool to fit.

use crate::backend::{Backend, SeqStep};

/// The largest step the scheduler may send, and the workspace the capacity card reserved for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceProbe {
    /// Tokens of the step (`max_num_batched_tokens`).
    pub tokens: usize,
    /// Bytes reserved for its activations and library workspaces.
    pub reserved: u64,
}

/// Run one prefill of `probe.tokens` tokens (clamped to the pool) in fresh blocks and measure how
/// much device memory the step's buffers took (the scratch stays allocated, so this is the step's
/// peak); then give the KV pool what the measurement leaves of the reserve, or take from it what
/// the step needs beyond it. Positions written here are overwritten by real work.
pub(super) fn measure_workspace(backend: &mut dyn Backend, probe: WorkspaceProbe, rank: usize) {
    let Some(before) = backend.device_free_memory() else { return };
    let geom = backend.kv_geometry();
    let tokens = probe.tokens.min(geom.capacity_tokens()).max(1);
    let ids = vec![0u32; tokens];
    let table: Vec<u32> = (0..geom.blocks_for(tokens) as u32).collect();
    let step = SeqStep { tokens: &ids, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 };
    if let Err(e) = backend.forward(&[step]) {
        tracing::warn!(rank, error = %e, tokens, "the profiling step failed; the step workspace is not measured");
        return;
    }
    let used = before.saturating_sub(backend.device_free_memory().unwrap_or(before));
    let blocks = crate::capacity::pool_blocks_after_probe(
        geom.num_blocks,
        backend.kv_block_bytes() as u64,
        used,
        probe.reserved,
    );
    tracing::info!(rank, tokens, measured_mib = used >> 20, reserved_mib = probe.reserved >> 20, "step workspace");
    if blocks == geom.num_blocks {
        return;
    }
    match backend.resize_kv(blocks) {
        Ok(true) => tracing::info!(
            rank,
            from_tokens = geom.capacity_tokens(),
            to_tokens = blocks * geom.block_size,
            "KV pool resized to the measured step workspace"
        ),
        Ok(false) if blocks < geom.num_blocks => tracing::warn!(
            rank,
            measured_mib = used >> 20,
            reserved_mib = probe.reserved >> 20,
            "the step workspace measured above what the KV pool was sized around: if the device runs out of \
             memory, lower --gpu-memory-utilization or --max-num-batched-tokens"
        ),
        Ok(false) => {}
        Err(e) => tracing::warn!(rank, error = %e, "resizing the KV pool failed; the rank keeps none"),
    }
}
