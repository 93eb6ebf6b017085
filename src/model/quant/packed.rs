//! Group-scaled weight formats of quantized safetensors checkpoints, held in memory as the
//! checkpoint stores them (codes of 8 or 4 bits per weight plus their group scales) and
//! multiplied with f32 activations:
//! - FP8 block (`quant_method: fp8`, DeepSeek/GLM): float8_e4m3fn codes, one f32 scale per
//!   128×128 block (kept per row here: a row's 128-column groups share their block's scale);
//! - int4 (compressed-tensors `pack-quantized`, symmetric): codes `q + 8` two per byte (low
//!   nibble first, the little-endian bytes of the int32 words), one scale per group of columns;
//! - NVFP4 (compressed-tensors `nvfp4-pack-quantized`): E2M1 codes two per byte, one E4M3 scale
//!   per 16 columns, divided by a per-tensor global scale.
//!
//! A weight is `code value × group scale`, with the tools' own roundings: FP8 `e4m3 · s`, int4
//! `(q − 8) · s`, NVFP4 `e2m1 · (s₈ / g)` — [`PackedRows::dequantize_row`] gives exactly those
//! f32 values. Activations are not quantized (these formats are weight-only here).
//!
//! The dot of a weight row with an activation row decodes each group to exact small values
//! (FP8 as e4m3 · 2⁻⁸, int4 as q − 8, NVFP4 as 2 · e2m1: all exact in f32) and folds the
//! constant into the group's scale, then reduces in one fixed order that both kernels share:
//! - per group, 8 lanes `p[l] = fma(w[i], x[i], p[l])` over the group's elements `i ≡ l (mod 8)`,
//!   in order;
//! - `acc[l] = fma(scale, p[l], acc[l])` per group;
//! - the result is [`hsum8`](super::hsum8)`(acc)`.
//!
//! Each (weight row, activation row) pair keeps its own accumulators whatever tile it is computed
//! in, so a row's result never depends on the other rows of the batch. `avx2_packed` holds the
//! AVX2 twins; the tests compare them bit for bit.

use std::ops::Range;

use half::f16;

use super::hsum8;

/// Largest group of any format (FP8's 128-column blocks, int4's group 128).
pub const MAX_GROUP: usize = 128;

/// The 16 E2M1 codes as twice their value (sign in bit 3): exact small integers.
pub(super) const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    /// float8_e4m3fn codes, one scale per 128×128 block.
    Fp8Block,
    /// Symmetric int4, one scale per `group` columns (32, 64 or 128).
    Int4 { group: usize },
    /// E2M1 codes, an E4M3 scale per 16 columns and a per-tensor global divisor.
    Nvfp4,
}

impl PackedFormat {
    /// Columns sharing one scale.
    pub fn group(self) -> usize {
        match self {
            PackedFormat::Fp8Block => 128,
            PackedFormat::Int4 { group } => group,
            PackedFormat::Nvfp4 => 16,
        }
    }

    /// Bytes of codes for `cols` weights.
    pub fn code_bytes(self, cols: usize) -> usize {
        match self {
            PackedFormat::Fp8Block => cols,
            _ => cols / 2,
        }
    }

    pub fn name(self) -> String {
        match self {
            PackedFormat::Fp8Block => "FP8 e4m3 (128x128 block scales)".into(),
            PackedFormat::Int4 { group } => format!("int4 (pack-quantized, symmetric, group {group})"),
            PackedFormat::Nvfp4 => "NVFP4 (e2m1, e4m3 scales per 16, global scale)".into(),
        }
    }
}

/// An e4m3fn byte as an f16 bit pattern: the same value times 2⁻⁸ (both formats have 3 mantissa
/// bits; e4m3's bias is 7, f16's 15), exact for every finite code, subnormals included.
#[inline]
pub(super) fn e4m3_as_f16_bits(b: u8) -> u16 {
    ((b as u16 & 0x80) << 8) | ((b as u16 & 0x7F) << 7)
}

