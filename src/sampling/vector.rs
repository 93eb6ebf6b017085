//! Whole-row float kernels for sampling (max, sums, exp), written as independent lanes so the
//! compiler vectorises them on the baseline target: a 150k-entry row is a few tens of microseconds,
//! not a scalar `expf` per token. Pure functions; results depend only on the input row, so
//! sampling stays deterministic.

/// Lanes per accumulator group: enough independent chains to hide add latency and fill SSE/AVX.
const LANES: usize = 8;

/// Largest entry, NaN ignored; -inf for an empty or all-NaN row. `if x > m` keeps `m` when `x`
/// is NaN, which is exactly the `maxps` instruction, hence vectorisable.
pub(super) fn max_ignoring_nan(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in acc.iter().chain(rest) {
        m = if x > m { x } else { m };
    }
    m
}

/// Sum in f64 (weights over 150k tokens lose nothing worth noting), in lanes.
pub(super) fn sum_f64(xs: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j] as f64;
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&x| x as f64).sum::<f64>()
}

/// `sum(exp(x - max))` over the row with NaN counted as 0 and +inf clamped to `f32::MAX`
/// (`max` must already be clamped): the log-sum-exp of raw logprobs.
pub(super) fn sum_exp_shifted(xs: &[f32], max: f32) -> f64 {
    let term = |x: f32| {
        // `f32::min` returns the other operand for NaN, so NaN is screened on `x` itself.
        let v = exp_f32(x.min(f32::MAX) - max);
        if x.is_nan() {
            0.0
        } else {
            v
        }
    };
    let mut acc = [0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        // Exps into a lane array first, then widen and add: this shape is what vectorises.
        let mut e = [0f32; LANES];
        for j in 0..LANES {
            e[j] = term(c[j]);
        }
        for j in 0..LANES {
            acc[j] += e[j] as f64;
        }
    }
    acc.iter().sum::<f64>() + rest.iter().map(|&x| term(x) as f64).sum::<f64>()
}

/// Replaces each logit `x` by its sampling weight `exp((x - max) * inv_t)` in [0, 1]: NaN weighs
/// 0, +inf is clamped to `f32::MAX` (`max` must be clamped too, so the best tokens weigh exactly
/// 1), and a NaN exponent (infinite temperature times an infinite gap) weighs 0.
pub(super) fn weights_in_place(xs: &mut [f32], max: f32, inv_t: f32) {
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        let mut e = [0f32; LANES];
        for j in 0..LANES {
            e[j] = weight(c[j], max, inv_t);
        }
        c.copy_from_slice(&e);
    }
    for x in chunks.into_remainder() {
        *x = weight(*x, max, inv_t);
    }
}

/// One sampling weight; see [`weights_in_place`].
#[inline]
pub(super) fn weight(x: f32, max: f32, inv_t: f32) -> f32 {
    let z = (x.min(f32::MAX) - max) * inv_t;
    let v = exp_f32(z);
    if x.is_nan() || z.is_nan() {
        0.0
    } else {
        v
    }
}

/// `exp(x)` for x <= ~88 with relative error below 3e-7 (Cephes `expf`: x = n ln2 + r,
/// |r| <= ln2 / 2, degree-6 polynomial for exp(r), 2^n built in the exponent bits). Branch-free
/// so loops over rows vectorise. Exactly 1 at 0 (the best token's weight); exactly 0 below -87
/// and at -inf (removed tokens must weigh nothing); NaN in gives a meaningless finite value, so
/// callers screen NaN first.
#[inline]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds x * log2(e) to the nearest integer n and leaves n in the low
    // mantissa bits (no `roundps`, no saturating float → int cast, both of which block
    // vectorisation on the baseline target).
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: u32 = 0x4B40_0000;
    let underflow = x < -87.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n: n + 127 (in [1, 254], a normal exponent) shifted into the exponent field. Wrapping ops
    // because n sits in the low bits of `t` as a two's-complement offset from ROUND_BITS.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND_BITS).wrapping_add(127) << 23);
    // Zero the result by mask rather than by branch so the select vectorises.
    let keep = (underflow as u32).wrapping_sub(1);
    f32::from_bits((y * scale).to_bits() & keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_exp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e30), 0.0);
        assert_eq!(exp_f32(-87.5), 0.0);
        assert!(exp_f32(-86.9) > 0.0);
    }

    #[test]
    fn max_and_sums_handle_nan_inf_and_remainders() {
        for n in [0usize, 1, 7, 8, 9, 17, 1000] {
            let xs: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32) * 0.1 - 3.0).collect();
            let want_max = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_ignoring_nan(&xs), want_max, "n = {n}");
            let want_sum: f64 = xs.iter().map(|&x| x as f64).sum();
            assert!((sum_f64(&xs) - want_sum).abs() < 1e-9, "n = {n}");
            if n > 0 {
                let m = want_max;
                let want: f64 = xs.iter().map(|&x| ((x - m) as f64).exp()).sum();
                assert!((sum_exp_shifted(&xs, m) - want).abs() < 1e-6 * want, "n = {n}");
            }
        }
        let mixed = [f32::NAN, -1.0, f32::NAN, 2.5, f32::NEG_INFINITY, f32::NAN, 0.0, 1.0, 2.0, f32::NAN];
        assert_eq!(max_ignoring_nan(&mixed), 2.5);
        assert_eq!(max_ignoring_nan(&[f32::NAN; 9]), f32::NEG_INFINITY);
        assert_eq!(max_ignoring_nan(&[f32::NAN, f32::INFINITY]), f32::INFINITY);
        let want: f64 = [-3.5f64, 0.0, -2.5, -1.5, -0.5].iter().map(|x| x.exp()).sum();
        assert!((sum_exp_shifted(&mixed, 2.5) - want).abs() < 1e-6);
    }
}
