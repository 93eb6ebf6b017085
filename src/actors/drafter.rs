//! `DrafterActor`: owns the draft sources (one per lane that drafts) and their per-sequence state.
//! The scheduler sends it, once per planned step, the tokens each decoding sequence accepted since
//! last time together with how many drafts it may take, and gets the proposals back in the same
//! reply — one round trip per step, however many sequences draft. It never sees the target's KV
//! blocks or logits; whether a draft is used (budget, blocks, preemption) is the scheduler's call.
//!
//! An `mtp` lane's source is the glm5_next target's own MTP layer on the CPU (`spec::mtp`), which
//! reads the target's last-layer hidden states like `dflash:PATH` does. A `draft:PATH` lane's source is a draft model on the CPU backend with its own KV store
//! (`spec::draft_model`); each lane's requests go to its source in one `propose_batch` call, so the
//! draft model runs one batched forward per draft position. Every source runs under the adaptive
//! draft length (`spec::adaptive`), so a request's `k` is the most a sequence may get. That
//! compute runs on the blocking pool, never on the actor's async thread.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::model::ModelBundle;
use crate::sched::SeqId;
use crate::spec::adaptive::{draft_cost_from_weights, Adaptive, AdaptiveConfig};
use crate::spec::dflash::DFlashDrafter;
use crate::spec::draft_model::{DraftModel, DraftModelOptions, VocabIdentity};
use crate::spec::mtp::MtpDrafter;
use crate::spec::ngram::{NgramConfig, NgramDrafter};
use crate::spec::{DraftError, DraftRequest, DraftSource, HiddenChunk, SpeculativeMethod};

/// New context for one sequence and a request for up to `k` drafts.
#[derive(Clone, Debug)]
pub struct DraftUpdate {
    pub seq: SeqId,
    pub lane: usize,
    /// Tokens appended to the sequence since the last update (the prompt on the first one).
    pub append: Vec<u32>,
    /// The target's hidden states for tokens it ran since the last update (lanes whose drafter
    /// reads them; empty otherwise).
    pub hidden: Vec<HiddenChunk>,
    pub k: usize,
}

#[derive(ractor_cluster::RactorMessage)]
pub enum DrafterMsg {
    /// Extend and propose; the reply holds `(seq, draft)` for sequences with a non-empty draft.
    Propose { updates: Vec<DraftUpdate>, reply: RpcReplyPort<Vec<(SeqId, Vec<u32>)>> },
    /// The sequence ended (finished, cancelled, failed) or was preempted: drop its state.
    Forget { seq: SeqId, lane: usize },
    /// Sequences each lane's source holds state for (diagnostics and tests).
    Held { reply: RpcReplyPort<Vec<usize>> },
}

pub struct DrafterActor;

pub struct DrafterState {
    /// Indexed by lane; `None` for lanes that do not draft.
    sources: Vec<Option<Box<dyn DraftSource>>>,
}

pub type LaneSources = Vec<Option<Box<dyn DraftSource>>>;

/// How a lane prices drafting for the adaptive draft length (`spec::adaptive`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LanePricing {
    /// Verification cost per draft token ([`AdaptiveConfig::row_cost`]).
    pub row_cost: f64,
    /// A draft model's cost per proposed token ([`AdaptiveConfig::draft_cost`]); `None`:
    /// estimated from the draft's and the target's weight bytes.
    pub draft_cost: Option<f64>,
}

