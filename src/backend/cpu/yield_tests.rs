//! A step that yields between layers and is resumed later computes exactly what it would have
//! computed uninterrupted (the exactness rule for the voice lane's pre-emption of agent prefill):
//! bitwise the same logits, and bitwise the same KV (the next decode step agrees too), whatever
//! ran in between on other blocks.

use std::sync::atomic::{AtomicBool, Ordering};

use super::{CpuBackend, CpuOptions};
use crate::backend::{Backend, KvGeometry, SeqStep, StepLogits, StepRun};
use crate::config::LlamaConfig;
use crate::model::synthetic::{tiny_llama_config, SyntheticWeights};
use crate::model::DType;

fn four_layers() -> LlamaConfig {
    LlamaConfig { num_hidden_layers: 4, ..tiny_llama_config() }
}

fn backend(cfg: &LlamaConfig) -> CpuBackend {
    let w = SyntheticWeights::new(cfg, DType::F32, 7);
    let opts =
        CpuOptions { threads: 2, kv: KvGeometry { block_size: 4, num_blocks: 32, state_slots: 1 }, kv_precision: None };
    CpuBackend::new(cfg, &w, opts).unwrap()
}

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 53 + salt * 97 + 3) % 256).collect()
}

fn bits(l: &StepLogits) -> Vec<u32> {
    l.data.iter().map(|v| v.to_bits()).collect()
}

fn done(run: StepRun) -> StepLogits {
    match run {
        StepRun::Done(l) => l,
        StepRun::Suspended { after_layer } => panic!("suspended after layer {after_layer}, expected to finish"),
    }
}

/// Two agent prefill chunks (one ending its prompt), the voice turn that interrupts them, and the
/// decode after the agent chunk: blocks 0..8 are the agents', 16..20 the voice turn's.
struct Work {
    a: Vec<u32>,
    b: Vec<u32>,
    voice: Vec<u32>,
}

impl Work {
    fn new() -> Self {
        Work { a: ids(13, 1), b: ids(9, 2), voice: ids(6, 3) }
    }

    fn agents(&self) -> [SeqStep<'_>; 2] {
        [
            SeqStep { tokens: &self.a, start_pos: 0, block_table: &[0, 1, 2, 3], logits_rows: 1, state_slot: 0 },
            SeqStep { tokens: &self.b, start_pos: 0, block_table: &[4, 5, 6], logits_rows: 0, state_slot: 0 },
        ]
    }

    fn voice(&self) -> [SeqStep<'_>; 1] {
        [SeqStep { tokens: &self.voice, start_pos: 0, block_table: &[16, 17], logits_rows: 1, state_slot: 0 }]
    }

    /// The agent's next token, fed after its chunk (reads every layer's KV of the chunk).
    fn decode(&self, b: &mut CpuBackend) -> StepLogits {
        let next = [7u32];
        b.forward(&[SeqStep {
            tokens: &next,
            start_pos: 13,
            block_table: &[0, 1, 2, 3],
            logits_rows: 1,
            state_slot: 0,
        }])
        .unwrap()
    }
}