/// The value of an e4m3fn byte (the NaN codes 0x7F/0xFF are refused at load).
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    f16::from_bits(e4m3_as_f16_bits(b)).to_f32() * 256.0
}

/// Whether an e4m3fn byte is one of its NaN codes (the format has no infinities).
pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Weight rows of one of the [`PackedFormat`]s.
#[derive(Clone, Debug)]
pub struct PackedRows {
    pub format: PackedFormat,
    pub rows: usize,
    pub cols: usize,
    /// `rows × format.code_bytes(cols)` bytes, row after row.
    pub codes: Vec<u8>,
    /// FP8 and int4: the checkpoint's scale of each (row, group), `rows × groups`.
    pub scales: Vec<f32>,
    /// NVFP4: the E4M3 scale byte of each (row, group), `rows × groups`.
    pub scale_codes: Vec<u8>,
    /// NVFP4: each row's global scale (one per tensor in the checkpoint; per row so that
    /// projections with different global scales can be stacked).
    pub row_global: Vec<f32>,
}

impl PackedRows {
    pub fn groups(&self) -> usize {
        self.cols / self.format.group()
    }

    pub fn row_bytes(&self) -> usize {
        self.format.code_bytes(self.cols)
    }

    /// Bytes held (codes and scales as stored here).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len() + self.scale_codes.len() + 4 * self.row_global.len()
    }

    /// The codes of row `r`.
    pub fn row_codes(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.codes[r * rb..(r + 1) * rb]
    }

    /// The scale each group of row `r` multiplies its decoded codes by (see the module doc):
    /// FP8 `s · 2⁸`, int4 `s`, NVFP4 `(s₈ / g) · ½` — each exactly the tool's scale times a power
    /// of two.
    pub fn kernel_scales(&self, r: usize, out: &mut [f32]) {
        let g = self.groups();
        match self.format {
            PackedFormat::Fp8Block => {
                for (o, &s) in out.iter_mut().zip(&self.scales[r * g..(r + 1) * g]) {
                    *o = s * 256.0;
                }
            }
            PackedFormat::Int4 { .. } => out[..g].copy_from_slice(&self.scales[r * g..(r + 1) * g]),
            PackedFormat::Nvfp4 => {
                let global = self.row_global[r];
                for (o, &b) in out.iter_mut().zip(&self.scale_codes[r * g..(r + 1) * g]) {
                    *o = (e4m3_to_f32(b) / global) * 0.5;
                }
            }
        }
    }

    /// Row `r`'s weights as f32: code value × scale, as the tools' decompression computes it
    /// in f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let group = self.format.group();
        let mut scales = vec![0f32; self.groups()];
        self.kernel_scales(r, &mut scales);
        let codes = self.row_codes(r);
        for (gi, (o, &s)) in out.chunks_exact_mut(group).zip(&scales).enumerate() {
            decode_group(self.format, codes, gi, o);
            for v in o.iter_mut() {
                *v *= s;
            }
        }
    }

    /// Every row as f32, row after row.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }

    /// Only rows `range`.
    pub fn take_rows(&self, range: Range<usize>) -> PackedRows {
        let (rb, g) = (self.row_bytes(), self.groups());
        let per_row = |v: &[f32], n: usize| v.get(range.start * n..range.end * n).map_or(Vec::new(), <[f32]>::to_vec);
        PackedRows {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            codes: self.codes[range.start * rb..range.end * rb].to_vec(),
            scales: per_row(&self.scales, g),
            scale_codes: self.scale_codes.get(range.start * g..range.end * g).map_or(Vec::new(), <[u8]>::to_vec),
            row_global: per_row(&self.row_global, 1),
        }
    }

    /// Only columns `range`, which must start and end on group boundaries (`None` otherwise).
    pub fn take_cols(&self, range: Range<usize>) -> Option<PackedRows> {
        let group = self.format.group();
        if !range.start.is_multiple_of(group) || !range.end.is_multiple_of(group) || range.end > self.cols {
            return None;
        }
        let (g, g0, g1) = (self.groups(), range.start / group, range.end / group);
        let (b0, b1) = (self.format.code_bytes(range.start), self.format.code_bytes(range.end));
        let rb = self.row_bytes();
        let mut out = PackedRows {
            format: self.format,
            rows: self.rows,
            cols: range.len(),
            codes: Vec::with_capacity(self.rows * (b1 - b0)),
            scales: Vec::new(),
            scale_codes: Vec::new(),
            row_global: self.row_global.clone(),
        };
        for r in 0..self.rows {
            out.codes.extend_from_slice(&self.codes[r * rb + b0..r * rb + b1]);
            if !self.scales.is_empty() {
                out.scales.extend_from_slice(&self.scales[r * g + g0..r * g + g1]);
            }
            if !self.scale_codes.is_empty() {
                out.scale_codes.extend_from_slice(&self.scale_codes[r * g + g0..r * g + g1]);
            }
        }
        Some(out)
    }

    /// Stack parts with the same format and columns (`Err` gives them back otherwise).
    pub fn concat(parts: Vec<PackedRows>) -> Result<PackedRows, Vec<PackedRows>> {
        if parts.is_empty() || parts.windows(2).any(|p| p[0].format != p[1].format || p[0].cols != p[1].cols) {
            return Err(parts);
        }
        let mut out = PackedRows {
            format: parts[0].format,
            rows: 0,
            cols: parts[0].cols,
            codes: Vec::new(),
            scales: Vec::new(),
            scale_codes: Vec::new(),
            row_global: Vec::new(),
        };
        for p in parts {
            out.rows += p.rows;
            out.codes.extend(p.codes);
            out.scales.extend(p.scales);
            out.scale_codes.extend(p.scale_codes);
            out.row_global.extend(p.row_global);
        }
        Ok(out)
    }
}