/// Build the source for each lane's method, each under the adaptive draft length
/// (`spec::adaptive`): long drafts where they are being accepted, none where they fail or do not
/// pay. A draft model is opened with the target's loaders and refused unless it shares the
/// target's vocabulary (`target_vocab`); each drafting lane gets its own instance and KV store,
/// and unless the lane sets its cost, its proposals are priced by its weight bytes over
/// `target_weight_bytes`. Loading is blocking work.
pub fn sources_for(
    methods: &[SpeculativeMethod],
    pricing: &[LanePricing],
    target: &ModelBundle,
    target_vocab: &VocabIdentity,
    target_weight_bytes: u64,
    draft_opts: DraftModelOptions,
) -> Result<LaneSources, DraftError> {
    if pricing.len() != methods.len() {
        return Err(DraftError::InvalidConfig(format!("{} lane prices for {} lanes", pricing.len(), methods.len())));
    }
    methods
        .iter()
        .zip(pricing)
        .map(|(m, price)| match m {
            SpeculativeMethod::None => Ok(None),
            SpeculativeMethod::Ngram => {
                let ngram = NgramDrafter::new(NgramConfig::default())?;
                let cfg = AdaptiveConfig::with_row_cost(price.row_cost);
                Ok(Some(Box::new(Adaptive::new(ngram, cfg)) as Box<dyn DraftSource>))
            }
            SpeculativeMethod::DraftModel(path) => {
                let model = DraftModel::open(path, target_vocab, draft_opts)?;
                let estimate = draft_cost_from_weights(model.weight_bytes(), target_weight_bytes);
                let draft_cost = price.draft_cost.unwrap_or(estimate);
                tracing::info!(
                    path = %path,
                    draft_cost = format!("{draft_cost:.3}"),
                    weight_ratio = format!("{estimate:.3}"),
                    row_cost = price.row_cost,
                    "draft model loaded on the CPU backend (draft length adapts to acceptance and cost)"
                );
                let cfg = AdaptiveConfig::with_costs(price.row_cost, draft_cost);
                Ok(Some(Box::new(Adaptive::new(model, cfg)) as Box<dyn DraftSource>))
            }
            SpeculativeMethod::Mtp => {
                // The target's own MTP layer, with a store as large as the target's pool.
                let drafter = MtpDrafter::open(target, draft_opts.threads, draft_opts.pool_tokens)?;
                let estimate = draft_cost_from_weights(drafter.weight_bytes(), target_weight_bytes);
                let cfg = AdaptiveConfig::with_costs(price.row_cost, price.draft_cost.unwrap_or(estimate));
                Ok(Some(Box::new(Adaptive::new(drafter, cfg)) as Box<dyn DraftSource>))
            }
            SpeculativeMethod::DFlash(path) => {
                let drafter = DFlashDrafter::open_on(path, target, draft_opts.threads, draft_opts.dflash_cuda)?;
                // One pass proposes the whole block: its cost per proposed token is the drafter's
                // weight bytes over the target's, spread over the block.
                let per_pass = draft_cost_from_weights(drafter.weight_bytes(), target_weight_bytes);
                let estimate = per_pass / (drafter.config().block_size - 1) as f64;
                let cfg = AdaptiveConfig::with_costs(price.row_cost, price.draft_cost.unwrap_or(estimate));
                Ok(Some(Box::new(Adaptive::new(drafter, cfg)) as Box<dyn DraftSource>))
            }
        })
        .collect()
}

/// Extend every update's sequence and ask each lane's source for its drafts in one batch.
fn propose_all(sources: &mut LaneSources, updates: Vec<DraftUpdate>) -> Vec<(SeqId, Vec<u32>)> {
    let mut by_lane: Vec<Vec<DraftRequest>> = vec![Vec::new(); sources.len()];
    for u in updates {
        let Some(Some(src)) = sources.get_mut(u.lane) else { continue };
        src.extend(u.seq, &u.append);
        if !u.hidden.is_empty() {
            src.extend_hidden(u.seq, u.hidden);
        }
        by_lane[u.lane].push(DraftRequest { seq: u.seq, k: u.k });
    }
    let mut out = Vec::new();
    for (src, requests) in sources.iter_mut().zip(by_lane) {
        let Some(src) = src else { continue };
        if requests.is_empty() {
            continue;
        }
        let drafts = src.propose_batch(&requests);
        out.extend(requests.iter().zip(drafts).filter(|(_, d)| !d.is_empty()).map(|(r, d)| (r.seq, d)));
    }
    out
}

impl Actor for DrafterActor {
    type Msg = DrafterMsg;
    type State = DrafterState;
    type Arguments = LaneSources;

    async fn pre_start(
        &self,
        _myself: ActorRef<DrafterMsg>,
        sources: LaneSources,
    ) -> Result<DrafterState, ActorProcessingErr> {
        Ok(DrafterState { sources })
    }

    async fn handle(
        &self,
        _myself: ActorRef<DrafterMsg>,
        msg: DrafterMsg,
        st: &mut DrafterState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DrafterMsg::Propose { updates, reply } => {
                // A draft model's forwards are blocking compute: run them on the blocking pool.
                // Messages are handled one at a time, so the sources are back before the next one.
                let mut sources = std::mem::take(&mut st.sources);
                let (sources, out) = tokio::task::spawn_blocking(move || {
                    let out = propose_all(&mut sources, updates);
                    (sources, out)
                })
                .await?;
                st.sources = sources;
                let _ = reply.send(out);
            }
            DrafterMsg::Held { reply } => {
                let _ = reply.send(st.sources.iter().map(|s| s.as_ref().map_or(0, |s| s.sequences())).collect());
            }
            DrafterMsg::Forget { seq, lane } => {
                if let Some(Some(src)) = st.sources.get_mut(lane) {
                    src.forget(seq);
                }
            }
        }
        Ok(())
    }
}
