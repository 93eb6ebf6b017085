//! `DrafterActor`: owns the draft sources (one per lane that drafts) and their per-sequence state.
//! The scheduler sends it, once per planned step, the tokens each decoding sequence accepted since
//! last time together with how many drafts it may take, and gets the proposals back in the same
//! reply — one round trip per step, however many sequences draft. It never sees KV blocks or
//! logits; whether a draft is used (budget, blocks, preemption) is the scheduler's call.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::sched::SeqId;
use crate::spec::adaptive::{Adaptive, AdaptiveConfig};
use crate::spec::ngram::{NgramConfig, NgramDrafter};
use crate::spec::{DraftError, DraftSource, SpeculativeMethod};

/// New context for one sequence and a request for up to `k` drafts.
#[derive(Clone, Debug)]
pub struct DraftUpdate {
    pub seq: SeqId,
    pub lane: usize,
    /// Tokens appended to the sequence since the last update (the prompt on the first one).
    pub append: Vec<u32>,
    pub k: usize,
}

pub enum DrafterMsg {
    /// Extend and propose; the reply holds `(seq, draft)` for sequences with a non-empty draft.
    Propose { updates: Vec<DraftUpdate>, reply: RpcReplyPort<Vec<(SeqId, Vec<u32>)>> },
    /// The sequence ended (finished, cancelled, failed): drop its state.
    Forget { seq: SeqId, lane: usize },
}

pub struct DrafterActor;

pub struct DrafterState {
    /// Indexed by lane; `None` for lanes that do not draft.
    sources: Vec<Option<Box<dyn DraftSource>>>,
}

/// Build the source for each lane's method. The n-gram drafter runs under the adaptive draft
/// length (`spec::adaptive`): long drafts where they are being accepted, none where they fail.
pub fn sources_for(methods: &[SpeculativeMethod]) -> Result<Vec<Option<Box<dyn DraftSource>>>, DraftError> {
    methods
        .iter()
        .map(|m| match m {
            SpeculativeMethod::None => Ok(None),
            SpeculativeMethod::Ngram => {
                let ngram = NgramDrafter::new(NgramConfig::default())?;
                Ok(Some(Box::new(Adaptive::new(ngram, AdaptiveConfig::default())) as Box<dyn DraftSource>))
            }
            SpeculativeMethod::DraftModel(path) => Err(DraftError::InvalidConfig(format!(
                "draft-model drafting (draft:{path}) is not available yet; use ngram or none"
            ))),
        })
        .collect()
}

impl Actor for DrafterActor {
    type Msg = DrafterMsg;
    type State = DrafterState;
    type Arguments = Vec<Option<Box<dyn DraftSource>>>;

    async fn pre_start(
        &self,
        _myself: ActorRef<DrafterMsg>,
        sources: Self::Arguments,
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
                let mut out = Vec::new();
                for u in updates {
                    let Some(Some(src)) = st.sources.get_mut(u.lane) else { continue };
                    src.extend(u.seq, &u.append);
                    let draft = src.propose(u.seq, u.k);
                    if !draft.is_empty() {
                        out.push((u.seq, draft));
                    }
                }
                let _ = reply.send(out);
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