/// Decode group `g` of a row's codes to the kernels' exact values (see the module doc).
pub(super) fn decode_group(format: PackedFormat, codes: &[u8], g: usize, out: &mut [f32]) {
    let group = format.group();
    let start = g * group;
    let nibble = |i: usize| {
        let b = codes[i / 2];
        if i.is_multiple_of(2) {
            b & 0x0F
        } else {
            b >> 4
        }
    };
    match format {
        PackedFormat::Fp8Block => {
            for (o, &b) in out[..group].iter_mut().zip(&codes[start..start + group]) {
                *o = f16::from_bits(e4m3_as_f16_bits(b)).to_f32();
            }
        }
        PackedFormat::Int4 { .. } => {
            for (i, o) in out[..group].iter_mut().enumerate() {
                *o = (nibble(start + i) as i32 - 8) as f32;
            }
        }
        PackedFormat::Nvfp4 => {
            for (i, o) in out[..group].iter_mut().enumerate() {
                *o = E2M1_X2[nibble(start + i) as usize] as f32;
            }
        }
    }
}

/// The portable dot of one row (its codes and kernel scales) with one activation row `x`.
pub(super) fn dot_scalar(format: PackedFormat, codes: &[u8], scales: &[f32], x: &[f32]) -> f32 {
    let group = format.group();
    let mut w = [0f32; MAX_GROUP];
    let mut acc = [0f32; 8];
    for (g, (&s, xg)) in scales.iter().zip(x.chunks_exact(group)).enumerate() {
        decode_group(format, codes, g, &mut w);
        let mut p = [0f32; 8];
        for (wc, xc) in w[..group].chunks_exact(8).zip(xg.chunks_exact(8)) {
            for l in 0..8 {
                p[l] = wc[l].mul_add(xc[l], p[l]);
            }
        }
        for l in 0..8 {
            acc[l] = s.mul_add(p[l], acc[l]);
        }
    }
    hsum8(&acc)
}

