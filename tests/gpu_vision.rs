//! The `glm5_next` vision tower and image prompts on the CUDA backend against references on a
//! real GPU (run by `scripts/gpu_vision.sh` on the device machine; in CI these are ignored with
//! the reason, never passed). References: the CPU tower and backend in f32 (golden-tested against
//! transformers in `tests/media_golden.rs`) and the transformers embeddings and logits stored in
//! `tests/fixtures/media/forward.safetensors` for `glm5/vision-tiny`.
//!
//! * f32: image embeddings (the fixture's two images and synthetic images of larger, different
//!   grids, several attention tiles and two frames) within 1e-4 relative per row of the CPU and
//!   of transformers; the logits of the image prompt within 1e-4 of both; a greedy continuation
//!   after the image prompt identical to the CPU's;
//! * images of different grids encoded in one call equal each encoded alone (1e-5: only the
//!   GEMMs' row counts differ);
//! * bf16: the error against f32 is printed (and held to a sanity bound that only a broken kernel
//!   crosses);
//! * bad grids, pixel counts and embedded runs are errors.
//!
//! Every test prints a table of its checks (max error, bound) before it fails on any of them.

mod common;

use common::argmax;

use common::{tensor_f32s as floats, tensor_ids as ints};
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::cuda::glm5_next::Glm5CudaBackend;
use shelfserve::backend::cuda::Precision;
use shelfserve::backend::{Backend, EmbeddedRows, ImageEmbedding, KvGeometry, SeqStep};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::read_config;
use shelfserve::model::glm5_next::vision::{image_spans, read_vision_config, MultimodalIds, VisionConfig};
use shelfserve::model::ModelBundle;

const MODEL: &str = "glm5/vision-tiny";
const GEOM: KvGeometry = KvGeometry { block_size: 16, num_blocks: 8, state_slots: 2 };

fn bundle() -> ModelBundle {
    shelfserve::model::open(common::fixture(MODEL).to_str().unwrap(), &CacheDir::from_env()).unwrap()
}

fn cuda(p: Precision) -> Glm5CudaBackend {
    let b = bundle();
    let cfg = read_config(b.weights.origin()).unwrap();
    Glm5CudaBackend::new(cfg, b.weights.as_ref(), 0, GEOM, p).unwrap()
}

fn cpu() -> Glm5Backend {
    let b = bundle();
    let cfg = read_config(b.weights.origin()).unwrap();
    Glm5Backend::new(cfg, b.weights.as_ref(), 0, GEOM).unwrap()
}

fn vision() -> (VisionConfig, MultimodalIds) {
    read_vision_config(&common::fixture(MODEL)).unwrap().unwrap()
}

/// Largest per-row `max |Δ| / max |ref|`.
fn row_rel_err(reference: &[f32], ours: &[f32], width: usize) -> f32 {
    assert_eq!(reference.len(), ours.len(), "lengths differ");
    reference
        .chunks(width)
        .zip(ours.chunks(width))
        .map(|(a, b)| {
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// Checks of one test: printed as a table, then asserted together.
#[derive(Default)]
struct Table {
    rows: Vec<(String, f32, f32)>,
}

impl Table {
    fn check(&mut self, name: impl Into<String>, err: f32, bound: f32) {
        self.rows.push((name.into(), err, bound));
    }

    fn finish(self, title: &str) {
        println!("\n{title}\n{:<58} {:>12} {:>10}  ok", "check", "max err", "bound");
        let mut failed = Vec::new();
        for (name, err, bound) in &self.rows {
            let ok = err.is_finite() && err <= bound;
            println!("{name:<58} {err:>12.3e} {bound:>10.1e}  {}", if ok { "yes" } else { "NO" });
            if !ok {
                failed.push(name.clone());
            }
        }
        assert!(failed.is_empty(), "{title}: failed checks {failed:?}");
    }
}

/// The fixture's images (pixel values and grids), its image prompt ids, and the transformers
/// embeddings and logits.
struct Golden {
    images: Vec<(Vec<f32>, [usize; 3])>,
    ids: Vec<u32>,
    embeds: Vec<f32>,
    logits: Vec<f32>,
}

fn golden() -> Golden {
    let bytes = std::fs::read(common::fixture("media/forward.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (vc, _) = vision();
    let pixels = floats(&st, "pixel_values");
    let grid = ints(&st, "grid");
    let mut images = Vec::new();
    let mut at = 0;
    for g in grid.chunks(3) {
        let g = [g[0] as usize, g[1] as usize, g[2] as usize];
        let n = g.iter().product::<usize>() * vc.patch_dim();
        images.push((pixels[at..at + n].to_vec(), g));
        at += n;
    }
    Golden { images, ids: ints(&st, "ids"), embeds: floats(&st, "image_embeds"), logits: floats(&st, "logits") }
}

/// Deterministic pseudo-random pixel values in the processor's range (about ±2).
fn synthetic(seed: u32, grid: [usize; 3], patch_dim: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..grid.iter().product::<usize>() * patch_dim)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) * 4.0 - 2.0
        })
        .collect()
}

fn step<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [u32], logits_rows: usize) -> SeqStep<'a> {
    SeqStep { tokens, start_pos, block_table: table, logits_rows, state_slot: 0 }
}