#[test]
fn a_suspended_then_resumed_step_gives_bitwise_the_uninterrupted_logits_and_kv() {
    let cfg = four_layers();
    let w = Work::new();
    let mut reference = backend(&cfg);
    let never = AtomicBool::new(false);
    let whole = done(reference.forward_yielding(&w.agents(), &never).unwrap());
    assert_eq!(bits(&whole), bits(&reference.forward(&w.agents()).unwrap()), "an unsignalled run is forward");
    let voice_alone = reference.forward(&w.voice()).unwrap();
    let decode_ref = w.decode(&mut reference);

    let mut b = backend(&cfg);
    assert!(b.can_yield());
    let signal = AtomicBool::new(true);
    // Raised before the step: it stops after the first layer; still raised on resume: one more.
    assert!(matches!(b.forward_yielding(&w.agents(), &signal).unwrap(), StepRun::Suspended { after_layer: 0 }));
    assert!(b.forward_yielding(&w.agents(), &signal).is_err(), "one suspended step at a time");
    let voice = b.forward(&w.voice()).unwrap();
    assert_eq!(bits(&voice), bits(&voice_alone), "the voice turn in between is unaffected");
    assert!(matches!(b.resume_suspended(&w.agents(), &signal).unwrap(), StepRun::Suspended { after_layer: 1 }));
    assert!(b.resume_suspended(&w.voice(), &signal).is_err(), "a resume must bring back the same batch");
    // The failed resume dropped it: start again and let it run through after one yield.
    assert!(b.resume_suspended(&w.agents(), &signal).is_err(), "nothing left to resume");

    let mut b = backend(&cfg);
    assert!(matches!(b.forward_yielding(&w.agents(), &signal).unwrap(), StepRun::Suspended { after_layer: 0 }));
    b.forward(&w.voice()).unwrap();
    assert!(matches!(b.resume_suspended(&w.agents(), &signal).unwrap(), StepRun::Suspended { after_layer: 1 }));
    b.forward(&w.voice()).unwrap();
    signal.store(false, Ordering::Release);
    let resumed = done(b.resume_suspended(&w.agents(), &signal).unwrap());
    assert_eq!(bits(&resumed), bits(&whole), "resumed logits differ from the uninterrupted step");
    assert_eq!(bits(&w.decode(&mut b)), bits(&decode_ref), "the KV the resumed step wrote differs");

    // The last layer never yields: nothing would be left to resume.
    let mut b = backend(&LlamaConfig { num_hidden_layers: 1, ..cfg });
    signal.store(true, Ordering::Release);
    assert!(matches!(b.forward_yielding(&w.agents(), &signal).unwrap(), StepRun::Done(_)));
}

#[test]
fn a_dropped_suspended_step_leaves_room_for_the_next() {
    let cfg = four_layers();
    let w = Work::new();
    let mut b = backend(&cfg);
    let signal = AtomicBool::new(true);
    assert!(matches!(b.forward_yielding(&w.agents(), &signal).unwrap(), StepRun::Suspended { .. }));
    b.drop_suspended();
    assert!(b.resume_suspended(&w.agents(), &signal).is_err());
    signal.store(false, Ordering::Release);
    let mut reference = backend(&cfg);
    let whole = reference.forward(&w.agents()).unwrap();
    // Re-running the chunk from the start overwrites what the dropped step wrote.
    assert_eq!(bits(&done(b.forward_yielding(&w.agents(), &signal).unwrap())), bits(&whole));
    assert_eq!(bits(&w.decode(&mut b)), bits(&w.decode(&mut reference)));
}

/// A decode row beside a prefill chunk (the agent lane's decodes ride in its yieldable steps):
/// suspended twice, with voice in between, its logits and the chunk's equal the uninterrupted
/// step's bitwise.
#[test]
fn a_decode_row_in_a_suspended_step_gives_the_uninterrupted_logits() {
    let cfg = four_layers();
    let w = Work::new();
    let next = [7u32];
    let mixed = [
        SeqStep { tokens: &next, start_pos: 13, block_table: &[0, 1, 2, 3], logits_rows: 1, state_slot: 0 },
        SeqStep { tokens: &w.b, start_pos: 0, block_table: &[4, 5, 6], logits_rows: 1, state_slot: 0 },
    ];
    let agent_a = [w.agents()[0]];
    let mut reference = backend(&cfg);
    reference.forward(&agent_a).unwrap();
    let whole = reference.forward(&mixed).unwrap();

    let mut b = backend(&cfg);
    b.forward(&agent_a).unwrap();
    let signal = AtomicBool::new(true);
    assert!(matches!(b.forward_yielding(&mixed, &signal).unwrap(), StepRun::Suspended { after_layer: 0 }));
    b.forward(&w.voice()).unwrap();
    assert!(matches!(b.resume_suspended(&mixed, &signal).unwrap(), StepRun::Suspended { after_layer: 1 }));
    b.forward(&w.voice()).unwrap();
    signal.store(false, Ordering::Release);
    let resumed = done(b.resume_suspended(&mixed, &signal).unwrap());
    assert_eq!(resumed.offsets, whole.offsets);
    assert_eq!(bits(&resumed), bits(&whole), "the decode row or the chunk computed differently");
}