/// `out[(r − rows.start) · stride + j]` = weight row `r` · activation row `j`, for the rows in
/// `rows` and every activation row in `xs` (rows of `w.cols`, one after another). Bit-identical
/// to computing each pair alone, with or without `simd`.
pub fn dot_packed_block(w: &PackedRows, rows: Range<usize>, xs: &[f32], out: &mut [f32], stride: usize, simd: bool) {
    let cols = w.cols;
    if cols == 0 || xs.is_empty() || rows.is_empty() {
        return;
    }
    let n = xs.len() / cols;
    assert!(
        n * cols == xs.len() && n <= stride && rows.end <= w.rows && out.len() >= (rows.len() - 1) * stride + n,
        "dot_packed_block: {} inputs of {cols}, {} outputs (stride {stride}), rows {rows:?} of {}",
        xs.len(),
        out.len(),
        w.rows
    );
    let mut scales = vec![0f32; w.groups()];
    for (i, r) in rows.enumerate() {
        w.kernel_scales(r, &mut scales);
        let codes = w.row_codes(r);
        let orow = &mut out[i * stride..i * stride + n];
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true when AVX2, FMA and F16C were detected at runtime; the
            // sizes were checked above.
            unsafe { super::avx2_packed::dot_row(w.format, codes, &scales, xs, cols, orow) };
            continue;
        }
        let _ = simd;
        for (x, o) in xs.chunks_exact(cols).zip(orow.iter_mut()) {
            *o = dot_scalar(w.format, codes, &scales, x);
        }
    }
}

/// Pack f32 weights `[rows, cols]` into `format` by round-to-nearest with max-abs scales: for
/// tests and synthetic weights only (checkpoints come from the real tools).
pub fn quantize_rows(format: PackedFormat, rows: usize, cols: usize, x: &[f32]) -> PackedRows {
    let group = format.group();
    let mut p = PackedRows {
        format,
        rows,
        cols,
        codes: Vec::with_capacity(rows * format.code_bytes(cols)),
        scales: Vec::new(),
        scale_codes: Vec::new(),
        row_global: Vec::new(),
    };
    let nearest = |table: &dyn Fn(u8) -> f32, v: f32, codes: u8| {
        (0..codes).min_by(|&a, &b| (table(a) - v).abs().total_cmp(&(table(b) - v).abs())).unwrap_or(0)
    };
    let fp8_value = |c: u8| if e4m3_is_nan(c) { f32::INFINITY } else { e4m3_to_f32(c) };
    let mut nibbles = Vec::with_capacity(cols);
    for row in x.chunks_exact(cols) {
        nibbles.clear();
        let global = 448.0 * 6.0 / row.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
        if format == PackedFormat::Nvfp4 {
            p.row_global.push(global);
        }
        for xs in row.chunks_exact(group) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            match format {
                PackedFormat::Fp8Block => {
                    let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                    p.scales.push(s);
                    p.codes.extend(xs.iter().map(|&v| nearest(&fp8_value, v / s, 255)));
                }
                PackedFormat::Int4 { .. } => {
                    // As compressed-tensors: the largest magnitude maps to 7.5 steps.
                    let s = if amax > 0.0 { amax / 7.5 } else { 1.0 };
                    p.scales.push(s);
                    nibbles.extend(xs.iter().map(|&v| ((v / s).round().clamp(-8.0, 7.0) as i32 + 8) as u8));
                }
                PackedFormat::Nvfp4 => {
                    let sc = nearest(&fp8_value, amax / 6.0 * global, 0x7F);
                    p.scale_codes.push(sc);
                    let s = e4m3_to_f32(sc) / global;
                    let s = if s > 0.0 { s } else { 1.0 };
                    nibbles.extend(xs.iter().map(|&v| nearest(&|c| E2M1_X2[c as usize] as f32 / 2.0, v / s, 16)));
                }
            }
        }
        p.codes.extend(nibbles.chunks_exact(2).map(|c| c[0] | (c[1] << 4)));
    }
    p
}
