//! Hidden-state taps of the glm5_next CPU forward: a tapped layer's state is what a model cut
//! after that layer would feed its final head (the mean of the mHC streams).

use super::ops::rms_norm;
use super::Glm5Backend;
use crate::backend::cpu::linear::LinearScratch;
use crate::backend::{Backend, KvGeometry, SeqStep};
use crate::model::default_model::CacheDir;

fn tiny() -> (crate::model::ModelBundle, crate::model::glm5_next::Glm5Config) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/glm5/tiny");
    let bundle = crate::model::open(dir, &CacheDir::from_env()).expect("open the tiny glm5 fixture");
    let cfg = crate::model::glm5_next::read_config(bundle.weights.origin()).unwrap();
    (bundle, cfg)
}

/// The final norm and head of `b` over collapsed hidden rows.
fn head(b: &Glm5Backend, x: &[f32]) -> Vec<f32> {
    let (d, w) = (b.model.cfg.hidden_size, &b.model.weights);
    let mut h = x.to_vec();
    h.chunks_mut(d).for_each(|r| rms_norm(r, &w.norm, b.model.cfg.rms_norm_eps));
    let m = h.len() / d;
    let mut out = vec![0f32; m * b.model.cfg.vocab_size];
    w.lm_head.as_ref().unwrap_or(&w.embed).forward(&h, m, &mut out, &mut LinearScratch::default(), b.simd).unwrap();
    out
}

#[test]
fn tapped_states_are_what_a_model_cut_after_that_layer_computes() {
    let (bundle, cfg) = tiny();
    let geom = KvGeometry { block_size: 4, num_blocks: 32, state_slots: 2 };
    let mut full = Glm5Backend::new(cfg.clone(), bundle.weights.as_ref(), 2, geom).unwrap();
    let last = full.model.weights.layers.len() - 1;
    assert!(last >= 1, "the fixture needs two layers");
    let err = full.set_hidden_taps(&[last + 1]).unwrap_err().to_string();
    assert!(err.contains(&format!("has {} layers", last + 1)), "{err}");
    full.set_hidden_taps(&[last, 0]).unwrap();
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..9).map(|i| (i * 31 + 5) % 200).collect(), vec![7, 9, 11]);
    let steps = [
        SeqStep { tokens: &a, start_pos: 0, block_table: &[0, 1, 2], logits_rows: a.len(), state_slot: 0 },
        SeqStep { tokens: &b, start_pos: 0, block_table: &[8], logits_rows: b.len(), state_slot: 1 },
    ];
    let logits = full.forward(&steps).unwrap();
    let taps = full.take_hidden_taps().expect("taps were asked for");
    assert_eq!((taps.layers.clone(), taps.offsets.clone()), (vec![last, 0], vec![0, 9, 12]));
    let d = cfg.hidden_size;
    let column = |rows: &[f32], col: usize| -> Vec<f32> {
        rows.chunks_exact(2 * d).flat_map(|r| r[col * d..(col + 1) * d].to_vec()).collect()
    };
    // The last layer's tap is what the model's own head reads.
    assert_eq!(head(&full, &column(&taps.data, 0)), logits.data);
    // Layer 0's tap: a model cut after layer 0, each sequence run alone.
    let mut cut = Glm5Backend::new(cfg.clone(), bundle.weights.as_ref(), 2, geom).unwrap();
    cut.model.weights.layers.truncate(1);
    for (i, (ids, table, slot)) in [(&a, &[16u32, 17, 18][..], 0u32), (&b, &[20][..], 1)].into_iter().enumerate() {
        let step = SeqStep { tokens: ids, start_pos: 0, block_table: table, logits_rows: ids.len(), state_slot: slot };
        let alone = cut.forward(&[step]).unwrap().data;
        assert_eq!(head(&cut, &column(taps.seq_rows(i, 0, ids.len()), 1)), alone, "sequence {i}");
    }
    full.set_hidden_taps(&[]).unwrap();
    full.forward(&steps[1..]).unwrap();
    assert!(full.take_hidden_taps().is_none(), "nothing recorded without taps");
}
