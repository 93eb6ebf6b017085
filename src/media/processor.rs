//! transformers' `Glm5NextImageProcessor` (PIL backend): choose a canvas aligned to
//! `patch_size · merge_size` within the image-token budget, resize the content into it with PIL's
//! bicubic filter keeping the aspect ratio, pad right and bottom with zeros, rescale and
//! normalize, repeat the frame `temporal_patch_size` times and flatten patches into
//! `[h·w, C·T·P·P]` in HF's order (merge blocks row-major, the 2×2 patches of a block together).

use std::path::Path;

use serde::Deserialize;

use super::resample::resize_bicubic;
use super::{MediaError, RgbImage};

/// CLIP's mean and std, the processor's defaults.
/// `(height, width)` in pixels.
pub type HeightWidth = (usize, usize);

pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The processor's settings, as `preprocessor_config.json` names them (missing keys take
/// transformers' defaults).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default)]
pub struct ImageProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub patch_expand_factor: usize,
    pub min_image_tokens: usize,
    pub max_image_tokens: usize,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
}

impl Default for ImageProcessor {
    fn default() -> Self {
        ImageProcessor {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            patch_expand_factor: 1,
            min_image_tokens: 16,
            max_image_tokens: 8000,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
        }
    }
}

/// One image as the vision tower takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessedImage {
    /// `[t·h·w, C·T·P·P]` row-major.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches.
    pub grid: [usize; 3],
}

impl ProcessedImage {
    pub fn patches(&self) -> usize {
        self.grid.iter().product()
    }

    /// Placeholder tokens this image fills in the text (one per merged `merge × merge` group).
    pub fn tokens(&self, merge_size: usize) -> usize {
        self.patches() / (merge_size * merge_size)
    }
}

fn align(v: usize, factor: usize) -> usize {
    v.div_ceil(factor) * factor
}

/// transformers' `smart_resize`: the aligned `(height, width)` canvas for `frames` frames of
/// `height`×`width` pixels with at least `min_tokens` and at most `max_tokens` tokens' worth of
/// pixels (a token is `temporal_factor · factor²` pixels).
pub fn smart_resize(
    frames: usize,
    height: usize,
    width: usize,
    temporal_factor: usize,
    factor: usize,
    min_tokens: usize,
    max_tokens: usize,
) -> Result<(usize, usize), MediaError> {
    let per_token = temporal_factor * factor * factor;
    let (min_pixels, max_pixels) = (min_tokens * per_token, max_tokens * per_token);
    // Python's round() rounds half to even.
    let aligned_frames =
        temporal_factor.max((frames as f64 / temporal_factor as f64).round_ties_even() as usize * temporal_factor);
    let (mut ah, mut aw) = (align(height, factor), align(width, factor));
    if aligned_frames * ah * aw < min_pixels {
        let scale = (min_pixels as f64 / (frames * height * width) as f64).sqrt();
        ah = align(((height as f64 * scale).ceil() as usize).max(1), factor);
        aw = align(((width as f64 * scale).ceil() as usize).max(1), factor);
    }
    if aligned_frames * ah * aw > max_pixels {
        let minimum = aligned_frames * factor * factor;
        if max_pixels < minimum {
            return Err(MediaError::Settings(format!(
                "max_image_tokens = {max_tokens} is too small: one aligned patch needs {minimum} pixels"
            )));
        }
        let (mut low, mut high) = (1usize, height);
        let (mut best_h, mut best_w) = (factor, factor);
        while low <= high {
            let content_h = (low + high) / 2;
            let content_w = ((width as f64 * content_h as f64 / height as f64).floor() as usize).max(1);
            let (ch, cw) = (align(content_h, factor), align(content_w, factor));
            if aligned_frames * ch * cw <= max_pixels {
                (best_h, best_w) = (ch, cw);
                low = content_h + 1;
            } else {
                high = content_h - 1;
            }
        }
        (ah, aw) = (best_h, best_w);
    }
    Ok((ah, aw))
}