/// Logits of the image prompt (every row) and a greedy continuation of `n` tokens after it.
fn prompt_and_greedy(be: &mut dyn Backend, ids: &[u32], embeds: &[ImageEmbedding], n: usize) -> (Vec<f32>, Vec<u32>) {
    let (_, mm) = vision();
    let spans = image_spans(ids, &mm);
    assert_eq!(spans.len(), embeds.len());
    let runs: Vec<EmbeddedRows<'_>> = spans
        .iter()
        .zip(embeds)
        .map(|(s, e)| EmbeddedRows { first_row: s.start, hidden: e.hidden, data: &e.data })
        .collect();
    let table: Vec<u32> = (0..GEOM.num_blocks as u32).collect();
    let out = be.forward_embedded(&[step(ids, 0, &table, ids.len())], &[], &[runs]).unwrap();
    let vocab = out.vocab;
    let mut next = argmax(&out.data[(ids.len() - 1) * vocab..]);
    let mut tokens = vec![next];
    for i in 1..n {
        let t = [next];
        let l = be.forward(&[step(&t, ids.len() + i - 1, &table, 1)]).unwrap();
        next = argmax(&l.data);
        tokens.push(next);
    }
    (out.data, tokens)
}

fn encode_all(be: &mut dyn Backend, images: &[(Vec<f32>, [usize; 3])]) -> Vec<ImageEmbedding> {
    images.iter().map(|(px, g)| be.encode_image(px, *g).unwrap()).collect()
}

fn concat(e: &[ImageEmbedding]) -> Vec<f32> {
    e.iter().flat_map(|x| x.data.iter().copied()).collect()
}

