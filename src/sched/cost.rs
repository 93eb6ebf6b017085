//! The step cost model: how long a step takes on the running device, as a linear function of what
//! it computes, refit from the step times the engine measures. The planner uses it to size
//! lower lanes' prefill chunks to a lane's latency budget (`sched::pacing`).
//!
//! A step's time is modelled as `fixed + per_prefill_token × prefill tokens + per_decode ×
//! decoding sequences + per_attended × attended positions`, where *attended positions* counts,
//! over every query token of the step, the positions it attends to (so a chunk late in a long
//! prompt costs more than the same chunk at its start). The coefficients come from a weighted
//! least-squares fit over the steps seen so far, older steps decaying geometrically, with a weak
//! ridge pull toward device defaults so that a direction the workload never exercised (say,
//! prefill on an engine that only decoded) keeps a sensible value. Coefficients that the fit
//! would make negative are pinned to zero and the rest refit. Plain data: no clocks, no I/O.

/// What a step computes, in the terms its time depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Query tokens of prefill chunks (draft tokens under verification count here too).
    pub prefill_tokens: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// Over every query token, the positions it attends to (its own included).
    pub attended: u64,
}

impl StepShape {
    /// Adds `n` query tokens of one sequence starting at position `start`; a decode when `decode`.
    pub fn add(&mut self, start: usize, n: usize, decode: bool) {
        if n == 0 {
            return;
        }
        if decode {
            self.decode_seqs += 1;
        } else {
            self.prefill_tokens += n;
        }
        self.attended += attended_by(start, n);
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }

    fn features(&self) -> [f64; FEATURES] {
        [1.0, self.prefill_tokens as f64, self.decode_seqs as f64, self.attended as f64 / ATTENDED_UNIT]
    }
}

/// Positions attended by `n` query tokens at positions `start..start + n` (causal).
fn attended_by(start: usize, n: usize) -> u64 {
    let (s, n) = (start as u64, n as u64);
    n * s + n * (n + 1) / 2
}

const FEATURES: usize = 4;
/// Attended positions are counted in millions in the fit, so every feature is of order 1–10^4.
const ATTENDED_UNIT: f64 = 1e6;
/// A typical magnitude per feature: the ridge prior weighs as a thousandth of one step of this
/// size. The terms are strongly correlated in real steps (long chunks attend to more positions),
/// so a heavier prior would bias every coefficient; this one only decides directions that the
/// measured steps leave undetermined.
const TYPICAL: [f64; FEATURES] = [1.0, 256.0, 8.0, 1.0];
const PRIOR_WEIGHT: f64 = 0.001;

/// Seconds per unit of each term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Per step, whatever it carries.
    pub fixed: f64,
    pub per_prefill_token: f64,
    pub per_decode_seq: f64,
    /// Per million attended positions.
    pub per_million_attended: f64,
}

impl StepCost {
    /// Starting point on the CPU backend: the default model (SmolLM2-135M) on two cores.
    pub const CPU: StepCost =
        StepCost { fixed: 0.010, per_prefill_token: 0.003, per_decode_seq: 0.004, per_million_attended: 0.2 };
    /// Starting point on a CUDA device (an 8B model on one H200).
    pub const CUDA: StepCost =
        StepCost { fixed: 0.004, per_prefill_token: 0.000_03, per_decode_seq: 0.000_05, per_million_attended: 0.000_5 };

    /// Seconds that `n` prefill tokens starting at position `start` add to the steps that carry
    /// them (per-token and attention terms; the per-step cost is paid by those steps anyway).
    pub fn prefill_secs(&self, start: usize, n: usize) -> f64 {
        n as f64 * self.per_prefill_token + attended_by(start, n) as f64 / ATTENDED_UNIT * self.per_million_attended
    }

    fn to_array(self) -> [f64; FEATURES] {
        [self.fixed, self.per_prefill_token, self.per_decode_seq, self.per_million_attended]
    }

    fn from_array(a: [f64; FEATURES]) -> Self {
        StepCost { fixed: a[0], per_prefill_token: a[1], per_decode_seq: a[2], per_million_attended: a[3] }
    }
}

/// Seconds per prefill token as the engine's own prefill-carrying steps measured them (a decayed
/// ratio of step time to prefill tokens): what recomputing a spilled prefix costs, for the pool's
/// restore-or-recompute choice. Deliberately not the step cost fit: lane pacing sizes chunks so
/// that steps last about the same, which leaves a regression on chunk size little to fit, where a
/// ratio of totals stays right.
#[derive(Debug, Clone, Default)]
pub struct PrefillRate {
    secs: f64,
    tokens: f64,
}

impl PrefillRate {
    /// Steps with fewer prefill tokens cost mostly their decodes and fixed overhead.
    pub const MIN_TOKENS: usize = 64;
    /// Weight of history (about the last 20 prefill steps matter).
    const DECAY: f64 = 0.95;