impl ImageProcessor {
    /// Settings from `dir/preprocessor_config.json` when it exists, else the defaults.
    pub fn from_dir(dir: &Path) -> Result<Self, MediaError> {
        let path = dir.join("preprocessor_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(MediaError::Settings(format!("{}: {e}", path.display()))),
        }
    }

    pub fn from_json(text: &str) -> Result<Self, MediaError> {
        let p: ImageProcessor =
            serde_json::from_str(text).map_err(|e| MediaError::Settings(format!("preprocessor_config.json: {e}")))?;
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), MediaError> {
        if self.patch_size == 0
            || self.temporal_patch_size == 0
            || self.merge_size == 0
            || self.patch_expand_factor == 0
        {
            return Err(MediaError::Settings("patch, temporal patch, merge sizes must be positive".into()));
        }
        if self.image_std.contains(&0.0) {
            return Err(MediaError::Settings("image_std has a zero".into()));
        }
        Ok(())
    }

    /// Width of one flattened patch: `3 · T · P · P`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Content size and canvas size `((content_h, content_w), (canvas_h, canvas_w))`, as the
    /// processor's `resize` computes them.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(HeightWidth, HeightWidth), MediaError> {
        let factor = self.patch_size * self.merge_size * self.patch_expand_factor;
        let tf = self.temporal_patch_size;
        let (th, tw) = smart_resize(tf, height, width, tf, factor, self.min_image_tokens, self.max_image_tokens)?;
        let mut scale = (th as f64 / height as f64).min(tw as f64 / width as f64);
        if tf * height * width >= tf * factor * factor * self.min_image_tokens {
            scale = scale.min(1.0);
        }
        let ch = ((height as f64 * scale).floor() as usize).min(th).max(1);
        let cw = ((width as f64 * scale).floor() as usize).min(tw).max(1);
        Ok(((ch, cw), (th, tw)))
    }

    /// One image to the tower's input.
    pub fn process(&self, img: &RgbImage) -> Result<ProcessedImage, MediaError> {
        let (h, w) = (img.height as usize, img.width as usize);
        let (content, canvas, pixels) = if self.do_resize {
            let ((ch, cw), canvas) = self.target_size(h, w)?;
            let resized = if (ch, cw) != (h, w) { resize_bicubic(img, cw as u32, ch as u32) } else { img.clone() };
            ((ch, cw), canvas, resized.data)
        } else {
            ((h, w), (h, w), img.data.clone())
        };
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (canvas_h, canvas_w) = canvas;
        if canvas_h % (p * m) != 0 || canvas_w % (p * m) != 0 {
            return Err(MediaError::Settings(format!(
                "a {canvas_h}x{canvas_w} image is not a whole number of {m}x{m} merges of {p}-pixel patches"
            )));
        }
        // Channel planes of the padded canvas: rescale in f64, then normalize in f32 (numpy's
        // dtypes in transformers' `rescale` and `normalize`).
        let mean = self.image_mean.map(|v| v as f32);
        let std = self.image_std.map(|v| v as f32);
        let value = |c: usize, y: usize, x: usize| -> f32 {
            let raw = if y < content.0 && x < content.1 { pixels[(y * content.1 + x) * 3 + c] } else { 0 };
            let mut v = if self.do_rescale { (raw as f64 * self.rescale_factor) as f32 } else { raw as f32 };
            if self.do_normalize {
                v = (v - mean[c]) / std[c];
            }
            v
        };
        let (gh, gw) = (canvas_h / p, canvas_w / p);
        let dim = self.patch_dim();
        let mut out = Vec::with_capacity(gh * gw * dim);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for py in 0..p {
                                    for px in 0..p {
                                        out.push(value(c, y0 + py, x0 + px));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ProcessedImage { pixel_values: out, grid: [1, gh, gw] })
    }
}
