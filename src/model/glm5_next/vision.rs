//! The vision tower of `glm5_next` as a description every backend reads: its config
//! (`vision_config` in `config.json`, with the multimodal token ids beside it) and its weights
//! under `model.visual.` (spec §7), loaded generically over how a device holds a projection.
//!
//! Conv3d patch embedding and the Conv2d 2×2 downsample are loaded as plain projections: with
//! kernel = stride they are linear maps over a flattened patch (`C·T·P·P`, the processor's order)
//! and over a flattened merge window (`hidden · m · m`, channel-major), so no device needs a
//! convolution.

use std::path::Path;

use serde_json::Value;

use super::weights::LinearWeight;
use crate::model::hf;
use crate::model::tensor::to_f32;
use crate::model::{ModelError, WeightSource};

pub const VISION_PREFIX: &str = "model.visual.";

#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub in_channels: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub projection_intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub attention_bias: bool,
    pub swiglu_limit: f32,
    pub rope_theta: f32,
}

/// The token ids that mark images and videos in the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimodalIds {
    /// One per merged patch group; the text model never embeds it (its rows are overwritten).
    pub image_token_id: u32,
    pub video_start_token_id: Option<u32>,
    pub video_end_token_id: Option<u32>,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Width of one flattened patch (`C·T·P·P`).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Placeholder tokens of an image of grid `(t, h, w)`.
    pub fn tokens(&self, grid: [usize; 3]) -> usize {
        grid.iter().product::<usize>() / (self.spatial_merge_size * self.spatial_merge_size)
    }
}

fn bad(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Config { file: path.to_path_buf(), msg: msg.into() }
}

/// The vision config and multimodal ids from an HF `config.json` text, `None` for a model
/// without a vision tower (a flat text config, or no `vision_config`).
pub fn from_hf_json(text: &str, path: &Path) -> Result<Option<(VisionConfig, MultimodalIds)>, ModelError> {
    let root: Value = serde_json::from_str(text).map_err(|e| bad(path, e.to_string()))?;
    let Some(v) = root.get("vision_config").filter(|v| v.is_object()) else { return Ok(None) };
    let Some(image_token_id) = root.get("image_token_id").and_then(Value::as_u64) else {
        return Err(bad(path, "vision_config without image_token_id"));
    };
    let int = |k: &str, d: usize| v.get(k).and_then(Value::as_u64).map_or(d, |x| x as usize);
    let float = |k: &str, d: f64| v.get(k).and_then(Value::as_f64).unwrap_or(d) as f32;
    let rope = v.get("rope_parameters");
    if let Some(kind) = rope.and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
        if kind != "axial" {
            return Err(bad(path, format!("vision rope_type `{kind}` is not supported (only `axial`)")));
        }
    }
    if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(bad(path, format!("vision hidden_act `{act}` is not supported (only `silu`)")));
        }
    }
    let c = VisionConfig {
        depth: int("depth", 24),
        hidden_size: int("hidden_size", 1024),
        num_heads: int("num_heads", 16),
        intermediate_size: int("intermediate_size", 4096),
        patch_size: int("patch_size", 14),
        temporal_patch_size: int("temporal_patch_size", 2),
        in_channels: int("in_channels", 3),
        spatial_merge_size: int("spatial_merge_size", 2),
        out_hidden_size: int("out_hidden_size", 1536),
        projection_intermediate_size: int("projection_intermediate_size", 10240),
        rms_norm_eps: float("rms_norm_eps", 1e-5),
        attention_bias: v.get("attention_bias").and_then(Value::as_bool).unwrap_or(true),
        swiglu_limit: float("swiglu_limit", 10.0),
        rope_theta: rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10000.0) as f32,
    };
    if c.num_heads == 0 || !c.hidden_size.is_multiple_of(c.num_heads) || !c.head_dim().is_multiple_of(4) {
        return Err(bad(path, "vision hidden_size / num_heads must be a whole head dim divisible by 4 (axial RoPE)"));
    }
    if c.in_channels != 3 || c.spatial_merge_size == 0 || c.patch_size == 0 || c.temporal_patch_size == 0 {
        return Err(bad(path, "vision tower needs 3 input channels and positive patch and merge sizes"));
    }
    let tok = |k: &str| root.get(k).and_then(Value::as_u64).map(|x| x as u32);
    let ids = MultimodalIds {
        image_token_id: image_token_id as u32,
        video_start_token_id: tok("video_start_token_id"),
        video_end_token_id: tok("video_end_token_id"),
    };
    Ok(Some((c, ids)))
}

