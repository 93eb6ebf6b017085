//! Bicubic resize of 8-bit images, reproduced to the bit in two flavours that share one scheme —
//! a separable filter (Keys cubic, a = −0.5, support 2 scaled by the downscale factor so it
//! antialiases) whose per-output weights are computed in f64, normalised to sum 1, converted to
//! fixed point, and applied with an integer accumulator that starts at one half and is clipped to
//! 0..=255, first along rows (horizontal pass), then along columns:
//!
//! * PIL's `Image.resize(size, BICUBIC)` (the image processor): 22-bit weights;
//! * torch's native uint8 `interpolate(mode="bicubic", antialias=True)` on the CPU, which
//!   torchvision's `resize` runs for uint8 tensors (the video processor): int16 weights at the
//!   largest precision at which the axis's largest weight fits, and torch's own evaluation order
//!   of the filter (`UpSampleKernel.cpp`, `_compute_index_ranges_int16_weights`).

use super::RgbImage;

/// Fixed-point bits of the filter weights (32 − 8 bits of pixel − 2 bits of headroom).
const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// torch's `aa_filter` for bicubic (`cubic_convolution1/2` with a = −0.5), in its term order.
fn bicubic_torch(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// Which library's fixed-point resampler to reproduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    Pil,
    TorchUint8,
}

/// Per output pixel: the first input index and the fixed-point weights of the inputs it reads.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
    precision: u32,
}

/// torch's `_compute_index_ranges_int16_weights` for an antialiased bicubic axis.
fn taps_torch(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let max_interp = support.ceil() as i64 * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut first = Vec::with_capacity(out_size);
    let mut float = Vec::with_capacity(out_size);
    let mut wt_max = 0f64;
    for i in 0..out_size {
        let center = scale * (i as f64 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xsize = (((center + support + 0.5) as i64).min(in_size as i64) - xmin).clamp(0, max_interp);
        let mut k: Vec<f64> =
            (0..xsize).map(|j| bicubic_torch(((j + xmin) as f64 - center + 0.5) * invscale)).collect();
        let total: f64 = k.iter().sum();
        if total != 0.0 {
            for w in k.iter_mut() {
                *w /= total;
                wt_max = wt_max.max(*w);
            }
        }
        first.push(xmin as usize);
        float.push(k);
    }
    let mut precision = 0u32;
    while precision < 22 {
        if (0.5 + wt_max * (1u32 << (precision + 1)) as f64) as i32 >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let weights = float
        .iter()
        .map(|k| {
            k.iter()
                .map(|&w| {
                    let v = w * (1u32 << precision) as f64;
                    // Stored as int16 by torch; every value fits by the choice of precision.
                    (if v < 0.0 { (-0.5 + v) as i32 } else { (0.5 + v) as i32 }) as i16 as i32
                })
                .collect()
        })
        .collect();
    Taps { first, weights, precision }
}

fn taps(in_size: usize, out_size: usize) -> Taps {
    const SUPPORT: f64 = 2.0;
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = SUPPORT * filter_scale;
    let mut first = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // C's `(int)` truncates toward zero; both values are ≥ −0.5 + 0.5 here after the clamp.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut k: Vec<f64> = (0..n).map(|x| bicubic((x as f64 + xmin as f64 - center + 0.5) / filter_scale)).collect();
        let total: f64 = k.iter().sum();
        if total != 0.0 {
            k.iter_mut().for_each(|w| *w /= total);
        }
        let fixed = k
            .iter()
            .map(|&w| {
                let s = w * (1u32 << PRECISION_BITS) as f64;
                if w < 0.0 {
                    (-0.5 + s) as i32
                } else {
                    (0.5 + s) as i32
                }
            })
            .collect();
        first.push(xmin);
        weights.push(fixed);
    }
    Taps { first, weights, precision: PRECISION_BITS }
}

/// `acc >> precision` clipped to 0..=255 (PIL's `clip8`; torch clamps the shifted value the same
/// way).
fn clip8(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// One pass over `img` (`w`×`h` RGB), filtering along x when `horizontal`, else along y.
fn pass(src: &[u8], w: usize, h: usize, out_len: usize, horizontal: bool, flavour: Flavour) -> Vec<u8> {
    let in_len = if horizontal { w } else { h };
    let t = match flavour {
        Flavour::Pil => taps(in_len, out_len),
        Flavour::TorchUint8 => taps_torch(in_len, out_len),
    };
    let (ow, oh) = if horizontal { (out_len, h) } else { (w, out_len) };
    let mut out = vec![0u8; ow * oh * 3];
    for y in 0..oh {
        for x in 0..ow {
            let o = if horizontal { x } else { y };
            let half = if t.precision > 0 { 1i32 << (t.precision - 1) } else { 0 };
            let mut acc = [half; 3];
            for (i, &k) in t.weights[o].iter().enumerate() {
                let p = if horizontal { (y * w + t.first[o] + i) * 3 } else { ((t.first[o] + i) * w + x) * 3 };
                for (a, &v) in acc.iter_mut().zip(&src[p..p + 3]) {
                    *a = a.wrapping_add(v as i32 * k);
                }
            }
            let q = (y * ow + x) * 3;
            for (o, &a) in out[q..q + 3].iter_mut().zip(&acc) {
                *o = clip8(a, t.precision);
            }
        }
    }
    out
}

/// Resize to `width`×`height` with PIL's bicubic filter.
pub fn resize_bicubic(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize_bicubic_as(img, width, height, Flavour::Pil)
}

/// Resize to `width`×`height` with the bicubic filter of `flavour`.
pub fn resize_bicubic_as(img: &RgbImage, width: u32, height: u32, flavour: Flavour) -> RgbImage {
    let (w, h) = (img.width as usize, img.height as usize);
    let (nw, nh) = (width as usize, height as usize);
    let mut data = img.data.clone();
    let mut cur_w = w;
    if nw != w {
        data = pass(&data, w, h, nw, true, flavour);
        cur_w = nw;
    }
    if nh != h {
        data = pass(&data, cur_w, h, nh, false, flavour);
    }
    RgbImage::new(width, height, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_a_constant_image_stays_constant() {
        for (i, o) in [(5, 168), (200, 56), (57, 56), (3, 7)] {
            let t = taps(i, o);
            for k in &t.weights {
                let s: i32 = k.iter().sum();
                assert!((s - (1 << PRECISION_BITS)).abs() <= k.len() as i32, "{i}->{o}: {s}");
            }
        }
        let img = RgbImage::new(7, 5, [90u8, 10, 250].repeat(35));
        let r = resize_bicubic(&img, 13, 3);
        assert!(r.data.chunks(3).all(|p| p == [90, 10, 250]));
    }

    #[test]
    fn same_size_is_identity() {
        let img = RgbImage::new(3, 2, (0..18).map(|v| v as u8 * 13).collect());
        assert_eq!(resize_bicubic(&img, 3, 2), img);
    }
}
