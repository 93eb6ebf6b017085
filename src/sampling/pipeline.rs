//! The sampling pipeline proper: logit adjustments, truncation (top-k / top-p / min-p), the
//! inverse-CDF draw and raw logprobs. Kept apart from `mod.rs` so the public types read on their
//! own; everything here is private to `sampling`.
//!
//! Work is O(vocab) passes over one scratch copy of the logits; nothing sorts the whole vocabulary
//! unless the distribution is so flat that top-p genuinely needs it.

use super::vector::{self, max_ignoring_nan, sum_f64, weight, weights_in_place};
use super::{PenaltyState, SamplingParams};
use std::cmp::Ordering;

/// The kept tokens with unnormalised weights `exp((logit - max) / T)`, so the best token weighs
/// exactly 1.
enum Support {
    /// One weight per vocabulary id, 0 for removed tokens.
    Dense(Vec<f32>),
    /// (id, weight) of the kept tokens, ascending id (the draw order).
    Sparse(Vec<(u32, f32)>),
}

/// What the processing decided for one row.
enum Decision {
    Token(u32),
    Distribution(Support),
}

pub(super) fn choose(logits: &[f32], params: &SamplingParams, state: &PenaltyState, step: u64) -> u32 {
    match decide(logits, params, state) {
        Decision::Token(t) => t,
        Decision::Distribution(support) => draw(&support, super::uniform(params.seed, step)),
    }
}

pub(super) fn processed_probs(logits: &[f32], params: &SamplingParams, state: &PenaltyState) -> Vec<f32> {
    let mut probs = vec![0.0f32; logits.len()];
    match decide(logits, params, state) {
        Decision::Token(t) => {
            if let Some(p) = probs.get_mut(t as usize) {
                *p = 1.0;
            }
        }
        Decision::Distribution(Support::Dense(w)) => {
            // The same summation as `draw`, so probabilities and draws agree to the last bit.
            let total = sum_f64(&w);
            for (p, &x) in probs.iter_mut().zip(&w) {
                *p = (x as f64 / total) as f32;
            }
        }
        Decision::Distribution(Support::Sparse(kept)) => {
            let total: f64 = kept.iter().map(|&(_, x)| x as f64).sum();
            for &(id, x) in &kept {
                probs[id as usize] = (x as f64 / total) as f32;
            }
        }
    }
    probs
}

fn decide(logits: &[f32], params: &SamplingParams, state: &PenaltyState) -> Decision {
    if logits.is_empty() {
        tracing::warn!("sampling an empty logits row; returning token 0");
        return Decision::Token(0);
    }
    if params.is_greedy() && !params.adjusts_logits(state) {
        return Decision::Token(argmax_or_zero(logits));
    }
    let mut work = logits.to_vec();
    adjust(&mut work, params, state);
    let max = max_ignoring_nan(&work);
    if max == f32::NEG_INFINITY {
        // Bias/penalties removed every token (or the row was all NaN / -inf): fall back to what
        // the model itself preferred.
        return Decision::Token(argmax_or_zero(logits));
    }
    if params.is_greedy() {
        return Decision::Token(first_index_of(&work, max));
    }
    // +inf logits are clamped so `x - max` stays finite for the best tokens.
    Decision::Distribution(truncate(work, params, max.min(f32::MAX)))
}

/// Logit bias, then the HF repetition penalty over prompt + output, then OpenAI
/// presence/frequency over output (vLLM's order).
fn adjust(work: &mut [f32], params: &SamplingParams, state: &PenaltyState) {
    for &(id, bias) in &params.logit_bias {
        if let Some(x) = work.get_mut(id as usize) {
            *x += bias;
        }
    }
    let rep = params.repetition_penalty;
    if rep != 1.0 {
        for &id in &state.seen {
            if let Some(x) = work.get_mut(id as usize) {
                // CTRL/HF: shrink positive logits, push negative ones further down.
                *x = if *x > 0.0 { *x / rep } else { *x * rep };
            }
        }
    }
    let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
    if presence != 0.0 || frequency != 0.0 {
        for (&id, &count) in &state.output_counts {
            if let Some(x) = work.get_mut(id as usize) {
                *x -= frequency * count as f32 + presence;
            }
        }
    }
}

/// First index holding `value` (callers pass a value that occurs).
fn first_index_of(xs: &[f32], value: f32) -> u32 {
    xs.iter().position(|&x| x == value).map_or(0, |i| i as u32)
}

