//! The messages that cross processes, as `ractor::Message` implementations with a serialized
//! form (ractor's `cluster` feature: a message type says itself whether and how it travels).
//!
//! Only the executor's and the scheduler's messages travel: a worker's `ExecutorActor` is a remote
//! actor of the head, sent `Run`/`Resume`, rank 0's verification commits (`CommitVerified`), the
//! KV pool's state writes and page reads (`ReadSlices`) and the spill tier's page writes, and it
//! answers the head's `SchedulerActor` with `ExecutorReady`/`StepDone`/`ExecutorFailed` and its
//! slices of pages being spilled (`PageSlices`). Each is
//! encoded as its variant's name (ractor_cluster's tag) and its fields in postcard. A variant that
//! holds a local handle (a reply port, an actor reference of this process) cannot travel: sending
//! it to a remote actor is refused with an error instead of being dropped silently.

use ractor::message::{BoxedDowncastErr, SerializedMessage};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::actors::executor::{ExecutorMsg, StepPlan, StepResult};
use crate::actors::rank_pages::SliceReport;
use crate::actors::rank_state::VerifiedSlot;
use crate::actors::ranks::RankReady;
use crate::actors::scheduler::SchedulerMsg;
use crate::kv::PageHash;

/// Encodes a message's fields (postcard: compact, no schema, well kept).
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, BoxedDowncastErr> {
    postcard::to_stdvec(value).map_err(|e| {
        tracing::error!(error = %e, "a cluster message could not be encoded");
        BoxedDowncastErr
    })
}

/// Decodes a message's fields; a malformed payload is an error, never a panic.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, BoxedDowncastErr> {
    postcard::from_bytes(bytes).map_err(|e| {
        tracing::error!(error = %e, "a cluster message could not be decoded");
        BoxedDowncastErr
    })
}

fn cast(variant: &str, args: Vec<u8>) -> SerializedMessage {
    SerializedMessage::Cast { variant: variant.to_string(), args, metadata: None }
}

fn local_only(what: &str) -> Result<SerializedMessage, BoxedDowncastErr> {
    tracing::error!(message = what, "a process-local message was sent to an actor of another process");
    Err(BoxedDowncastErr)
}

/// `ExecutorReady` as it travels: the executor's own reference stays behind (an actor reference is
/// only meaningful in its process); the head finds the rank's executor in its process group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadyReport {
    pub rank: usize,
    pub ready: RankReady,
    pub snapshots_inside_step: bool,
}

#[derive(Serialize, Deserialize)]
struct WriteStateWire {
    slot: u32,
    image: std::sync::Arc<[u8]>,
}

#[derive(Serialize, Deserialize)]
struct CommitVerifiedWire {
    step_id: u64,
    slots: Vec<VerifiedSlot>,
}

#[derive(Serialize, Deserialize)]
struct ReadSlicesWire {
    batch: u64,
    pages: Vec<(PageHash, Vec<u32>)>,
}

#[derive(Serialize, Deserialize)]
struct WritePageWire {
    hash: PageHash,
    blocks: Vec<u32>,
    image: Vec<u8>,
}