    pub fn observe(&mut self, prefill_tokens: usize, secs: f64) {
        if prefill_tokens < Self::MIN_TOKENS || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        self.secs = Self::DECAY * self.secs + secs;
        self.tokens = Self::DECAY * self.tokens + prefill_tokens as f64;
    }

    /// Seconds per prefill token, once a step has been measured.
    pub fn per_token(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.secs / self.tokens)
    }

    /// As a step cost that prices prefill only (what the pool's restore pricing reads).
    pub fn as_step_cost(&self) -> Option<StepCost> {
        self.per_token().map(|r| StepCost {
            fixed: 0.0,
            per_prefill_token: r,
            per_decode_seq: 0.0,
            per_million_attended: 0.0,
        })
    }
}

#[derive(Debug, Clone)]
pub struct StepCostModel {
    prior: [f64; FEATURES],
    /// Decayed normal equations of the observed steps: Σ w·x·xᵀ and Σ w·x·y.
    xtx: [[f64; FEATURES]; FEATURES],
    xty: [f64; FEATURES],
    /// Weight kept by past steps at each new observation (memory of about 1 / (1 − decay) steps).
    decay: f64,
    coef: [f64; FEATURES],
    observed: u64,
    /// The most prefill tokens one observed step carried. A linear fit of small prefills (which
    /// cost little more than a decode while the device is bound by reading weights) says nothing
    /// about large ones (bound by compute): beyond this size prefill is priced at no less than
    /// the prior's rate, so a first long chunk cannot hold a step far past its budget.
    largest_prefill: usize,
}

impl StepCostModel {
    /// `decay` in (0, 1]: 0.95 remembers about the last 20 steps.
    pub fn new(prior: StepCost, decay: f64) -> Self {
        let prior = prior.to_array();
        StepCostModel {
            prior,
            xtx: [[0.0; FEATURES]; FEATURES],
            xty: [0.0; FEATURES],
            decay: decay.clamp(f64::MIN_POSITIVE, 1.0),
            coef: prior,
            observed: 0,
            largest_prefill: 0,
        }
    }

    /// The current coefficients.
    pub fn cost(&self) -> StepCost {
        StepCost::from_array(self.coef)
    }

    /// Steps observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Per prefill token, for a step carrying `n` of them: the fit within what was observed,
    /// never below the prior beyond it.
    fn prefill_rate(&self, n: usize) -> f64 {
        if n > self.largest_prefill {
            self.coef[1].max(self.prior[1])
        } else {
            self.coef[1]
        }
    }

    /// Predicted seconds for a step of this shape.
    pub fn predict(&self, shape: &StepShape) -> f64 {
        let mut coef = self.coef;
        coef[1] = self.prefill_rate(shape.prefill_tokens);
        shape.features().iter().zip(&coef).map(|(x, c)| x * c).sum()
    }

    /// Seconds that `n` more prefill tokens starting at `start` add to a step.
    pub fn chunk_cost(&self, start: usize, n: usize) -> f64 {
        n as f64 * self.prefill_rate(n) + attended_by(start, n) as f64 / ATTENDED_UNIT * self.coef[3]
    }

    /// The most prefill tokens starting at position `start` that add at most `secs` to a step.
    pub fn tokens_within(&self, secs: f64, start: usize) -> usize {
        // NaN included.
        if secs.is_nan() || secs <= 0.0 {
            return 0;
        }
        // With the fitted rate; a chunk beyond the largest observed prefill is sized again at the
        // rate `prefill_rate` gives it, keeping at least what fits within the observed range.
        let fitted = self.tokens_at_rate(secs, start, self.coef[1]);
        let mut n = if fitted <= self.largest_prefill {
            fitted
        } else {
            self.tokens_at_rate(secs, start, self.prefill_rate(fitted)).max(self.largest_prefill)
        };
        // Nothing prices prefill: no chunk size is too large.
        if n == usize::MAX {
            return n;
        }
        // Rounding in the closed form must never let the chunk overshoot its budget.
        while n > 0 && self.chunk_cost(start, n) > secs {
            n -= 1;
        }
        n
    }

    /// Closed form of `tokens_within` for one per-token rate (may overshoot by rounding).
    fn tokens_at_rate(&self, secs: f64, start: usize, rate: f64) -> usize {
        // cost(n) = a·n² + b·n with a = c3 / 2M, b = rate + c3·(start + ½) / M; increasing in n.
        let a = self.coef[3] / (2.0 * ATTENDED_UNIT);
        let b = rate + self.coef[3] * (start as f64 + 0.5) / ATTENDED_UNIT;
        let n = if a > 0.0 {
            (-b + (b * b + 4.0 * a * secs).sqrt()) / (2.0 * a)
        } else if b > 0.0 {
            secs / b
        } else {
            return usize::MAX;
        };
        if n.is_finite() && n < usize::MAX as f64 {
            n.floor() as usize
        } else {
            usize::MAX
        }
    }