/// Index of the largest non-NaN entry, lowest index on ties; 0 when everything is NaN. Two
/// vectorisable passes beat one branchy pass that tracks the index.
fn argmax_or_zero(xs: &[f32]) -> u32 {
    let max = max_ignoring_nan(xs);
    if max == f32::NEG_INFINITY {
        // All -inf (or NaN): the first -inf, as argmax of equal values.
        return xs.iter().position(|&x| x == f32::NEG_INFINITY).map_or(0, |i| i as u32);
    }
    first_index_of(xs, max)
}

/// Descending by value, ascending id on ties: the order top-k and top-p walk. Values are never
/// NaN here; `partial_cmp` (unlike `total_cmp`) also treats -0 and +0 as the tie they are.
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

fn truncate(mut work: Vec<f32>, params: &SamplingParams, max: f32) -> Support {
    let inv_t = 1.0 / params.temperature;
    let top_k_on = params.top_k > 0 && params.top_k < work.len();
    let top_p_on = params.top_p < 1.0;
    let min_p_on = params.min_p > 0.0;

    if !top_k_on && !top_p_on {
        weights_in_place(&mut work, max, inv_t);
        if min_p_on {
            let min_p = params.min_p;
            for w in work.iter_mut() {
                // The best token (weight exactly 1) always survives, whatever min_p says.
                *w = if *w < min_p && *w < 1.0 { 0.0 } else { *w };
            }
        }
        return Support::Dense(work);
    }

    // Candidates as (weight, id), sorted by weight desc then id asc, and the mass top-p is
    // relative to: the top-k set's when top-k is on (HF renormalises over it), else the vocab's.
    let (mut cands, total): (Vec<(f32, u32)>, f64) = if top_k_on {
        let mut c = top_k_logits(&work, params.top_k);
        for e in c.iter_mut() {
            e.0 = weight(e.0, max, inv_t);
        }
        let total = c.iter().map(|e| e.0 as f64).sum();
        (c, total)
    } else {
        weights_in_place(&mut work, max, inv_t);
        let total = sum_f64(&work);
        (nucleus_candidates(&work, total, params.top_p), total)
    };

    if top_p_on {
        let limit = params.top_p as f64 * total;
        // HF/vLLM keep a token iff the mass strictly before it (in desc order) is below top_p.
        let mut cum = 0.0f64;
        let mut keep = 0;
        for &(w, _) in &cands {
            if cum >= limit {
                break;
            }
            cum += w as f64;
            keep += 1;
        }
        cands.truncate(keep.max(1));
    }
    if min_p_on {
        // cands[0] is the best token (weight 1): it always survives.
        let mut first = true;
        cands.retain(|&(w, _)| std::mem::replace(&mut first, false) || w >= params.min_p);
    }
    let mut kept: Vec<(u32, f32)> = cands.into_iter().map(|(w, id)| (id, w)).collect();
    kept.sort_unstable_by_key(|&(id, _)| id);
    Support::Sparse(kept)
}

/// The `k` largest finite logits plus any ties with the k-th (HF and vLLM keep ties), as
/// (logit, id) sorted desc. One pass with a buffer compacted by partial selection, so the cost is
/// O(vocab) and the memory O(k).
fn top_k_logits(logits: &[f32], k: usize) -> Vec<(f32, u32)> {
    let mut buf: Vec<(f32, u32)> = Vec::with_capacity(2 * k + 1);
    let mut threshold = f32::NEG_INFINITY;
    let mut compact_at = 2 * k;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() || x < threshold || x == f32::NEG_INFINITY {
            continue;
        }
        buf.push((x, i as u32));
        if buf.len() >= compact_at {
            threshold = compact_top_k(&mut buf, k);
            // Ties at the threshold survive compaction; growing the trigger keeps it amortised
            // even when most of the vocabulary ties.
            compact_at = (2 * buf.len()).max(2 * k);
        }
    }
    if buf.len() > k {
        compact_top_k(&mut buf, k);
    }
    buf.sort_unstable_by(desc);
    buf
}

/// Keeps the k best of `buf` plus ties with the k-th; returns the k-th value.
fn compact_top_k(buf: &mut Vec<(f32, u32)>, k: usize) -> f32 {
    buf.select_nth_unstable_by(k - 1, desc);
    let kth = buf[k - 1].0;
    let mut end = k;
    for i in k..buf.len() {
        if buf[i].0 == kth {
            buf.swap(i, end);
            end += 1;
        }
    }
    buf.truncate(end);
    kth
}