impl ractor::Message for ExecutorMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            ExecutorMsg::Run(plan) => Ok(cast("Run", encode(&plan)?)),
            ExecutorMsg::Resume { step_id } => Ok(cast("Resume", encode(&step_id)?)),
            ExecutorMsg::WriteState { slot, image } => Ok(cast("WriteState", encode(&WriteStateWire { slot, image })?)),
            ExecutorMsg::WritePage { hash, blocks, image } => {
                Ok(cast("WritePage", encode(&WritePageWire { hash, blocks, image: image.to_vec() })?))
            }
            ExecutorMsg::CommitVerified { step_id, slots } => {
                Ok(cast("CommitVerified", encode(&CommitVerifiedWire { step_id, slots })?))
            }
            ExecutorMsg::ReadSlices { batch, pages } => {
                Ok(cast("ReadSlices", encode(&ReadSlicesWire { batch, pages })?))
            }
            // The spill tier's reads carry this process's spill actor and a reply port.
            ExecutorMsg::ReadPages { .. } => local_only("ExecutorMsg::ReadPages"),
        }
    }

    fn deserialize(msg: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        let SerializedMessage::Cast { variant, args, .. } = msg else { return Err(BoxedDowncastErr) };
        match variant.as_str() {
            "Run" => Ok(ExecutorMsg::Run(decode::<StepPlan>(&args)?)),
            "Resume" => Ok(ExecutorMsg::Resume { step_id: decode(&args)? }),
            "WriteState" => {
                let w: WriteStateWire = decode(&args)?;
                Ok(ExecutorMsg::WriteState { slot: w.slot, image: w.image })
            }
            "CommitVerified" => {
                let w: CommitVerifiedWire = decode(&args)?;
                Ok(ExecutorMsg::CommitVerified { step_id: w.step_id, slots: w.slots })
            }
            "ReadSlices" => {
                let w: ReadSlicesWire = decode(&args)?;
                Ok(ExecutorMsg::ReadSlices { batch: w.batch, pages: w.pages })
            }
            "WritePage" => {
                let w: WritePageWire = decode(&args)?;
                Ok(ExecutorMsg::WritePage { hash: w.hash, blocks: w.blocks, image: w.image.into() })
            }
            _ => Err(BoxedDowncastErr),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct FailedWire {
    rank: usize,
    error: String,
}

impl ractor::Message for SchedulerMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            SchedulerMsg::StepDone(r) => Ok(cast("StepDone", encode(&r)?)),
            SchedulerMsg::ExecutorReady {
                rank, kv, kv_block_bytes, state_slot_bytes, snapshots_inside_step, ..
            } => {
                let ready = RankReady { kv, kv_block_bytes, state_slot_bytes };
                Ok(cast("ExecutorReady", encode(&ReadyReport { rank, ready, snapshots_inside_step })?))
            }
            SchedulerMsg::ExecutorFailed { rank, error } => {
                Ok(cast("ExecutorFailed", encode(&FailedWire { rank, error })?))
            }
            SchedulerMsg::PageSlices(report) => Ok(cast("PageSlices", encode(&report)?)),
            // Requests, the pool's replies and the engine's queries live in the head process.
            _ => local_only("a SchedulerMsg other than an executor's report"),
        }
    }

    fn deserialize(msg: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        let SerializedMessage::Cast { variant, args, .. } = msg else { return Err(BoxedDowncastErr) };
        match variant.as_str() {
            "StepDone" => Ok(SchedulerMsg::StepDone(decode::<StepResult>(&args)?)),
            "ExecutorReady" => {
                let r: ReadyReport = decode(&args)?;
                Ok(SchedulerMsg::ExecutorReady {
                    rank: r.rank,
                    kv: r.ready.kv,
                    kv_block_bytes: r.ready.kv_block_bytes,
                    state_slot_bytes: r.ready.state_slot_bytes,
                    snapshots_inside_step: r.snapshots_inside_step,
                    executor: None,
                })
            }
            "ExecutorFailed" => {
                let f: FailedWire = decode(&args)?;
                Ok(SchedulerMsg::ExecutorFailed { rank: f.rank, error: f.error })
            }
            "PageSlices" => Ok(SchedulerMsg::PageSlices(decode::<SliceReport>(&args)?)),
            _ => Err(BoxedDowncastErr),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use ractor::Message;

    use super::*;
    use crate::actors::executor::{PlanSeq, SampleSpec};
    use crate::backend::KvGeometry;
    use crate::kv::SlotSnapshot;
    use crate::sampling::{PenaltyState, Sampled, SamplingParams};
    use crate::spec::step::StepTokens;
    use crate::spec::HiddenChunk;

    fn plan() -> StepPlan {
        // One id each: the history's sets print in no fixed order.
        let mut penalties = PenaltyState::new(&[2, 2]);
        penalties.push_output(2);
        let params = SamplingParams { temperature: 0.7, seed: 42, logit_bias: vec![(3, -1.5)], ..Default::default() };
        StepPlan {
            step_id: 17,
            yield_signal: None,
            seqs: vec![
                PlanSeq {
                    seq: 3,
                    tokens: vec![5, 6, 7],
                    start_pos: 12,
                    block_table: vec![0, 4, 9],
                    state_slot: 2,
                    num_draft: 2,
                    sample: Some(SampleSpec {
                        params: Arc::new(params),
                        step: 4,
                        penalties: Some(Arc::new(penalties)),
                        grammar: None,
                    }),
                    snapshot_after: vec![1, 3],
                    images: Vec::new(),
                    follows_previous: false,
                },
                PlanSeq {
                    seq: 8,
                    tokens: vec![1; 40],
                    start_pos: 0,
                    block_table: vec![1, 2, 3],
                    state_slot: 0,
                    num_draft: 0,
                    sample: None,
                    snapshot_after: Vec::new(),
                    images: Vec::new(),
                    follows_previous: true,
                },
            ],
        }
    }

    fn result() -> StepResult {
        StepResult {
            step_id: 17,
            rank: 1,
            sampled: vec![(
                3,
                StepTokens {
                    tokens: vec![Sampled { token: 11, logprob: -0.25, top_logprobs: vec![(11, -0.25), (4, -2.0)] }],
                    drafted: 2,
                    accepted: 0,
                },
            )],
            elapsed: Duration::from_micros(1234),
            prefill_tokens: 40,
            decode_tokens: 3,
            error: Some("collective aborted: rank 1 failed".into()),
            snapshots: vec![SlotSnapshot { seq: 3, tokens: 16, image: Arc::from(&[1u8, 2, 3][..]) }],
            hidden: vec![(3, HiddenChunk { start_pos: 12, layers: Arc::from(&[2usize, 5][..]), data: vec![0.5; 4] })],
            rejected: vec![(8, "bad image".into())],
            suspended_after: Some(3),
            verified: vec![VerifiedSlot { slot: 2, kept: 3 }],
        }
    }

    fn args_of(msg: &SerializedMessage) -> (&str, &[u8]) {
        match msg {
            SerializedMessage::Cast { variant, args, .. } => (variant, args),
            _ => panic!("a cast was expected"),
        }
    }

    #[test]
    fn a_step_plan_crosses_processes_unchanged() {
        let wire = ExecutorMsg::Run(plan()).serialize().unwrap();
        assert_eq!(args_of(&wire).0, "Run");
        let ExecutorMsg::Run(back) = ExecutorMsg::deserialize(wire).unwrap() else { panic!("not a Run") };
        let (a, b) = (format!("{:?}", plan()), format!("{back:?}"));
        assert_eq!(a, b);
        let ExecutorMsg::Resume { step_id } =
            ExecutorMsg::deserialize(ExecutorMsg::Resume { step_id: 9 }.serialize().unwrap()).unwrap()
        else {
            panic!("not a Resume")
        };
        assert_eq!(step_id, 9);
        let page = ExecutorMsg::WritePage {
            hash: PageHash([7; 16]),
            blocks: vec![3, 4],
            image: bytes::Bytes::from_static(&[9, 8, 7]),
        };
        let ExecutorMsg::WritePage { hash, blocks, image } =
            ExecutorMsg::deserialize(page.serialize().unwrap()).unwrap()
        else {
            panic!("not a WritePage")
        };
        assert_eq!((hash, blocks, &image[..]), (PageHash([7; 16]), vec![3, 4], &[9u8, 8, 7][..]));
        let slots = vec![VerifiedSlot { slot: 1, kept: 4 }, VerifiedSlot { slot: 5, kept: 1 }];
        let commit = ExecutorMsg::CommitVerified { step_id: 12, slots: slots.clone() };
        let ExecutorMsg::CommitVerified { step_id, slots: back } =
            ExecutorMsg::deserialize(commit.serialize().unwrap()).unwrap()
        else {
            panic!("not a CommitVerified")
        };
        assert_eq!((step_id, back), (12, slots));
        let pages = vec![(PageHash([1; 16]), vec![4, 5]), (PageHash([2; 16]), vec![6])];
        let read = ExecutorMsg::ReadSlices { batch: 3, pages: pages.clone() };
        let ExecutorMsg::ReadSlices { batch, pages: back } =
            ExecutorMsg::deserialize(read.serialize().unwrap()).unwrap()
        else {
            panic!("not a ReadSlices")
        };
        assert_eq!((batch, back), (3, pages));
    }

    #[test]
    fn page_slices_cross_processes_unchanged() {
        let reports = [
            SliceReport::Page { rank: 1, batch: 9, index: 2, hash: PageHash([3; 16]), image: Ok(vec![0, 255, 7]) },
            SliceReport::Page { rank: 2, batch: 9, index: 0, hash: PageHash([4; 16]), image: Err("lost".into()) },
            SliceReport::Done { rank: 1, batch: 9 },
        ];
        for report in reports {
            let wire = SchedulerMsg::PageSlices(report.clone()).serialize().unwrap();
            assert_eq!(args_of(&wire).0, "PageSlices");
            let SchedulerMsg::PageSlices(back) = SchedulerMsg::deserialize(wire).unwrap() else {
                panic!("not PageSlices")
            };
            assert_eq!(back, report);
        }
    }

    #[test]
    fn step_results_and_ready_reports_cross_processes_unchanged() {
        let wire = SchedulerMsg::StepDone(result()).serialize().unwrap();
        let SchedulerMsg::StepDone(back) = SchedulerMsg::deserialize(wire).unwrap() else { panic!("not StepDone") };
        assert_eq!(format!("{:?}", result()), format!("{back:?}"));
        let kv = KvGeometry { block_size: 16, num_blocks: 321, state_slots: 4 };
        let wire = SchedulerMsg::ExecutorReady {
            rank: 3,
            kv,
            kv_block_bytes: 4096,
            state_slot_bytes: 0,
            snapshots_inside_step: true,
            executor: None,
        }
        .serialize()
        .unwrap();
        let SchedulerMsg::ExecutorReady { rank, kv: k, kv_block_bytes, snapshots_inside_step, executor, .. } =
            SchedulerMsg::deserialize(wire).unwrap()
        else {
            panic!("not ExecutorReady")
        };
        assert_eq!((rank, k, kv_block_bytes, snapshots_inside_step, executor.is_none()), (3, kv, 4096, true, true));
        let wire = SchedulerMsg::ExecutorFailed { rank: 1, error: "gone".into() }.serialize().unwrap();
        let SchedulerMsg::ExecutorFailed { rank, error } = SchedulerMsg::deserialize(wire).unwrap() else {
            panic!("not ExecutorFailed")
        };
        assert_eq!((rank, error.as_str()), (1, "gone"));
    }

    #[test]
    fn local_only_and_malformed_messages_are_errors() {
        assert!(SchedulerMsg::Cancel(4).serialize().is_err());
        // A truncated plan, an unknown variant and a call instead of a cast.
        let wire = ExecutorMsg::Run(plan()).serialize().unwrap();
        let (_, args) = args_of(&wire);
        assert!(ExecutorMsg::deserialize(cast("Run", args[..args.len() / 2].to_vec())).is_err());
        assert!(ExecutorMsg::deserialize(cast("Explode", Vec::new())).is_err());
        assert!(SchedulerMsg::deserialize(cast("Submit", Vec::new())).is_err());
        assert!(SchedulerMsg::deserialize(SerializedMessage::CallReply(1, Vec::new())).is_err());
    }
}
