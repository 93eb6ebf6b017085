//! Comparing two models' logits position by position: KL divergence, max logit difference and
//! top-1 agreement — the fidelity ruler for quantization and backend changes (`shelfserve kld`,
//! golden tests).

use std::io::Write;
use std::path::Path;

/// Summary of how far `ours` is from `reference` over some positions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FidelityReport {
    pub positions: usize,
    /// Mean and max over positions of KL(reference ‖ ours), in nats.
    pub mean_kld: f64,
    pub max_kld: f64,
    pub max_abs_logit_diff: f32,
    /// Largest |a−b| / max(|a|, |b|, 1): a scale-free error measure for golden tests.
    pub max_rel_logit_err: f32,
    /// Fraction of positions whose argmax agrees.
    pub top1_agreement: f64,
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Compare row-major `[n, vocab]` logits.
pub fn compare(reference: &[f32], ours: &[f32], vocab: usize) -> FidelityReport {
    assert_eq!(reference.len(), ours.len(), "logit tensors differ in size");
    let n = reference.len() / vocab.max(1);
    let mut r = FidelityReport { positions: n, ..Default::default() };
    let mut agree = 0usize;
    for (a, b) in reference.chunks_exact(vocab).zip(ours.chunks_exact(vocab)) {
        let (la, lb) = (log_softmax(a), log_softmax(b));
        let kl: f64 = la.iter().zip(&lb).map(|(&p, &q)| p.exp() * (p - q)).sum();
        r.mean_kld += kl;
        r.max_kld = r.max_kld.max(kl);
        for (&x, &y) in a.iter().zip(b) {
            let d = (x - y).abs();
            r.max_abs_logit_diff = r.max_abs_logit_diff.max(d);
            r.max_rel_logit_err = r.max_rel_logit_err.max(d / x.abs().max(y.abs()).max(1.0));
        }
        agree += usize::from(argmax(a) == argmax(b));
    }
    if n > 0 {
        r.mean_kld /= n as f64;
        r.top1_agreement = agree as f64 / n as f64;
    }
    r
}

/// Largest per-position relative L2 error ‖a − b‖ / ‖a‖ of row-major `[n, vocab]` logits, `a`
/// the reference. The measure for bf16 modes: an elementwise maximum over thousands of logits per
/// position mostly measures bf16's 2⁻⁹ rounding of the largest ones. An all-zero reference row
/// counts with a norm of 1e-15 rather than dividing by zero.
pub fn max_rel_l2_err(reference: &[f32], ours: &[f32], vocab: usize) -> f32 {
    assert_eq!(reference.len(), ours.len(), "logit tensors differ in size");
    reference
        .chunks_exact(vocab)
        .zip(ours.chunks_exact(vocab))
        .map(|(a, b)| {
            let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let n: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
            (d / n.max(1e-30)).sqrt() as f32
        })
        .fold(0.0, f32::max)
}

impl FidelityReport {
    pub fn print(&self, mut out: impl Write) -> std::io::Result<()> {
        writeln!(out, "positions           {}", self.positions)?;
        writeln!(out, "mean KL divergence  {:.6e}", self.mean_kld)?;
        writeln!(out, "max KL divergence   {:.6e}", self.max_kld)?;
        writeln!(out, "max |Δlogit|        {:.6e}", self.max_abs_logit_diff)?;
        writeln!(out, "max relative error  {:.6e}", self.max_rel_logit_err)?;
        writeln!(out, "top-1 agreement     {:.4}", self.top1_agreement)
    }
}

/// Errors reading or writing logits files.
#[derive(Debug, thiserror::Error)]
pub enum LogitsFileError {
    #[error("{}: {msg}", path.display())]
    Invalid { path: std::path::PathBuf, msg: String },
}

/// Token ids and logits (`[n, vocab]`) as `score` writes them.
#[derive(Debug)]
pub struct LogitsFile {
    pub input_ids: Vec<u32>,
    pub vocab: usize,
    pub logits: Vec<f32>,
}

impl LogitsFile {
    pub fn write(&self, path: &Path) -> Result<(), LogitsFileError> {
        use safetensors::tensor::{Dtype, TensorView};
        let bad = |msg: String| LogitsFileError::Invalid { path: path.to_path_buf(), msg };
        let ids: Vec<u8> = self.input_ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect();
        let logits: Vec<u8> = self.logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        let n = self.input_ids.len();
        let tensors = vec![
            ("input_ids", TensorView::new(Dtype::I64, vec![n], &ids).map_err(|e| bad(e.to_string()))?),
            ("logits", TensorView::new(Dtype::F32, vec![n, self.vocab], &logits).map_err(|e| bad(e.to_string()))?),
        ];
        safetensors::serialize_to_file(tensors, None, path).map_err(|e| bad(e.to_string()))
    }