/// A (weight, id) superset of the top-p nucleus, sorted desc: every token with weight >= tau for
/// the largest tau in a short ladder whose tokens already hold `top_p` of the mass. That set
/// contains the nucleus because the desc walk reaches the mass limit before leaving it. Peaked LM
/// distributions stop at the first rung with a few dozen tokens.
fn nucleus_candidates(weights: &[f32], total: f64, top_p: f32) -> Vec<(f32, u32)> {
    let limit = top_p as f64 * total;
    let mut cands = Vec::new();
    for tau in [1.0 / 256.0, 1.0 / 65536.0, 1e-12, 0.0f32] {
        cands.clear();
        let mut mass = 0.0f64;
        for (i, &w) in weights.iter().enumerate() {
            if w >= tau && w > 0.0 {
                cands.push((w, i as u32));
                mass += w as f64;
            }
        }
        if mass >= limit {
            break;
        }
    }
    cands.sort_unstable_by(desc);
    cands
}

/// Tokens per block when the dense draw skips ahead by block sums.
const DRAW_BLOCK: usize = 512;

/// Inverse CDF over ascending ids: the first kept token whose cumulative weight exceeds
/// `u * total`.
fn draw(support: &Support, u: f32) -> u32 {
    match support {
        Support::Dense(w) => {
            let target = u as f64 * sum_f64(w);
            // Skip whole blocks by their (vectorised) sums, then walk the block holding the target.
            let mut cum = 0.0f64;
            let mut last = None;
            for (b, block) in w.chunks(DRAW_BLOCK).enumerate() {
                let block_sum = sum_f64(block);
                if cum + block_sum > target {
                    let mut inner = cum;
                    for (i, &x) in block.iter().enumerate() {
                        inner += x as f64;
                        if x > 0.0 && inner > target {
                            return (b * DRAW_BLOCK + i) as u32;
                        }
                    }
                }
                if let Some(i) = block.iter().rposition(|&x| x > 0.0) {
                    last = Some(b * DRAW_BLOCK + i);
                }
                cum += block_sum;
            }
            // Only reachable through rounding at u ≈ 1: the last token with weight.
            last.map_or(0, |i| i as u32)
        }
        Support::Sparse(kept) => {
            let total: f64 = kept.iter().map(|&(_, x)| x as f64).sum();
            let target = u as f64 * total;
            let mut cum = 0.0f64;
            for &(id, x) in kept {
                cum += x as f64;
                if x > 0.0 && cum > target {
                    return id;
                }
            }
            kept.iter().rev().find(|e| e.1 > 0.0).or(kept.last()).map_or(0, |e| e.0)
        }
    }
}

/// Tokens per block when the top-logprobs scan skips blocks by their max.
const TOP_BLOCK: usize = 32;

/// Raw (unmodified-logit) log-probability of `token` and the top `n` alternatives, by logprob desc
/// then id asc. NaN logits have probability 0; an all -inf row gives -inf everywhere.
pub(super) fn raw_logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let clamp = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) };
    let max = max_ignoring_nan(logits).min(f32::MAX);
    if max == f32::NEG_INFINITY {
        let top = logits.iter().take(n).enumerate().map(|(i, _)| (i as u32, f32::NEG_INFINITY)).collect();
        return (f32::NEG_INFINITY, top);
    }
    let lse = max as f64 + vector::sum_exp_shifted(logits, max).ln();
    let logprob = |x: f32| (clamp(x) as f64 - lse) as f32;
    let chosen = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| logprob(x));

    // Small sorted buffer. Once it is full, a block whose (vectorised) max cannot beat the n-th
    // entry is skipped whole, so the pass costs about as much as a max.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (b, block) in logits.chunks(TOP_BLOCK).enumerate() {
            if top.len() == n && max_ignoring_nan(block).min(f32::MAX) <= top[n - 1].1 {
                continue;
            }
            for (j, &x) in block.iter().enumerate() {
                // Clamped, so never NaN: `<=` below is the exact complement of `>`.
                let x = clamp(x);
                if top.len() == n && x <= top[n - 1].1 {
                    continue;
                }
                // Equal values go after existing ones: ids arrive ascending, so ties keep the lower id.
                let pos = top.partition_point(|e| e.1 >= x);
                top.insert(pos, ((b * TOP_BLOCK + j) as u32, x));
                top.truncate(n);
            }
        }
    }
    for e in top.iter_mut() {
        e.1 = logprob(e.1);
    }
    (chosen, top)
}