    /// Records how long a step of this shape took, and refits.
    pub fn observe(&mut self, shape: &StepShape, secs: f64) {
        if shape.is_empty() || !secs.is_finite() || secs < 0.0 {
            return;
        }
        let x = shape.features();
        for i in 0..FEATURES {
            for j in 0..FEATURES {
                self.xtx[i][j] = self.decay * self.xtx[i][j] + x[i] * x[j];
            }
            self.xty[i] = self.decay * self.xty[i] + x[i] * secs;
        }
        self.observed += 1;
        self.largest_prefill = self.largest_prefill.max(shape.prefill_tokens);
        self.refit();
    }

    /// Ridge least squares toward the prior; coefficients that come out negative are pinned to 0
    /// and the others solved again (at most once per coefficient).
    fn refit(&mut self) {
        let mut pinned = [false; FEATURES];
        for _ in 0..=FEATURES {
            let mut a = [[0.0; FEATURES]; FEATURES];
            let mut y = [0.0; FEATURES];
            for i in 0..FEATURES {
                if pinned[i] {
                    a[i][i] = 1.0;
                    continue;
                }
                let ridge = PRIOR_WEIGHT * TYPICAL[i] * TYPICAL[i];
                for j in 0..FEATURES {
                    if !pinned[j] {
                        a[i][j] = self.xtx[i][j];
                    }
                }
                a[i][i] += ridge;
                y[i] = self.xty[i] + ridge * self.prior[i];
            }
            let Some(coef) = solve(a, y) else { return };
            let negative: Vec<usize> = (0..FEATURES).filter(|&i| !pinned[i] && coef[i] < 0.0).collect();
            if negative.is_empty() {
                self.coef = coef;
                return;
            }
            for i in negative {
                pinned[i] = true;
            }
        }
    }
}