    /// Read `input_ids` (any integer type) and `logits` (f32, f16 or bf16).
    pub fn read(path: &Path) -> Result<Self, LogitsFileError> {
        use safetensors::Dtype;
        let bad = |msg: String| LogitsFileError::Invalid { path: path.to_path_buf(), msg };
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let ids_t = st.tensor("input_ids").map_err(|_| bad("no tensor `input_ids`".into()))?;
        let input_ids: Vec<u32> = match ids_t.dtype() {
            Dtype::I64 => ids_t
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()) as u32)
                .collect(),
            Dtype::I32 => ids_t
                .data()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()) as u32)
                .collect(),
            Dtype::U32 => {
                ids_t.data().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap_or_default())).collect()
            }
            d => return Err(bad(format!("`input_ids` has dtype {d:?}, expected an integer type"))),
        };
        let lt = st.tensor("logits").map_err(|_| bad("no tensor `logits`".into()))?;
        let shape = lt.shape().to_vec();
        if shape.len() != 2 || shape[0] != input_ids.len() {
            return Err(bad(format!("`logits` has shape {shape:?}, expected [{}, vocab]", input_ids.len())));
        }
        let dtype = match lt.dtype() {
            Dtype::F32 => crate::model::DType::F32,
            Dtype::F16 => crate::model::DType::F16,
            Dtype::BF16 => crate::model::DType::BF16,
            d => return Err(bad(format!("`logits` has dtype {d:?}, expected f32, f16 or bf16"))),
        };
        let mut logits = vec![0f32; shape[0] * shape[1]];
        crate::model::quant::dequantize_into(dtype, lt.data(), &mut logits);
        Ok(LogitsFile { input_ids, vocab: shape[1], logits })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_logits_have_zero_divergence_and_shifted_ones_do_not() {
        let a = vec![1.0, 2.0, 3.0, 0.5, 0.1, -1.0];
        let r = compare(&a, &a, 3);
        assert_eq!(r.positions, 2);
        assert_eq!(r.mean_kld, 0.0);
        assert_eq!(r.top1_agreement, 1.0);
        // A constant shift leaves the distribution unchanged.
        let shifted: Vec<f32> = a.iter().map(|v| v + 5.0).collect();
        assert!(compare(&a, &shifted, 3).max_kld < 1e-12);
        let b = vec![3.0, 2.0, 1.0, 0.5, 0.1, -1.0];
        let r = compare(&a, &b, 3);
        assert!(r.max_kld > 0.1);
        assert_eq!(r.top1_agreement, 0.5);
        assert_eq!(r.max_abs_logit_diff, 2.0);
    }

    #[test]
    fn relative_l2_error_is_the_worst_rows_norm_ratio() {
        // Row 0: ‖(0, 0.5)‖ / ‖(3, 4)‖ = 0.5 / 5 = 0.1; row 1: ‖(1, 0)‖ / ‖(0, 2)‖ = 0.5.
        let reference = [3.0, 4.0, 0.0, 2.0];
        let ours = [3.0, 4.5, 1.0, 2.0];
        assert!((max_rel_l2_err(&reference, &ours, 2) - 0.5).abs() < 1e-7);
        assert!((max_rel_l2_err(&reference[..2], &ours[..2], 2) - 0.1).abs() < 1e-7);
        assert_eq!(max_rel_l2_err(&reference, &reference, 2), 0.0);
        // Scale-free: both sides ×1000 give the same error.
        let big = |v: &[f32]| v.iter().map(|x| x * 1000.0).collect::<Vec<_>>();
        assert!((max_rel_l2_err(&big(&reference), &big(&ours), 2) - 0.5).abs() < 1e-6);
    }

    #[test]
    fn logits_file_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l.safetensors");
        let f = LogitsFile { input_ids: vec![1, 2], vocab: 3, logits: vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0] };
        f.write(&p).unwrap();
        let g = LogitsFile::read(&p).unwrap();
        assert_eq!(g.input_ids, f.input_ids);
        assert_eq!(g.logits, f.logits);
        std::fs::write(&p, b"junk").unwrap();
        assert!(LogitsFile::read(&p).unwrap_err().to_string().contains("l.safetensors"));
    }
}
