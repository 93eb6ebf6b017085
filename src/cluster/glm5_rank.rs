//! A `glm5_next` rank in a group across processes: one [`Glm5Backend::new_rank`] per process,
//! joined to the others by the cluster collective (`ClusterComm`, the same `Collective` as the
//! in-process `LocalComm`, summed in the same rank order), driven by its own `ExecutorActor`.
//!
//! Rank 0 samples and commits its verifications; the scheduler relays them to the other ranks
//! (`ExecutorMsg::CommitVerified`), and the KV pool splits and joins the state images by rank
//! (`actors::rank_state`). Every rank loads the whole checkpoint and keeps its shard, as
//! `Glm5TpBackend` does for each rank in one process.

use std::sync::Arc;
use std::time::Duration;

use super::ClusterComm;
use crate::backend::cpu::glm5_next::shard::{shard_weights, RankGroup};
use crate::backend::cpu::glm5_next::{weights, Glm5Backend, Glm5TpBackend};
use crate::backend::{Backend, BackendError, KvGeometry};
use crate::generate::BackendMaker;
use crate::model::glm5_next::shard::Glm5Shard;
use crate::model::ModelBundle;
use crate::parallel::{Collective, TpRank};

/// Whether the bundle is a `glm5_next` checkpoint (its ranks are built here, not as llama's).
pub fn is_glm5(bundle: &ModelBundle) -> bool {
    crate::model::glm5_next::MODEL_TYPES.contains(&bundle.config.model_type.as_str())
}

/// Checks, before anything loads, that `world` ranks (whole experts per rank with
/// `expert_parallel`) divide every split of the model: the error names the count that does not.
pub fn check_split(bundle: &ModelBundle, world: usize, expert_parallel: bool) -> Result<(), String> {
    let cfg = crate::model::glm5_next::read_config(bundle.weights.origin()).map_err(|e| e.to_string())?;
    Glm5TpBackend::check(&cfg, world, expert_parallel)
}

/// Rank `comm.rank()`'s backend of a `glm5_next` group across processes: waits up to `join_wait`
/// for every other rank's collective actor, loads the checkpoint and keeps this rank's shard.
pub fn glm5_rank_maker(
    bundle: Arc<ModelBundle>,
    kv: KvGeometry,
    threads: usize,
    comm: ClusterComm,
    join_wait: Duration,
    expert_parallel: bool,
) -> BackendMaker {
    Box::new(move || {
        let unavailable = |reason: String| BackendError::Unavailable { device: "cluster".into(), reason };
        if kv.block_size == 0 || kv.num_blocks == 0 || kv.state_slots == 0 {
            return Err(unavailable("glm5_next needs at least one KV block and one recurrent-state slot".into()));
        }
        let world = comm.world_size();
        let rank = TpRank::new(comm.rank(), world).map_err(|e| unavailable(e.to_string()))?;
        let cfg = crate::model::glm5_next::read_config(bundle.weights.origin())?;
        let plan = Glm5Shard::new(&cfg, rank, expert_parallel).map_err(|e| unavailable(e.to_string()))?;
        comm.connect(join_wait).map_err(|e| unavailable(e.to_string()))?;
        let shard = shard_weights(&cfg, &weights::load(&cfg, bundle.weights.as_ref())?, &plan);
        let group = RankGroup { comm: Arc::new(comm), experts: plan.experts.clone(), vocab: plan.vocab.clone() };
        let b = Glm5Backend::new_rank(plan.local_config(&cfg), shard, group, threads, kv).map_err(unavailable)?;
        tracing::info!(
            rank = rank.rank,
            world,
            expert_parallel,
            weights_mib = b.weight_bytes() >> 20,
            state_slot_bytes = b.state_slot_bytes(),
            threads = b.threads(),
            "glm5_next rank loaded on cpu, its group across processes"
        );
        Ok(Box::new(b) as Box<dyn Backend>)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_the_fixture_cannot_take_is_refused_before_loading() {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/glm5/chat");
        let cache = crate::model::default_model::CacheDir::from_env();
        let bundle = crate::model::open(fixture, &cache).unwrap();
        assert!(is_glm5(&bundle));
        check_split(&bundle, 2, false).unwrap();
        check_split(&bundle, 2, true).unwrap();
        // 2 attention and KDA heads, 8 experts: 4 ranks do not divide the heads.
        let e = check_split(&bundle, 4, false).unwrap_err();
        assert!(e.contains("(2)"), "{e}");
    }
}