/// Solves `a · x = y` by Gaussian elimination with partial pivoting; `None` if singular.
fn solve(mut a: [[f64; FEATURES]; FEATURES], mut y: [f64; FEATURES]) -> Option<[f64; FEATURES]> {
    for col in 0..FEATURES {
        let pivot = (col..FEATURES).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        y.swap(col, pivot);
        for row in col + 1..FEATURES {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (v, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
            y[row] -= f * y[col];
        }
    }
    let mut x = [0.0; FEATURES];
    for row in (0..FEATURES).rev() {
        let s: f64 = (row + 1..FEATURES).map(|k| a[row][k] * x[k]).sum();
        x[row] = (y[row] - s) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prefill: &[(usize, usize)], decodes: &[usize]) -> StepShape {
        let mut s = StepShape::default();
        for &(start, n) in prefill {
            s.add(start, n, false);
        }
        for &ctx in decodes {
            s.add(ctx, 1, true);
        }
        s
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-12)
    }

    /// Steps of varied shapes timed by a known cost; the fit must recover it.
    fn train(model: &mut StepCostModel, truth: StepCost, steps: usize) {
        let truth = StepCostModel::new(truth, 1.0);
        for i in 0..steps {
            let s = shape(&[(i * 37 % 2000, 16 + i * 53 % 400)], &vec![300 + i % 900; i % 7]);
            model.observe(&s, truth.predict(&s));
        }
    }

    #[test]
    fn attended_positions_count_every_query_token_causally() {
        let s = shape(&[(0, 4)], &[]);
        assert_eq!(s.attended, 1 + 2 + 3 + 4);
        let s = shape(&[(10, 2)], &[5]);
        assert_eq!((s.attended, s.prefill_tokens, s.decode_seqs), (11 + 12 + 6, 2, 1));
    }

    #[test]
    fn the_fit_recovers_the_device_cost_from_measured_steps() {
        let truth =
            StepCost { fixed: 0.020, per_prefill_token: 0.0015, per_decode_seq: 0.006, per_million_attended: 0.9 };
        let mut m = StepCostModel::new(StepCost::CPU, 0.97);
        train(&mut m, truth, 200);
        let c = m.cost();
        assert!(close(c.fixed, truth.fixed, 0.05), "{c:?}");
        assert!(close(c.per_prefill_token, truth.per_prefill_token, 0.05), "{c:?}");
        assert!(close(c.per_decode_seq, truth.per_decode_seq, 0.05), "{c:?}");
        assert!(close(c.per_million_attended, truth.per_million_attended, 0.05), "{c:?}");
        let s = shape(&[(1800, 256)], &[700, 700]);
        let t = StepCostModel::new(truth, 1.0);
        assert!(close(m.predict(&s), t.predict(&s), 0.02));
    }

    #[test]
    fn the_fit_follows_a_device_that_slows_down() {
        let fast =
            StepCost { fixed: 0.005, per_prefill_token: 0.001, per_decode_seq: 0.002, per_million_attended: 0.1 };
        let slow = StepCost { per_prefill_token: 0.003, ..fast };
        let mut m = StepCostModel::new(fast, 0.9);
        train(&mut m, fast, 100);
        train(&mut m, slow, 100);
        assert!(close(m.cost().per_prefill_token, 0.003, 0.05), "{:?}", m.cost());
    }

    #[test]
    fn an_unexercised_term_keeps_its_default_and_none_goes_negative() {
        // Only decodes: the prefill cost is never seen and stays at the prior.
        let mut m = StepCostModel::new(StepCost::CPU, 0.95);
        for i in 0..50 {
            m.observe(&shape(&[], &vec![100; 1 + i % 4]), 0.01 + 0.002 * (1 + i % 4) as f64);
        }
        let c = m.cost();
        assert!(close(c.per_prefill_token, StepCost::CPU.per_prefill_token, 0.02), "{c:?}");
        // Times that fall with size would fit a negative slope: pinned to zero instead.
        let mut m = StepCostModel::new(StepCost::CPU, 0.95);
        for i in 0..50 {
            m.observe(&shape(&[(0, 10 + i)], &[]), 0.5 - 0.001 * i as f64);
        }
        let c = m.cost();
        assert!(c.per_prefill_token >= 0.0 && c.per_million_attended >= 0.0 && c.fixed > 0.0, "{c:?}");
    }

    #[test]
    fn the_prefill_rate_is_a_ratio_of_totals_that_ignores_decode_steps() {
        let mut r = PrefillRate::default();
        assert_eq!(r.per_token(), None);
        // Paced steps: every step lasts 40 ms whatever its chunk (800 or 400 tokens).
        r.observe(800, 0.040);
        r.observe(400, 0.040);
        r.observe(8, 0.005); // a decode step with a short prompt: ignored
        let rate = r.per_token().unwrap();
        assert!((rate - 0.080 / 1200.0).abs() / rate < 0.03, "{rate}");
        let c = r.as_step_cost().unwrap();
        assert_eq!((c.fixed, c.per_decode_seq, c.per_million_attended), (0.0, 0.0, 0.0));
        assert!((c.prefill_secs(0, 256) - 256.0 * rate).abs() < 1e-12);
    }

    #[test]
    fn prefill_beyond_the_largest_observed_is_priced_at_least_at_the_prior_rate() {
        // An 8B model on a GPU: prefills of 10 to 200 tokens take 5 ms whatever their size
        // (weight reads), so the fit's per-token rate comes out far below the compute-bound 30 µs
        // of long chunks.
        let mut m = StepCostModel::new(StepCost::CUDA, 0.97);
        for i in 0..60 {
            let mut s = StepShape::default();
            s.add(0, 10 + (i % 20) * 10, false);
            m.observe(&s, 0.005);
        }
        assert!(m.cost().per_prefill_token < StepCost::CUDA.per_prefill_token / 2.0, "{:?}", m.cost());
        let mut long = StepShape::default();
        long.add(0, 6000, false);
        assert!(m.predict(&long) >= 6000.0 * StepCost::CUDA.per_prefill_token, "{}", m.predict(&long));
        // Chunk sizing follows: 50 ms hold at most the prior's 1,666 tokens, not the fit's many.
        let n = m.tokens_within(0.05, 0);
        assert!((200..=1666).contains(&n), "{n}");
        // Once a long step is seen, the fit takes over for that size.
        m.observe(&long, 6000.0 * 2e-5);
        assert!(m.predict(&long) < 6000.0 * StepCost::CUDA.per_prefill_token);
    }

    #[test]
    fn tokens_within_is_the_largest_chunk_that_fits_the_budget() {
        let m = StepCostModel::new(
            StepCost { fixed: 0.01, per_prefill_token: 0.001, per_decode_seq: 0.0, per_million_attended: 2.0 },
            0.95,
        );
        for &(secs, start) in &[(0.1, 0usize), (0.1, 5000), (0.0005, 0), (1.0, 100_000)] {
            let n = m.tokens_within(secs, start);
            assert!(m.chunk_cost(start, n) <= secs, "{n} tokens overshoot {secs}s at {start}");
            assert!(m.chunk_cost(start, n + 1) > secs, "{n} + 1 tokens would still fit {secs}s at {start}");
        }
        assert_eq!(m.tokens_within(0.0, 0), 0);
        assert_eq!(m.tokens_within(-1.0, 0), 0);
        let free = StepCostModel::new(
            StepCost { fixed: 0.0, per_prefill_token: 0.0, per_decode_seq: 0.0, per_million_attended: 0.0 },
            0.95,
        );
        assert_eq!(free.tokens_within(0.1, 0), usize::MAX);
    }
}