/// Images of grids with several attention tiles (96 patches per frame), two frames, and a
/// non-square grid.
fn synthetic_images(vc: &VisionConfig) -> Vec<(Vec<f32>, [usize; 3])> {
    [[1, 8, 12], [2, 4, 6], [1, 2, 10]]
        .iter()
        .enumerate()
        .map(|(i, &g)| (synthetic(i as u32 + 7, g, vc.patch_dim()), g))
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_vision.sh"]
fn tower_f32_matches_cpu_and_transformers() {
    let (vc, _) = vision();
    let g = golden();
    let mut gpu = cuda(Precision::F32);
    let mut host = cpu();
    let mut t = Table::default();
    let ours = encode_all(&mut gpu, &g.images);
    for (e, (_, grid)) in ours.iter().zip(&g.images) {
        assert_eq!((e.rows, e.hidden), (vc.tokens(*grid), vc.out_hidden_size));
    }
    let w = vc.out_hidden_size;
    t.check("fixture images: CUDA f32 vs transformers", row_rel_err(&g.embeds, &concat(&ours), w), 1e-4);
    let cpu_e = encode_all(&mut host, &g.images);
    t.check("fixture images: CUDA f32 vs CPU", row_rel_err(&concat(&cpu_e), &concat(&ours), w), 1e-4);
    for (px, grid) in synthetic_images(&vc) {
        let a = host.encode_image(&px, grid).unwrap();
        let b = gpu.encode_image(&px, grid).unwrap();
        assert_eq!(b.rows, vc.tokens(grid));
        t.check(format!("synthetic {grid:?}: CUDA f32 vs CPU"), row_rel_err(&a.data, &b.data, w), 1e-4);
    }
    t.finish("vision tower, CUDA f32");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_vision.sh"]
fn image_prompt_logits_and_greedy_match_cpu() {
    let g = golden();
    let mut gpu = cuda(Precision::F32);
    let mut host = cpu();
    let mut t = Table::default();
    let gpu_e = encode_all(&mut gpu, &g.images);
    let cpu_e = encode_all(&mut host, &g.images);
    let (gl, gtoks) = prompt_and_greedy(&mut gpu, &g.ids, &gpu_e, 8);
    let (cl, ctoks) = prompt_and_greedy(&mut host, &g.ids, &cpu_e, 8);
    let vocab = gl.len() / g.ids.len();
    t.check("image prompt logits: CUDA f32 vs CPU", row_rel_err(&cl, &gl, vocab), 1e-4);
    t.check("image prompt logits: CUDA f32 vs transformers", row_rel_err(&g.logits, &gl, vocab), 1e-4);
    let same = gtoks.iter().zip(&ctoks).filter(|(a, b)| a == b).count();
    println!("greedy after the image prompt: CUDA {gtoks:?}, CPU {ctoks:?}");
    t.check("greedy continuation: tokens that differ from the CPU's", (8 - same) as f32, 0.0);
    // Without its embeddings the prompt's placeholder ids are refused, as on the CPU.
    let table: Vec<u32> = (0..GEOM.num_blocks as u32).collect();
    assert!(gpu.forward(&[step(&g.ids, 0, &table, 1)]).is_err());
    t.finish("image prompt, CUDA f32");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_vision.sh"]
fn images_in_one_call_equal_each_alone() {
    let (vc, _) = vision();
    let mut t = Table::default();
    for p in [Precision::F32, Precision::Bf16] {
        let mut gpu = cuda(p);
        let images = synthetic_images(&vc);
        let refs: Vec<(&[f32], [usize; 3])> = images.iter().map(|(px, g)| (px.as_slice(), *g)).collect();
        let together = gpu.encode_image_batch(&refs).unwrap();
        assert_eq!(together.len(), images.len());
        for ((px, grid), joint) in images.iter().zip(&together) {
            let alone = gpu.encode_image(px, *grid).unwrap();
            let err = row_rel_err(&alone.data, &joint.data, vc.out_hidden_size);
            let bound = if p == Precision::F32 { 1e-5 } else { 2e-2 };
            t.check(format!("{p:?} {grid:?}: in one call vs alone"), err, bound);
        }
    }
    t.finish("images batched in one call");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_vision.sh"]
fn bf16_error_against_f32_is_small() {
    let (vc, _) = vision();
    let g = golden();
    let mut f32_be = cuda(Precision::F32);
    let mut bf16_be = cuda(Precision::Bf16);
    let mut t = Table::default();
    let a = encode_all(&mut f32_be, &g.images);
    let b = encode_all(&mut bf16_be, &g.images);
    // bf16 keeps 8 bits of mantissa: a few 1e-3 per GEMM through one block and the merger.
    t.check("fixture images: CUDA bf16 vs f32", row_rel_err(&concat(&a), &concat(&b), vc.out_hidden_size), 5e-2);
    for (px, grid) in synthetic_images(&vc) {
        let x = f32_be.encode_image(&px, grid).unwrap();
        let y = bf16_be.encode_image(&px, grid).unwrap();
        t.check(
            format!("synthetic {grid:?}: CUDA bf16 vs f32"),
            row_rel_err(&x.data, &y.data, vc.out_hidden_size),
            5e-2,
        );
    }
    let (la, _) = prompt_and_greedy(&mut f32_be, &g.ids, &a, 1);
    let (lb, _) = prompt_and_greedy(&mut bf16_be, &g.ids, &b, 1);
    let vocab = la.len() / g.ids.len();
    // The whole model in bf16, not the tower: on these tiny random-init fixtures bf16 storage
    // alone moves the text model's logits by up to 2.8e-1 (tests/gpu_validate_glm5.rs; the H200
    // measured 1.9e-1 here on 2026-12-03), so the bound only catches a broken path.
    t.check("image prompt logits: CUDA bf16 vs f32", row_rel_err(&la, &lb, vocab), 3.5e-1);
    t.finish("vision tower, CUDA bf16 (error printed, sanity bound)");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_vision.sh"]
fn bad_images_and_embedded_runs_are_errors() {
    let (vc, _) = vision();
    let mut gpu = cuda(Precision::F32);
    assert!(gpu.encode_image(&[0.0; 10], [1, 2, 2]).is_err());
    let e = gpu.encode_image(&vec![0.0; 3 * vc.patch_dim()], [1, 1, 3]).unwrap_err().to_string();
    assert!(e.contains("1x1x3"), "{e}");
    let ok = synthetic(1, [1, 2, 2], vc.patch_dim());
    assert!(gpu.encode_image_batch(&[(ok.as_slice(), [1, 2, 2]), (&ok[..10], [1, 2, 2])]).is_err());
    let table = [0u32];
    let ids = [1u32, 2, 3];
    // A run of the wrong width, and one past the step's tokens.
    let wide = vec![0f32; 2 * (vc.out_hidden_size + 1)];
    let run = EmbeddedRows { first_row: 1, hidden: vc.out_hidden_size + 1, data: &wide };
    assert!(gpu.forward_embedded(&[step(&ids, 0, &table, 1)], &[], &[vec![run]]).is_err());
    let e = vec![0f32; 2 * vc.out_hidden_size];
    let run = EmbeddedRows { first_row: 2, hidden: vc.out_hidden_size, data: &e };
    let err = gpu.forward_embedded(&[step(&ids, 0, &table, 1)], &[], &[vec![run]]).unwrap_err().to_string();
    assert!(err.contains("do not fit"), "{err}");
    // The backend still serves a good step afterwards.
    let run = EmbeddedRows { first_row: 1, hidden: vc.out_hidden_size, data: &e };
    assert!(gpu.forward_embedded(&[step(&ids, 0, &table, 1)], &[], &[vec![run]]).is_ok());
}
