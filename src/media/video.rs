//! transformers' `Glm5NextVideoProcessor` (torchvision backend) and the prompt text
//! `Glm5NextProcessor` writes for a video: frame sampling by time, one canvas for the whole video
//! under its spatio-temporal token budget, torch's uint8 antialiased bicubic resize, fused
//! rescale-and-normalize in f32, the last frame repeated up to the temporal patch, and patches
//! flattened frame pair by frame pair into `[t·h·w, C·T·P·P]` with `video_grid_thw = (t, h, w)`.
//!
//! The vision tower encodes a video of grid `(t, h, w)` exactly as `t` images of grid `(1, h, w)`
//! (`get_video_features` flattens the grid so), and the text gives each frame pair its own run of
//! placeholders between `<|begin_of_image|>` and `<|end_of_image|>`, followed by its timestamp:
//! [`ProcessedVideo::frames`] splits a video into those `t` images.

use std::path::Path;

use serde::Deserialize;

use super::processor::{smart_resize, HeightWidth, CLIP_MEAN, CLIP_STD};
use super::resample::{resize_bicubic_as, Flavour};
use super::{MediaError, ProcessedImage, RgbImage};

/// The processor's settings, as `video_preprocessor_config.json` names them (missing keys take
/// transformers' defaults, which differ from the image processor's in the token budget).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default)]
pub struct VideoProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub patch_expand_factor: usize,
    pub min_image_tokens: usize,
    pub max_image_tokens: usize,
    /// Frames sampled per second of a decoded video.
    pub fps: f64,
    /// Most frames sampled from one decoded video.
    pub max_frames: usize,
    /// Seconds of a decoded video that are sampled; 0 samples all of it.
    pub max_duration: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
}

impl Default for VideoProcessor {
    fn default() -> Self {
        VideoProcessor {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            patch_expand_factor: 1,
            min_image_tokens: 16,
            max_image_tokens: 240_000,
            fps: 2.0,
            max_frames: 2048,
            max_duration: 0.0,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
        }
    }
}

/// One video as the vision tower takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessedVideo {
    /// `[t·h·w, C·T·P·P]` row-major, frame pair after frame pair.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches: `t` frame pairs.
    pub grid: [usize; 3],
}

impl ProcessedVideo {
    /// The `t` frame pairs as images of grid `(1, h, w)`, in order.
    pub fn frames(&self) -> Vec<ProcessedImage> {
        let [t, h, w] = self.grid;
        let per = self.pixel_values.len() / t.max(1);
        (0..t)
            .map(|k| ProcessedImage {
                pixel_values: self.pixel_values[k * per..(k + 1) * per].to_vec(),
                grid: [1, h, w],
            })
            .collect()
    }
}

/// `sample_frames`' inputs: what the container says about a decoded video.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VideoMeta {
    pub total_frames: usize,
    /// Frames per second of the container.
    pub fps: f64,
    /// Seconds, when the container knows them.
    pub duration: Option<f64>,
}

/// numpy's `linspace(start, end, n, dtype=int)`: evenly spaced in f64, truncated toward zero.
fn linspace_int(start: usize, end: usize, n: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    if n == 1 {
        return vec![start];
    }
    let step = (end as f64 - start as f64) / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { end } else { (start as f64 + i as f64 * step) as usize }).collect()
}

impl VideoProcessor {
    /// Settings from `dir/video_preprocessor_config.json` when it exists, else the defaults.
    pub fn from_dir(dir: &Path) -> Result<Self, MediaError> {
        let path = dir.join("video_preprocessor_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(MediaError::Settings(format!("{}: {e}", path.display()))),
        }
    }

