//! Sampling on the device (`cuda/sampling.cu::sample_rows`): packs each sampled row's parameters
//! and penalty history into flat words, launches one block per row over the logits the forward
//! pass left on the device, and reads back only ids and (when asked) logprobs. The draw is the
//! host pipeline's (`crate::sampling`), op for op where the host computes in f32; the uniform is
//! the host's `uniform(seed, step)`, computed here and passed in. Owns its own device buffers;
//! never touches the forward pass's scratch (so captured decode graphs stay valid) nor any policy.

use super::gpu::{cfg, DevBuf, Gpu};
use crate::backend::{BackendError, DeviceSampleSpec};
use crate::launch;
use crate::sampling::{uniform, Sampled, MAX_LOGPROBS};

/// Words per row spec; the layout is `S_*` in `cuda/sampling.cu`.
pub const SPEC_WORDS: usize = 20;
/// Threads per row block (`SAMPLE_THREADS` in the kernel).
const SAMPLE_THREADS: u32 = 1024;

const S_ROW: usize = 0;
const S_GREEDY: usize = 1;
const S_TOP_K: usize = 2;
const S_INV_T: usize = 3;
const S_TOP_P: usize = 4;
const S_MIN_P: usize = 5;
const S_REP: usize = 6;
const S_PRESENCE: usize = 7;
const S_FREQUENCY: usize = 8;
const S_UNIFORM: usize = 9;
const S_BIAS_OFF: usize = 10;
const S_BIAS_N: usize = 11;
const S_SEEN_OFF: usize = 12;
const S_SEEN_N: usize = 13;
const S_OUT_OFF: usize = 14;
const S_OUT_N: usize = 15;
const S_LOGPROBS: usize = 16;

/// The rows of one launch as the kernel reads them.
#[derive(Debug, Default, PartialEq)]
pub struct PackedSpecs {
    /// `SPEC_WORDS` per row.
    pub words: Vec<i32>,
    /// Bias pairs, seen ids and output (id, count) pairs of every row, addressed by the offsets in
    /// `words`. Ids outside the vocabulary are left out (the host ignores them too).
    pub history: Vec<i32>,
    /// Top-logprob slots per row (the largest `n` asked for).
    pub max_top: usize,
}

impl PackedSpecs {
    pub fn rows(&self) -> usize {
        self.words.len() / SPEC_WORDS
    }
}