/// `read` [`from_hf_json`] from `dir/config.json`.
pub fn read_vision_config(dir: &Path) -> Result<Option<(VisionConfig, MultimodalIds)>, ModelError> {
    let path = dir.join(hf::CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    from_hf_json(&text, &path)
}

/// The vision config of the checkpoint in `dir` for a text model of width `text_hidden`, when
/// its `config.json` has one: its output width must be the text model's hidden size (the image
/// rows replace token embeddings). Both backends load their tower through this.
pub fn config_for_text(dir: &Path, text_hidden: usize) -> Result<Option<(VisionConfig, MultimodalIds)>, ModelError> {
    if !dir.join(hf::CONFIG_FILE).is_file() {
        return Ok(None);
    }
    let Some((vc, ids)) = read_vision_config(dir)? else { return Ok(None) };
    if vc.out_hidden_size != text_hidden {
        return Err(bad(
            &dir.join(hf::CONFIG_FILE),
            format!(
                "vision out_hidden_size {} must equal the text hidden_size {text_hidden} for image merging",
                vc.out_hidden_size
            ),
        ));
    }
    Ok(Some((vc, ids)))
}

/// Per patch, the (row, column) of its patch in the image grid, in the processor's order (merge
/// windows row-major, the `m × m` patches of a window together), repeated for every frame.
pub fn patch_positions(grid: [usize; 3], m: usize) -> Vec<(usize, usize)> {
    let [t, h, w] = grid;
    let mut pos = Vec::with_capacity(t * h * w);
    for _ in 0..t {
        for bh in 0..h / m {
            for bw in 0..w / m {
                for i in 0..m {
                    for j in 0..m {
                        pos.push((bh * m + i, bw * m + j));
                    }
                }
            }
        }
    }
    pos
}

/// `cos` and `sin` tables `[N, head_dim]` of the axial RoPE at `pos`: the first half of the head
/// rotates by the row (h) then the column (w) angles, the second half repeats the first
/// (rotate-half form).
pub fn rope_tables(c: &VisionConfig, pos: &[(usize, usize)]) -> (Vec<f32>, Vec<f32>) {
    let hd = c.head_dim();
    let spatial = hd / 2;
    let inv: Vec<f32> = (0..spatial).step_by(2).map(|i| 1.0 / c.rope_theta.powf(i as f32 / spatial as f32)).collect();
    let (mut cos, mut sin) = (vec![0f32; pos.len() * hd], vec![0f32; pos.len() * hd]);
    for (n, &(ph, pw)) in pos.iter().enumerate() {
        let angles = inv.iter().map(|&f| ph as f32 * f).chain(inv.iter().map(|&f| pw as f32 * f));
        for (k, a) in angles.enumerate() {
            for half in [0, spatial] {
                cos[n * hd + half + k] = a.cos();
                sin[n * hd + half + k] = a.sin();
            }
        }
    }
    (cos, sin)
}

/// Check that `grid` is whole merge windows and `values` holds its patches.
pub fn check_image(c: &VisionConfig, values: usize, grid: [usize; 3]) -> Result<(), String> {
    let m = c.spatial_merge_size;
    let [t, h, w] = grid;
    let n = t * h * w;
    if n == 0 || h % m != 0 || w % m != 0 {
        return Err(format!("image grid {t}x{h}x{w} is not whole {m}x{m} merge windows"));
    }
    if values != n * c.patch_dim() {
        return Err(format!("image of grid {t}x{h}x{w} has {values} pixel values, expected {}", n * c.patch_dim()));
    }
    Ok(())
}

/// The attention segments of images encoded together (transformers' `cu_seqlens`): one per
/// frame (`h·w` patches; frames and images never attend to each other), as boundaries
/// `[0, n₀, n₀+n₁, …]` over the concatenated patches.
pub fn frame_seqlens(grids: &[[usize; 3]]) -> Vec<usize> {
    let mut cu = vec![0];
    for &[t, h, w] in grids {
        for _ in 0..t {
            cu.push(cu.last().copied().unwrap_or(0) + h * w);
        }
    }
    cu
}

/// A projection with an optional bias.
pub struct Affine<L> {
    pub w: L,
    pub bias: Option<Vec<f32>>,
}

pub struct VisionBlock<L> {
    pub norm1: Vec<f32>,
    pub norm2: Vec<f32>,
    /// `[3·hidden, hidden]`: q rows, k rows, v rows, each head-major.
    pub qkv: Affine<L>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub proj: Affine<L>,
    pub gate: Affine<L>,
    pub up: Affine<L>,
    pub down: Affine<L>,
}

pub struct VisionWeights<L> {
    /// Conv3d as `[hidden, C·T·P·P]`.
    pub patch_embed: Affine<L>,
    pub blocks: Vec<VisionBlock<L>>,
    pub post_norm: Vec<f32>,
    /// Conv2d as `[out, hidden·m·m]` over a merge window laid out channel-major (`c, i, j`).
    pub downsample: Affine<L>,
    pub merger_proj: L,
    pub merger_norm_w: Vec<f32>,
    pub merger_norm_b: Vec<f32>,
    pub merger_gate: L,
    pub merger_up: L,
    pub merger_down: L,
}

/// Load the tower of `c` from `w`; `None` when the checkpoint holds no `model.visual.` tensors
/// (a text-only export of a multimodal config).
pub fn load<L: LinearWeight>(c: &VisionConfig, w: &dyn WeightSource) -> Result<Option<VisionWeights<L>>, ModelError> {
    let p = VISION_PREFIX;
    if w.tensor(&format!("{p}patch_embed.proj.weight")).is_none() {
        return Ok(None);
    }
    let vector = |name: String, len: usize| -> Result<Vec<f32>, ModelError> { Ok(to_f32(&w.expect(&name, &[len])?)) };
    let matrix = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> { Ok(to_f32(&w.expect(name, shape)?)) };
    let affine = |base: String, out: usize, inp: usize, bias: bool| -> Result<Affine<L>, ModelError> {
        Ok(Affine {
            w: L::load(w, &base, out, inp)?,
            bias: if bias { Some(vector(format!("{base}.bias"), out)?) } else { None },
        })
    };
    let (d, m, hd) = (c.hidden_size, c.spatial_merge_size, c.head_dim());
    let (t, ps, ch) = (c.temporal_patch_size, c.patch_size, c.in_channels);
    let embed_name = format!("{p}patch_embed.proj.weight");
    let patch_embed = Affine {
        w: L::from_f32(matrix(&embed_name, &[d, ch, t, ps, ps])?, d, c.patch_dim()),
        bias: Some(vector(format!("{p}patch_embed.proj.bias"), d)?),
    };
    let bias = c.attention_bias;
    let blocks = (0..c.depth)
        .map(|i| {
            let b = format!("{p}blocks.{i}.");
            Ok(VisionBlock {
                norm1: vector(format!("{b}norm1.weight"), d)?,
                norm2: vector(format!("{b}norm2.weight"), d)?,
                qkv: affine(format!("{b}attn.qkv"), 3 * d, d, bias)?,
                q_norm: vector(format!("{b}attn.q_norm.weight"), hd)?,
                k_norm: vector(format!("{b}attn.k_norm.weight"), hd)?,
                proj: affine(format!("{b}attn.proj"), d, d, bias)?,
                gate: affine(format!("{b}mlp.gate_proj"), c.intermediate_size, d, bias)?,
                up: affine(format!("{b}mlp.up_proj"), c.intermediate_size, d, bias)?,
                down: affine(format!("{b}mlp.down_proj"), d, c.intermediate_size, bias)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let out = c.out_hidden_size;
    let down_name = format!("{p}downsample.weight");
    let q = c.projection_intermediate_size;
    Ok(Some(VisionWeights {
        patch_embed,
        blocks,
        post_norm: vector(format!("{p}post_layernorm.weight"), d)?,
        downsample: Affine {
            w: L::from_f32(matrix(&down_name, &[out, d, m, m])?, out, d * m * m),
            bias: Some(vector(format!("{p}downsample.bias"), out)?),
        },
        merger_proj: L::load(w, &format!("{p}merger.proj"), out, out)?,
        merger_norm_w: vector(format!("{p}merger.post_projection_norm.weight"), out)?,
        merger_norm_b: vector(format!("{p}merger.post_projection_norm.bias"), out)?,
        merger_gate: L::load(w, &format!("{p}merger.gate_proj"), q, out)?,
        merger_up: L::load(w, &format!("{p}merger.up_proj"), q, out)?,
        merger_down: L::load(w, &format!("{p}merger.down_proj"), out, q)?,
    }))
}

/// Where images go in a prompt: the runs of `image_token_id` outside video spans
/// (`video_start`…`video_end`), in order, as transformers' `get_placeholder_mask` reads them.
pub fn image_spans(ids: &[u32], mm: &MultimodalIds) -> Vec<std::ops::Range<usize>> {
    let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
    let mut depth = 0i64;
    for (i, &t) in ids.iter().enumerate() {
        if Some(t) == mm.video_start_token_id {
            depth += 1;
        } else if Some(t) == mm.video_end_token_id {
            depth -= 1;
        } else if t == mm.image_token_id && depth <= 0 {
            match spans.last_mut() {
                Some(s) if s.end == i => s.end = i + 1,
                _ => spans.push(i..i + 1),
            }
        }
    }
    spans
}

/// Expand a prompt in which the chat template wrote one placeholder per image into one
/// placeholder per image token (`counts[k]` for image `k`). A prompt whose placeholder runs
/// already have exactly those lengths (pre-expanded ids) comes back unchanged; any other
/// mismatch between placeholders and images is an error that says both numbers.
pub fn expand_placeholders(ids: &[u32], mm: &MultimodalIds, counts: &[usize]) -> Result<Vec<u32>, String> {
    let spans = image_spans(ids, mm);
    if spans.len() != counts.len() {
        return Err(format!("the prompt has {} image placeholders for {} images", spans.len(), counts.len()));
    }
    if spans.iter().zip(counts).all(|(s, &c)| s.len() == c) {
        return Ok(ids.to_vec());
    }
    if let Some((s, c)) = spans.iter().zip(counts).find(|(s, _)| s.len() != 1) {
        return Err(format!(
            "an image placeholder run of {} tokens matches neither one placeholder nor the image's {c} tokens",
            s.len()
        ));
    }
    let mut out = Vec::with_capacity(ids.len() + counts.iter().sum::<usize>());
    let mut at = 0;
    for (s, &c) in spans.iter().zip(counts) {
        out.extend_from_slice(&ids[at..s.start]);
        out.extend(std::iter::repeat_n(mm.image_token_id, c));
        at = s.end;
    }
    out.extend_from_slice(&ids[at..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> VisionConfig {
        VisionConfig {
            depth: 1,
            hidden_size: 16,
            num_heads: 2,
            intermediate_size: 16,
            patch_size: 14,
            temporal_patch_size: 2,
            in_channels: 3,
            spatial_merge_size: 2,
            out_hidden_size: 64,
            projection_intermediate_size: 16,
            rms_norm_eps: 1e-5,
            attention_bias: true,
            swiglu_limit: 10.0,
            rope_theta: 10000.0,
        }
    }

    #[test]
    fn positions_follow_the_processor_patch_order() {
        // A 4x4 grid in 2x2 windows: window (0,0) first, its patches row-major.
        let p = patch_positions([1, 4, 4], 2);
        assert_eq!(&p[..6], &[(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]);
        assert_eq!(p.len(), 16);
        assert_eq!(patch_positions([2, 2, 2], 2).len(), 8);
    }

    #[test]
    fn seqlens_are_one_segment_per_frame() {
        assert_eq!(frame_seqlens(&[[1, 4, 4], [2, 2, 6]]), [0, 16, 28, 40]);
        assert_eq!(frame_seqlens(&[]), [0]);
    }

    #[test]
    fn rope_rotates_rows_then_columns_in_both_halves() {
        let c = tiny();
        let (cos, sin) = rope_tables(&c, &[(0, 0), (1, 2)]);
        let hd = c.head_dim();
        assert!(cos[..hd].iter().all(|&v| v == 1.0) && sin[..hd].iter().all(|&v| v == 0.0));
        // head_dim 8: spatial 4, two frequencies (1, 1/100); row angles then column angles.
        let want = [1.0f32, 0.01, 2.0, 0.02];
        for (k, a) in want.iter().enumerate() {
            assert!((sin[hd + k] - a.sin()).abs() < 1e-6 && (sin[hd + 4 + k] - a.sin()).abs() < 1e-6);
        }
    }

    #[test]
    fn image_shape_checks_name_the_grid() {
        let c = tiny();
        assert!(check_image(&c, 16 * c.patch_dim(), [1, 4, 4]).is_ok());
        assert!(check_image(&c, 3 * c.patch_dim(), [1, 1, 3]).unwrap_err().contains("1x1x3"));
        assert!(check_image(&c, 10, [1, 2, 2]).unwrap_err().contains("pixel values"));
    }
}