    pub fn from_json(text: &str) -> Result<Self, MediaError> {
        let p: VideoProcessor = serde_json::from_str(text)
            .map_err(|e| MediaError::Settings(format!("video_preprocessor_config.json: {e}")))?;
        if p.patch_size == 0 || p.temporal_patch_size == 0 || p.merge_size == 0 || p.patch_expand_factor == 0 {
            return Err(MediaError::Settings("patch, temporal patch, merge sizes must be positive".into()));
        }
        if p.image_std.contains(&0.0) || p.fps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(MediaError::Settings("image_std has a zero or fps is not positive".into()));
        }
        Ok(p)
    }

    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// transformers' `sample_frames`: which frames of a decoded video go to the model, at `fps`
    /// frames per second (the processor's own when `None`), at most `max_frames`, an even count.
    pub fn sample_frames(&self, meta: VideoMeta, fps: Option<f64>) -> Vec<usize> {
        let total = meta.total_frames;
        let max_idx = total.saturating_sub(1);
        let duration = match meta.duration {
            Some(d) if d != 0.0 => d,
            _ => (max_idx as f64 / meta.fps).round_ties_even() + 1.0,
        };
        let max_seconds = duration.trunc();
        let duration = if self.max_duration <= 0.0 { duration } else { duration.min(self.max_duration) };
        let target = fps.unwrap_or(self.fps);
        let extract = ((duration * target) as usize).min(self.max_frames);
        let mut idx: Vec<usize> = Vec::new();
        if total < extract {
            idx = linspace_int(0, max_idx, extract);
        } else {
            let (mut current, inv) = (0f64, 1.0 / target);
            let per_frame = 1.0 / meta.fps;
            for i in 0..total {
                if i as f64 * per_frame >= current {
                    current += inv;
                    idx.push(i);
                    if current >= max_seconds {
                        break;
                    }
                }
            }
        }
        if idx.len() < extract {
            let (a, b) = match (idx.first(), idx.last()) {
                (Some(&a), Some(&b)) => (a, b),
                _ => (0, max_idx),
            };
            idx = linspace_int(a, b, extract);
        } else if idx.len() > extract {
            idx = linspace_int(0, max_idx, extract);
        }
        let mut seen = std::collections::HashSet::new();
        idx.retain(|i| seen.insert(*i));
        if idx.len() % 2 == 1 {
            idx.push(*idx.last().expect("odd length is at least one"));
        }
        idx
    }

    /// The `(height, width)` canvas and content size of `frames` frames of `height`×`width`.
    pub fn target_size(
        &self,
        frames: usize,
        height: usize,
        width: usize,
    ) -> Result<(HeightWidth, HeightWidth), MediaError> {
        let factor = self.patch_size * self.merge_size * self.patch_expand_factor;
        let tf = self.temporal_patch_size;
        let (th, tw) = smart_resize(frames, height, width, tf, factor, self.min_image_tokens, self.max_image_tokens)?;
        let mut scale = (th as f64 / height as f64).min(tw as f64 / width as f64);
        if frames * height * width >= tf * factor * factor * self.min_image_tokens {
            scale = scale.min(1.0);
        }
        let ch = ((height as f64 * scale).floor() as usize).min(th).max(1);
        let cw = ((width as f64 * scale).floor() as usize).min(tw).max(1);
        Ok(((ch, cw), (th, tw)))
    }

    /// Frames (already sampled, all of one size) to the tower's input.
    pub fn process(&self, frames: &[RgbImage]) -> Result<ProcessedVideo, MediaError> {
        let Some(first) = frames.first() else { return Err(MediaError::Refused("the video has no frames".into())) };
        let (h, w) = (first.height as usize, first.width as usize);
        if let Some((k, f)) =
            frames.iter().enumerate().find(|(_, f)| (f.height, f.width) != (first.height, first.width))
        {
            return Err(MediaError::Refused(format!(
                "frame {k} is {}x{} pixels but frame 0 is {}x{}: all frames of a video must have one size",
                f.width, f.height, first.width, first.height
            )));
        }
        let ((ch, cw), (canvas_h, canvas_w)) =
            if self.do_resize { self.target_size(frames.len(), h, w)? } else { ((h, w), (h, w)) };
        let resized: Vec<std::borrow::Cow<'_, [u8]>> = frames
            .iter()
            .map(|f| {
                if (ch, cw) != (h, w) {
                    resize_bicubic_as(f, cw as u32, ch as u32, Flavour::TorchUint8).data.into()
                } else {
                    f.data.as_slice().into()
                }
            })
            .collect();
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        if canvas_h % (p * m) != 0 || canvas_w % (p * m) != 0 {
            return Err(MediaError::Settings(format!(
                "a {canvas_h}x{canvas_w} video is not a whole number of {m}x{m} merges of {p}-pixel patches"
            )));
        }
        // torchvision's fused rescale + normalize: mean and std scaled by 1/rescale_factor in f32,
        // then (x − mean) / std on the f32 pixel.
        let inv = (1.0 / self.rescale_factor) as f32;
        let mean = self.image_mean.map(|v| v as f32 * inv);
        let std = self.image_std.map(|v| v as f32 * inv);
        let rescale = self.rescale_factor as f32;
        let value = |f: usize, c: usize, y: usize, x: usize| -> f32 {
            let raw = if y < ch && x < cw { resized[f][(y * cw + x) * 3 + c] as f32 } else { 0.0 };
            match (self.do_rescale, self.do_normalize) {
                (_, true) if self.do_rescale => (raw - mean[c]) / std[c],
                (false, true) => (raw - self.image_mean[c] as f32) / self.image_std[c] as f32,
                (true, false) => raw * rescale,
                _ => raw,
            }
        };
        let n = frames.len().div_ceil(t) * t;
        let grid_t = n / t;
        let (gh, gw) = (canvas_h / p, canvas_w / p);
        let mut out = Vec::with_capacity(grid_t * gh * gw * self.patch_dim());
        for gt in 0..grid_t {
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for mh in 0..m {
                        for mw in 0..m {
                            let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                            for c in 0..3 {
                                for dt in 0..t {
                                    // The last frame repeats up to a whole temporal patch.
                                    let f = (gt * t + dt).min(frames.len() - 1);
                                    for py in 0..p {
                                        for px in 0..p {
                                            out.push(value(f, c, y0 + py, x0 + px));
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ProcessedVideo { pixel_values: out, grid: [grid_t, gh, gw] })
    }
}

/// The timestamp text of each of a video's `grid_t` frame pairs, as `Glm5NextProcessor` writes it
/// after the pair's `<|end_of_image|>`: the time of the pair's first frame (`frame index / fps`)
/// with one decimal, then ` seconds`; pairs past the known frames repeat the last time.
pub fn frame_labels(frame_indices: &[usize], fps: f64, grid_t: usize) -> Vec<String> {
    let mut times: Vec<f64> = frame_indices.iter().step_by(2).take(grid_t).map(|&i| i as f64 / fps).collect();
    while times.len() < grid_t {
        times.push(times.last().copied().unwrap_or(0.0));
    }
    times.into_iter().map(|s| format!("{s:.1} seconds")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_truncates_like_numpy() {
        assert_eq!(linspace_int(0, 9, 4), vec![0, 3, 6, 9]);
        assert_eq!(linspace_int(0, 0, 2), vec![0, 0]);
        assert_eq!(linspace_int(3, 10, 1), vec![3]);
    }

    #[test]
    fn frame_pairs_split_into_images_and_labels_repeat_the_last_time() {
        let v = ProcessedVideo { pixel_values: (0..24).map(|v| v as f32).collect(), grid: [3, 2, 2] };
        let f = v.frames();
        assert_eq!(f.len(), 3);
        assert_eq!(f[1].grid, [1, 2, 2]);
        assert_eq!(f[1].pixel_values, (8..16).map(|v| v as f32).collect::<Vec<_>>());
        assert_eq!(frame_labels(&[0, 1, 2], 2.0, 3), vec!["0.0 seconds", "1.0 seconds", "1.0 seconds"]);
        assert_eq!(frame_labels(&[0, 1, 2, 3], 3.0, 2), vec!["0.0 seconds", "0.7 seconds"]);
    }

    #[test]
    fn frames_of_different_sizes_are_refused() {
        let a = RgbImage::new(2, 2, vec![0; 12]);
        let b = RgbImage::new(3, 2, vec![0; 18]);
        let err = VideoProcessor::default().process(&[a, b]).unwrap_err();
        assert!(err.to_string().contains("one size"), "{err}");
    }
}