/// Pack `(logits row index, spec)` pairs for a vocabulary of `vocab` ids.
pub fn pack(rows: &[(usize, DeviceSampleSpec<'_>)], vocab: usize) -> Result<PackedSpecs, BackendError> {
    let too_big = |what: &str, n: usize| BackendError::InvalidStep(format!("device sampling: {what} {n} overflows"));
    let word = |n: usize, what: &str| i32::try_from(n).map_err(|_| too_big(what, n));
    let mut out = PackedSpecs::default();
    for &(row, spec) in rows {
        let p = spec.params;
        let mut w = [0i32; SPEC_WORDS];
        let f = |x: f32| x.to_bits() as i32;
        let greedy = p.is_greedy();
        w[S_ROW] = word(row, "logits row")?;
        w[S_GREEDY] = greedy as i32;
        // Off (0) when it keeps the whole vocabulary, as the host's `top_k < len` test.
        w[S_TOP_K] = if p.top_k < vocab { p.top_k as i32 } else { 0 };
        w[S_INV_T] = f(if greedy { 0.0 } else { 1.0 / p.temperature });
        w[S_TOP_P] = f(p.top_p);
        w[S_MIN_P] = f(p.min_p);
        w[S_REP] = f(p.repetition_penalty);
        w[S_PRESENCE] = f(p.presence_penalty);
        w[S_FREQUENCY] = f(p.frequency_penalty);
        w[S_UNIFORM] = f(if greedy { 0.0 } else { uniform(p.seed, spec.step) });
        let in_vocab = |id: u32| (id as usize) < vocab;
        // Bias in list order: an id listed twice gets both, added in that order.
        w[S_BIAS_OFF] = word(out.history.len(), "history offset")?;
        let before = out.history.len();
        for &(id, b) in p.logit_bias.iter().filter(|e| in_vocab(e.0)) {
            out.history.extend([id as i32, f(b)]);
        }
        w[S_BIAS_N] = word((out.history.len() - before) / 2, "bias count")?;
        w[S_SEEN_OFF] = word(out.history.len(), "history offset")?;
        let before = out.history.len();
        if let (Some(h), true) = (spec.penalties, p.repetition_penalty != 1.0) {
            out.history.extend(h.seen_ids().filter(|&id| in_vocab(id)).map(|id| id as i32));
        }
        w[S_SEEN_N] = word(out.history.len() - before, "seen count")?;
        w[S_OUT_OFF] = word(out.history.len(), "history offset")?;
        let before = out.history.len();
        if let (Some(h), true) = (spec.penalties, p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
            for (id, n) in h.output_counts().filter(|e| in_vocab(e.0)) {
                out.history.extend([id as i32, word(n as usize, "output count")?]);
            }
        }
        w[S_OUT_N] = word((out.history.len() - before) / 2, "output count")?;
        w[S_LOGPROBS] = match p.logprobs {
            Some(n) => {
                let n = n.min(MAX_LOGPROBS);
                out.max_top = out.max_top.max(n);
                n as i32
            }
            None => -1,
        };
        out.words.extend_from_slice(&w);
    }
    Ok(out)
}

/// What the kernel wrote for one row, turned into the host sampler's result type.
fn unpack_row(token: i32, logprob: f32, top: &[(i32, f32)], wants_logprobs: Option<usize>) -> Sampled {
    match wants_logprobs {
        None => Sampled { token: token as u32, logprob: f32::NAN, top_logprobs: Vec::new() },
        Some(n) => Sampled {
            token: token as u32,
            logprob,
            top_logprobs: top.iter().take(n).filter(|e| e.0 >= 0).map(|&(id, lp)| (id as u32, lp)).collect(),
        },
    }
}

/// Greedy with nothing that changes the argmax or asks for logprobs: the device argmax alone
/// gives the host pipeline's token.
pub(super) fn is_plain_greedy(spec: &DeviceSampleSpec<'_>) -> bool {
    let p = spec.params;
    p.is_greedy()
        && p.logit_bias.is_empty()
        && p.logprobs.is_none()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
}

/// The greedy draw for an argmax result: a row with no number at all (every logit NaN) has no
/// argmax and gives token 0, as the host sampler does for a row with nothing to choose.
pub fn greedy_pick(id: u32, vocab: usize) -> Sampled {
    Sampled { token: if (id as usize) < vocab { id } else { 0 }, logprob: f32::NAN, top_logprobs: Vec::new() }
}

/// The sampler's device buffers, grown on demand and reused across steps.
#[derive(Default)]
pub struct DeviceSampler {
    work: Option<DevBuf>,
    inputs: Option<DevBuf>,
    outputs: Option<DevBuf>,
}

fn ensure(gpu: &Gpu, buf: &mut Option<DevBuf>, bytes: usize) -> Result<u64, BackendError> {
    if buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
        *buf = None;
        *buf = Some(gpu.alloc(bytes.max(4) + bytes / 8)?);
    }
    Ok(buf.as_ref().map_or(0, DevBuf::ptr))
}

impl DeviceSampler {
    /// A step's tokens from the logits rows it left on the device (`offsets.last()` rows of
    /// `vocab` at `logits`, sequence `i`'s rows `offsets[i]..offsets[i + 1]`): each sequence with a
    /// spec samples its last row. A plain greedy step takes the one-pass argmax, which costs a
    /// fraction of the full pipeline's sweeps over a row and picks the same id (the lowest among
    /// equal maxima, never a NaN); anything else the full pipeline.
    pub fn draw(
        &mut self,
        gpu: &mut Gpu,
        logits: u64,
        vocab: usize,
        offsets: &[usize],
        specs: &[Option<DeviceSampleSpec<'_>>],
    ) -> Result<Vec<Option<Sampled>>, BackendError> {
        let rows: Vec<(usize, DeviceSampleSpec<'_>)> =
            specs.iter().enumerate().filter_map(|(i, s)| s.map(|s| (offsets[i + 1] - 1, s))).collect();
        let drawn = if rows.is_empty() {
            // Nothing to sample: wait for the step so that its errors surface here.
            gpu.sync()?;
            Vec::new()
        } else if rows.iter().all(|(_, s)| is_plain_greedy(s)) {
            let ids = self.argmax(gpu, logits, vocab, offsets.last().copied().unwrap_or(0))?;
            rows.iter().map(|&(row, _)| greedy_pick(ids[row], vocab)).collect()
        } else {
            self.sample(gpu, logits, vocab, &rows)?
        };
        let mut drawn = drawn.into_iter();
        Ok(specs.iter().map(|s| s.and_then(|_| drawn.next())).collect())
    }

    /// The greedy token of each of the `rows` consecutive f32 logits rows at `logits` (`vocab`
    /// per row): the lowest id among equal maxima, never a NaN; one pass over each row.
    pub fn argmax(&mut self, gpu: &mut Gpu, logits: u64, vocab: usize, rows: usize) -> Result<Vec<u32>, BackendError> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let out = ensure(gpu, &mut self.outputs, rows * 4)?;
        let f = gpu.func("sampling", "argmax_rows")?;
        let vocab_i = vocab as i32;
        launch!(gpu, f, cfg((rows as u32, 1), 1024, 0), &logits, &vocab_i, &out)?;
        let mut ids = vec![0i32; rows];
        gpu.copy_dtoh(&mut ids, out)?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }

    /// Sample `rows` (logits row index, spec) from the f32 logits at `logits` (`vocab` per row),
    /// on the device's stream; one result per entry of `rows`, in order.
    pub fn sample(
        &mut self,
        gpu: &mut Gpu,
        logits: u64,
        vocab: usize,
        rows: &[(usize, DeviceSampleSpec<'_>)],
    ) -> Result<Vec<Sampled>, BackendError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let packed = pack(rows, vocab)?;
        let m = packed.rows();
        let mt = packed.max_top;
        let work = ensure(gpu, &mut self.work, m * vocab * 4)?;
        let mut words = packed.words.clone();
        words.extend_from_slice(&packed.history);
        let inputs = ensure(gpu, &mut self.inputs, words.len() * 4)?;
        gpu.copy_htod_in_order(inputs, &words)?;
        let out_words = m * 2 + 2 * m * mt;
        let outputs = ensure(gpu, &mut self.outputs, out_words * 4)?;
        let (specs, history) = (inputs, inputs + 4 * packed.words.len() as u64);
        let (tokens, logprobs) = (outputs, outputs + 4 * m as u64);
        let (top_ids, top_lps) = (outputs + 8 * m as u64, outputs + 4 * (2 * m + m * mt) as u64);
        let (vocab_i, mt_i) = (vocab as i32, mt as i32);
        let f = gpu.func("sampling", "sample_rows")?;
        launch!(
            gpu,
            f,
            cfg((m as u32, 1), SAMPLE_THREADS, 0),
            &logits,
            &vocab_i,
            &work,
            &specs,
            &history,
            &mt_i,
            &tokens,
            &logprobs,
            &top_ids,
            &top_lps
        )?;
        let mut back = vec![0i32; out_words];
        gpu.copy_dtoh(&mut back, outputs)?;
        let lp = |w: i32| f32::from_bits(w as u32);
        Ok(rows
            .iter()
            .enumerate()
            .map(|(i, (_, spec))| {
                let top: Vec<(i32, f32)> =
                    (0..mt).map(|j| (back[2 * m + i * mt + j], lp(back[2 * m + m * mt + i * mt + j]))).collect();
                unpack_row(back[i], lp(back[m + i]), &top, spec.params.logprobs.map(|n| n.min(MAX_LOGPROBS)))
            })
            .collect())
    }
}

/// Sampling on the device without a model: uploads logits rows given by the host and samples
/// them (the GPU tests compare it with the host sampler on random rows of any vocabulary).
pub struct RowSampler {
    gpu: Gpu,
    sampler: DeviceSampler,
    logits: Option<DevBuf>,
}

impl RowSampler {
    pub fn open(ordinal: usize) -> Result<Self, BackendError> {
        let gpu = Gpu::open(ordinal)?;
        Ok(RowSampler { gpu, sampler: DeviceSampler::default(), logits: None })
    }

    /// Sample row `i` of `logits` (`vocab` per row) with `specs[i]`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        vocab: usize,
        specs: &[DeviceSampleSpec<'_>],
    ) -> Result<Vec<Sampled>, BackendError> {
        if vocab == 0 || logits.len() != vocab * specs.len() {
            return Err(BackendError::InvalidStep(format!(
                "{} logits for {} rows of vocabulary {vocab}",
                logits.len(),
                specs.len()
            )));
        }
        self.gpu.bind()?;
        let ptr = ensure(&self.gpu, &mut self.logits, logits.len() * 4)?;
        self.gpu.copy_htod(ptr, logits)?;
        let rows: Vec<(usize, DeviceSampleSpec<'_>)> = specs.iter().copied().enumerate().collect();
        self.sampler.sample(&mut self.gpu, ptr, vocab, &rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{PenaltyState, SamplingParams};

    fn spec<'a>(p: &'a SamplingParams, h: Option<&'a PenaltyState>, step: u64) -> DeviceSampleSpec<'a> {
        DeviceSampleSpec { params: p, penalties: h, step }
    }

    #[test]
    fn packs_knobs_as_bits_and_the_hosts_uniform() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            seed: 77,
            logprobs: Some(3),
            ..Default::default()
        };
        let packed = pack(&[(5, spec(&p, None, 9))], 1000).unwrap();
        let w = &packed.words;
        assert_eq!(w.len(), SPEC_WORDS);
        assert_eq!((w[S_ROW], w[S_GREEDY], w[S_TOP_K], w[S_LOGPROBS]), (5, 0, 40, 3));
        let f = |i: usize| f32::from_bits(w[i] as u32);
        assert_eq!(f(S_INV_T).to_bits(), (1.0f32 / 0.7).to_bits());
        assert_eq!((f(S_TOP_P), f(S_MIN_P), f(S_REP), f(S_PRESENCE), f(S_FREQUENCY)), (0.9, 0.05, 1.3, 0.5, -0.25));
        assert_eq!(f(S_UNIFORM).to_bits(), uniform(77, 9).to_bits());
        assert_eq!(packed.max_top, 3);
        assert!(packed.history.is_empty());
    }

    #[test]
    fn greedy_rows_draw_nothing_and_top_k_over_the_vocabulary_is_off() {
        let p = SamplingParams { top_k: 1000, logprobs: Some(50), ..Default::default() };
        let packed = pack(&[(0, spec(&p, None, 3))], 1000).unwrap();
        let w = &packed.words;
        assert_eq!((w[S_GREEDY], w[S_TOP_K], w[S_INV_T], w[S_UNIFORM]), (1, 0, 0, 0));
        assert_eq!((w[S_LOGPROBS], packed.max_top), (MAX_LOGPROBS as i32, MAX_LOGPROBS), "capped at 20");
        let nan = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert_eq!(pack(&[(0, spec(&nan, None, 0))], 10).unwrap().words[S_GREEDY], 1, "NaN temperature is greedy");
    }

    #[test]
    fn history_keeps_bias_order_and_drops_ids_outside_the_vocabulary() {
        let p = SamplingParams {
            temperature: 1.0,
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            logit_bias: vec![(7, 1.0), (5000, 3.0), (7, -0.5), (2, 100.0)],
            ..Default::default()
        };
        let mut h = PenaltyState::new(&[3, 3, 9, 4000]);
        h.push_output(9);
        h.push_output(9);
        h.push_output(1);
        let plain = SamplingParams::default();
        let packed = pack(&[(0, spec(&plain, None, 0)), (1, spec(&p, Some(&h), 4))], 100).unwrap();
        let w = &packed.words[SPEC_WORDS..];
        let hist = &packed.history;
        let at = |off: usize, n: usize| &hist[w[off] as usize..w[off] as usize + n];
        assert_eq!(w[S_BIAS_N], 3);
        let bias = at(S_BIAS_OFF, 6);
        let pairs: Vec<(i32, f32)> = bias.chunks(2).map(|c| (c[0], f32::from_bits(c[1] as u32))).collect();
        assert_eq!(pairs, vec![(7, 1.0), (7, -0.5), (2, 100.0)]);
        let mut seen = at(S_SEEN_OFF, w[S_SEEN_N] as usize).to_vec();
        seen.sort();
        assert_eq!(seen, vec![1, 3, 9], "distinct prompt + output ids inside the vocabulary");
        let mut out: Vec<(i32, i32)> = at(S_OUT_OFF, 2 * w[S_OUT_N] as usize).chunks(2).map(|c| (c[0], c[1])).collect();
        out.sort();
        assert_eq!(out, vec![(1, 1), (9, 2)]);
        // The first row asked for nothing: no history, no logprobs.
        assert_eq!((packed.words[S_BIAS_N], packed.words[S_SEEN_N], packed.words[S_OUT_N]), (0, 0, 0));
        assert_eq!(packed.words[S_LOGPROBS], -1);
    }

    #[test]
    fn penalties_that_are_off_send_no_history() {
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        let mut h = PenaltyState::new(&[1, 2, 3]);
        h.push_output(4);
        let packed = pack(&[(0, spec(&p, Some(&h), 0))], 10).unwrap();
        assert!(packed.history.is_empty());
    }

    #[test]
    fn unpacking_drops_empty_top_slots_and_unrequested_logprobs() {
        let s = unpack_row(4, -0.5, &[(4, -0.5), (1, -2.0), (-1, 0.0)], Some(3));
        assert_eq!(s, Sampled { token: 4, logprob: -0.5, top_logprobs: vec![(4, -0.5), (1, -2.0)] });
        let s = unpack_row(4, -0.5, &[(4, -0.5)], None);
        assert!(s.logprob.is_nan() && s.top_logprobs.is_empty());
    }
}
