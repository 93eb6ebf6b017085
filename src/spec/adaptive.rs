//! A drafting policy that pays where verification is not free: choose each sequence's draft
//! length from its recent acceptance, and stop drafting for sequences whose drafts keep failing.
//! Both draft sources run under it: the n-gram drafter and a draft model (`draft:PATH`).
//!
//! Verifying `k` drafts costs about `1 + c·k` decode steps, where `c` is the marginal cost of one
//! more query row in the target forward (on a memory-bound GPU ≈ 0; on the CPU backend the
//! multi-row matmul still does arithmetic per row: ≈ 0.25). Proposing them costs `d·k` more, where
//! `d` is the source's cost per proposed token in target decode steps. If each draft token is
//! accepted with probability `a` given the ones before it were, a step emits `1 + a + … + a^k`
//! tokens in expectation. The policy picks the `k ≤ k_max` that maximises tokens per unit of cost
//! `(1 + a + … + a^k) / (1 + (c + d)·k)`, with `k = 0` (no draft) when even one draft does not pay.
//! `a` is estimated per sequence from the drafts it was offered — a decayed count of accepted
//! tokens over accepted-plus-first-rejected trials — so it follows the text: a sequence copying a
//! span drafts long, prose drafts nothing. While a sequence does not draft its estimate decays back
//! towards the prior, so it is tried again later (a copy may start at any time).
//!
//! The draft cost `d`: the n-gram drafter's lookup is negligible next to a forward (`d = 0`). A
//! draft model runs one decode forward per proposed token (the tokens it must catch up on ride in
//! the first of them, as prefill rows), and decode is bound by reading the weights, so `d` is
//! priced as the draft's weight bytes over the target's ([`draft_cost_from_weights`]): a 135M
//! draft for an 8B target costs ≈ 0.02 a token, a draft as large as its target costs 1 and never
//! pays. This assumes both read their weights at the same rate, which holds when both run on the
//! CPU backend; with a CUDA target the draft still runs on the CPU and the estimate is optimistic,
//! so a lane's `speculative_draft_cost` overrides it with a measured ratio of step times.
//!
//! The acceptance signal needs no help from the scheduler: the tokens a sequence accepted are the
//! next `extend`, and comparing them with the last proposal gives the accepted run.

use std::collections::HashMap;

use super::{DraftRequest, DraftSource, SeqId};
use crate::generate::ResolvedKind;

/// Cost model and estimator parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveConfig {
    /// Marginal cost of one more verified token relative to a plain decode step.
    pub row_cost: f64,
    /// Cost of proposing one draft token relative to a target decode step (0 for the n-gram
    /// drafter; a draft model's forward otherwise).
    pub draft_cost: f64,
    /// Weight of history per checked proposal (counts are multiplied by it before adding the
    /// newest), so the estimate follows the last few drafts.
    pub decay: f64,
    /// Weight of history per step without a checked proposal: slow, so a sequence whose drafts
    /// failed probes again only every dozen or so steps.
    pub idle_decay: f64,
    /// Prior acceptance and its weight in pseudo-trials.
    pub prior: f64,
    pub prior_weight: f64,
}

/// Marginal cost of one more verified token on the CPU backend: its multi-row matmuls do the
/// arithmetic of every row.
pub const CPU_VERIFY_ROW_COST: f64 = 0.25;
/// On a GPU a decode step is bound by reading the weights, so extra rows are nearly free: the 8B
/// bench config on the H200 takes 4.5 ms per step at batch 1 and 6.3 ms at batch 8 (session 4,
/// docs/benchmarks.md), about 0.05 of a step per extra row.
pub const CUDA_VERIFY_ROW_COST: f64 = 0.05;

/// The measured verification row cost of the device a target runs on.
pub fn verify_row_cost_for(device: ResolvedKind) -> f64 {
    match device {
        ResolvedKind::Cuda => CUDA_VERIFY_ROW_COST,
        ResolvedKind::Cpu => CPU_VERIFY_ROW_COST,
    }
}

/// A draft model's cost per proposed token in target decode steps, from the bytes of weights
/// each reads per decode step (see the module doc for when this holds).
pub fn draft_cost_from_weights(draft_weight_bytes: u64, target_weight_bytes: u64) -> f64 {
    draft_weight_bytes as f64 / target_weight_bytes.max(1) as f64
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            row_cost: CPU_VERIFY_ROW_COST,
            draft_cost: 0.0,
            decay: 0.8,
            idle_decay: 0.97,
            prior: 0.6,
            prior_weight: 1.0,
        }
    }
}

impl AdaptiveConfig {
    /// The default estimator with verification costing `row_cost` decode steps per extra row
    /// and free proposals (the n-gram drafter).
    pub fn with_row_cost(row_cost: f64) -> Self {
        Self { row_cost, ..Self::default() }
    }

    /// The default estimator for a source whose proposals cost `draft_cost` decode steps each
    /// (a draft model), verified at `row_cost` per row.
    pub fn with_costs(row_cost: f64, draft_cost: f64) -> Self {
        Self { row_cost, draft_cost, ..Self::default() }
    }

    /// The draft length in `0..=k_max` maximising expected emitted tokens per unit of cost for a
    /// per-token acceptance probability `a`.
    pub fn best_k(&self, a: f64, k_max: usize) -> usize {
        let (mut best, mut best_value) = (0, 1.0);
        let (mut emitted, mut term) = (1.0, 1.0);
        for k in 1..=k_max {
            term *= a;
            emitted += term;
            let value = emitted / (1.0 + (self.row_cost + self.draft_cost) * k as f64);
            // Strictly better only: ties keep the shorter (cheaper, less memory) draft.
            if value > best_value + 1e-12 {
                (best, best_value) = (k, value);
            }
        }
        best
    }
}

/// One sequence's acceptance estimate and its last proposal.
#[derive(Clone, Debug, Default, PartialEq)]
struct SeqAcceptance {
    accepted: f64,
    trials: f64,
    last_proposal: Vec<u32>,
}

/// Wraps a draft source with the adaptive draft length.
pub struct Adaptive<S> {
    inner: S,
    cfg: AdaptiveConfig,
    seqs: HashMap<SeqId, SeqAcceptance>,
}

impl<S: DraftSource> Adaptive<S> {
    pub fn new(inner: S, cfg: AdaptiveConfig) -> Self {
        Self { inner, cfg, seqs: HashMap::new() }
    }

    /// The current acceptance estimate of `seq` (the prior for an unknown one).
    pub fn acceptance(&self, seq: SeqId) -> f64 {
        let s = self.seqs.get(&seq).cloned().unwrap_or_default();
        (s.accepted + self.cfg.prior * self.cfg.prior_weight) / (s.trials + self.cfg.prior_weight)
    }
}

impl<S: DraftSource> DraftSource for Adaptive<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn extend(&mut self, seq: SeqId, tokens: &[u32]) {
        let cfg = self.cfg;
        let s = self.seqs.entry(seq).or_default();
        let proposal = std::mem::take(&mut s.last_proposal);
        if !proposal.is_empty() && !tokens.is_empty() {
            let run = proposal.iter().zip(tokens).take_while(|(p, t)| p == t).count();
            // The step shows `run` accepted tokens and, unless every proposed token it could check
            // was accepted, one rejection.
            let checked = proposal.len().min(tokens.len());
            s.accepted = s.accepted * cfg.decay + run as f64;
            s.trials = s.trials * cfg.decay + run as f64 + f64::from(u8::from(run < checked));
        } else {
            s.accepted *= cfg.idle_decay;
            s.trials *= cfg.idle_decay;
        }
        self.inner.extend(seq, tokens);
    }

    fn hidden_taps(&self) -> Vec<usize> {
        self.inner.hidden_taps()
    }

    fn extend_hidden(&mut self, seq: SeqId, chunks: Vec<super::HiddenChunk>) {
        self.inner.extend_hidden(seq, chunks);
    }

    fn propose(&mut self, seq: SeqId, k: usize) -> Vec<u32> {
        self.propose_batch(&[DraftRequest { seq, k }]).pop().unwrap_or_default()
    }

    /// Sizes every request by its sequence's acceptance, then asks the source once for all that
    /// draft at all, so a draft model still runs one batched forward per draft position.
    fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
        let sized: Vec<DraftRequest> = requests
            .iter()
            .map(|r| DraftRequest { seq: r.seq, k: self.cfg.best_k(self.acceptance(r.seq), r.k) })
            .collect();
        let asked: Vec<DraftRequest> = sized.iter().filter(|r| r.k > 0).copied().collect();
        let mut drafts = if asked.is_empty() { Vec::new() } else { self.inner.propose_batch(&asked) }.into_iter();
        sized
            .iter()
            .map(|r| {
                let draft = if r.k == 0 { Vec::new() } else { drafts.next().unwrap_or_default() };
                self.seqs.entry(r.seq).or_default().last_proposal = draft.clone();
                draft
            })
            .collect()
    }

    fn forget(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.inner.forget(seq);
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.last_proposal.clear();
        }
        self.inner.truncate(seq, len);
    }

    fn len(&self, seq: SeqId) -> usize {
        self.inner.len(seq)
    }

    fn sequences(&self) -> usize {
        self.inner.sequences()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ngram::{NgramConfig, NgramDrafter};

    #[test]
    fn the_gpu_cost_drafts_where_the_cpu_cost_does_not() {
        let cpu = AdaptiveConfig::with_row_cost(verify_row_cost_for(ResolvedKind::Cpu));
        let gpu = AdaptiveConfig::with_row_cost(verify_row_cost_for(ResolvedKind::Cuda));
        assert_eq!(cpu, AdaptiveConfig::default());
        // At 20 % acceptance one more row pays on the GPU (1.2 / 1.05 > 1) but not on the CPU
        // (1.2 / 1.25 < 1, and longer drafts add less than they cost).
        assert_eq!(cpu.best_k(0.2, 7), 0);
        assert!(gpu.best_k(0.2, 7) >= 1);
        // At every acceptance the cheaper verification drafts at least as long.
        for i in 0..=20 {
            let a = i as f64 / 20.0;
            assert!(gpu.best_k(a, 7) >= cpu.best_k(a, 7), "a = {a}");
        }
    }

    #[test]
    fn the_draft_length_follows_acceptance_and_cost() {
        let cfg = AdaptiveConfig::default();
        // Hopeless drafts are not worth one row; certain ones are worth all seven.
        assert_eq!(cfg.best_k(0.0, 7), 0);
        assert_eq!(cfg.best_k(0.2, 7), 0);
        assert_eq!(cfg.best_k(1.0, 7), 7);
        // Monotone in the acceptance.
        let ks: Vec<usize> = (0..=20).map(|i| cfg.best_k(i as f64 / 20.0, 7)).collect();
        assert!(ks.windows(2).all(|w| w[0] <= w[1]), "{ks:?}");
        // Free verification (a memory-bound GPU) drafts whenever anything can be accepted.
        let free = AdaptiveConfig { row_cost: 0.0, ..cfg };
        assert_eq!(free.best_k(0.05, 7), 7);
        // The cap is respected.
        assert_eq!(cfg.best_k(1.0, 3), 3);
        // Brute force: the chosen k really maximises emitted / cost.
        for i in 0..=50 {
            let a = i as f64 / 50.0;
            let value = |k: usize| (0..=k).map(|j| a.powi(j as i32)).sum::<f64>() / (1.0 + 0.25 * k as f64);
            let k = cfg.best_k(a, 7);
            assert!((0..=7).all(|j| value(j) <= value(k) + 1e-9), "a {a}: k {k}");
        }
    }

    /// A source proposing a fixed script, to drive the estimator.
    struct Script(Vec<u32>);

    impl DraftSource for Script {
        fn name(&self) -> &'static str {
            "script"
        }
        fn extend(&mut self, _: SeqId, _: &[u32]) {}
        fn propose(&mut self, _: SeqId, k: usize) -> Vec<u32> {
            self.0.iter().copied().take(k).collect()
        }
        fn forget(&mut self, _: SeqId) {}
        fn truncate(&mut self, _: SeqId, _: usize) {}
        fn len(&self, _: SeqId) -> usize {
            0
        }
        fn sequences(&self) -> usize {
            0
        }
    }

    #[test]
    fn rejections_shrink_the_draft_to_nothing_and_acceptance_grows_it() {
        let mut d = Adaptive::new(Script(vec![1, 2, 3, 4, 5, 6, 7]), AdaptiveConfig::default());
        // Every proposal rejected at its first token, for 60 steps: after the first two, the
        // sequence only probes with a single token now and then.
        let lengths: Vec<usize> = (0..60)
            .map(|_| {
                let n = d.propose(9, 7).len();
                d.extend(9, &[99]);
                n
            })
            .collect();
        assert_eq!(lengths[0], 2, "the prior drafts a little: {lengths:?}");
        let probes = lengths[2..].iter().filter(|&&n| n > 0).count();
        assert!((1..=6).contains(&probes), "{probes} probes in 58 steps: {lengths:?}");
        assert!(lengths[2..].iter().all(|&n| n <= 1), "{lengths:?}");
        // Every proposal accepted: the draft grows to the cap within a few steps.
        let mut grown = Vec::new();
        for _ in 0..60 {
            let p = d.propose(9, 7);
            grown.push(p.len());
            let mut accepted = p.clone();
            accepted.push(0);
            d.extend(9, &accepted);
        }
        assert_eq!(d.propose(9, 7).len(), 7, "{grown:?}");
        assert!(d.acceptance(9) > 0.9);
        d.forget(9);
        assert_eq!(d.acceptance(9), 0.6, "forgotten: back to the prior");
    }

    #[test]
    fn a_draft_models_cost_adds_to_verification_and_a_target_sized_draft_never_pays() {
        // Proposal and verification costs add per draft token.
        for i in 0..=20 {
            let a = i as f64 / 20.0;
            let split = AdaptiveConfig::with_costs(0.25, 0.5);
            let merged = AdaptiveConfig::with_row_cost(0.75);
            assert_eq!(split.best_k(a, 7), merged.best_k(a, 7), "a = {a}");
            // Brute force: the chosen k maximises emitted / (1 + (c + d)·k).
            let value = |k: usize| (0..=k).map(|j| a.powi(j as i32)).sum::<f64>() / (1.0 + 0.75 * k as f64);
            let k = split.best_k(a, 7);
            assert!((0..=7).all(|j| value(j) <= value(k) + 1e-9), "a {a}: k {k}");
        }
        // A draft as large as the target costs a whole decode step per token: even certain drafts
        // emit k + 1 tokens for 1 + 1.25·k steps, so it never drafts on the CPU, and barely
        // would on a GPU.
        let same_size = AdaptiveConfig::with_costs(CPU_VERIFY_ROW_COST, draft_cost_from_weights(100, 100));
        assert!((0..=20).all(|i| same_size.best_k(i as f64 / 20.0, 7) == 0));
        // A 135M draft (Q4, ~90 MB) for an 8B bf16 target (~16 GB) is almost free: it drafts
        // like the n-gram drafter.
        let small = draft_cost_from_weights(90 << 20, 16 << 30);
        assert!(small > 0.0 && small < 0.01, "{small}");
        let small = AdaptiveConfig::with_costs(CPU_VERIFY_ROW_COST, small);
        let ngram = AdaptiveConfig::with_row_cost(CPU_VERIFY_ROW_COST);
        assert_eq!(small.best_k(0.9, 7), ngram.best_k(0.9, 7));
        assert!(small.best_k(0.9, 7) >= 4);
        // Costlier proposals never draft longer.
        for i in 0..=20 {
            let a = i as f64 / 20.0;
            let ks: Vec<usize> =
                [0.0, 0.05, 0.2, 0.5, 1.0].iter().map(|&d| AdaptiveConfig::with_costs(0.25, d).best_k(a, 7)).collect();
            assert!(ks.windows(2).all(|w| w[0] >= w[1]), "a = {a}: {ks:?}");
        }
        assert_eq!(draft_cost_from_weights(5, 0), 5.0, "an empty target does not divide by zero");
    }

    /// A batched source (like a draft model) that proposes `seq·100 + 1, +2, …` and records the
    /// requests of every batch it was asked for.
    #[derive(Default)]
    struct Batched {
        batches: Vec<Vec<DraftRequest>>,
    }

    impl DraftSource for Batched {
        fn name(&self) -> &'static str {
            "batched"
        }
        fn extend(&mut self, _: SeqId, _: &[u32]) {}
        fn propose(&mut self, _: SeqId, _: usize) -> Vec<u32> {
            panic!("a batched source is asked through propose_batch only")
        }
        fn propose_batch(&mut self, requests: &[DraftRequest]) -> Vec<Vec<u32>> {
            self.batches.push(requests.to_vec());
            requests.iter().map(|r| (1..=r.k as u32).map(|i| r.seq as u32 * 100 + i).collect()).collect()
        }
        fn forget(&mut self, _: SeqId) {}
        fn truncate(&mut self, _: SeqId, _: usize) {}
        fn len(&self, _: SeqId) -> usize {
            0
        }
        fn sequences(&self) -> usize {
            0
        }
    }

    #[test]
    fn a_batched_source_is_asked_once_per_step_with_each_sequences_adapted_length() {
        let mut d = Adaptive::new(Batched::default(), AdaptiveConfig::with_costs(CPU_VERIFY_ROW_COST, 0.02));
        // Sequence 1 copies (every draft accepted), sequence 2 does not (every draft rejected at
        // its first token), sequence 3 asks for at most 2.
        let mut lengths: Vec<[usize; 3]> = Vec::new();
        for _ in 0..40 {
            let requests =
                [DraftRequest { seq: 1, k: 7 }, DraftRequest { seq: 2, k: 7 }, DraftRequest { seq: 3, k: 2 }];
            let drafts = d.propose_batch(&requests);
            assert_eq!(drafts.len(), 3, "one reply per request, in order");
            lengths.push([drafts[0].len(), drafts[1].len(), drafts[2].len()]);
            d.extend(1, &[drafts[0].clone(), vec![0]].concat());
            d.extend(2, &[99]);
            d.extend(3, &[drafts[2].clone(), vec![0]].concat());
        }
        let calls = &d.inner.batches;
        assert_eq!(calls.len(), 40, "one batch per step, never one call per sequence");
        assert!(calls.iter().all(|b| b.iter().all(|r| r.k > 0)), "sequences that do not draft are not asked");
        assert_eq!(lengths[0], [2, 2, 2], "the prior drafts a little: {lengths:?}");
        assert_eq!(lengths[39][0], 7, "acceptance grows the draft to the cap: {lengths:?}");
        assert!(lengths[2..].iter().all(|l| l[1] <= 1 && l[2] <= 2), "{lengths:?}");
        let probes = lengths[2..].iter().filter(|l| l[1] > 0).count();
        assert!(probes <= 6, "{probes} probes of a hopeless sequence in 38 steps: {lengths:?}");
        assert!(d.acceptance(1) > 0.9 && d.acceptance(2) < 0.3);
    }

    #[test]
    fn the_wrapped_ngram_drafter_still_proposes_its_matches() {
        let mut d = Adaptive::new(NgramDrafter::new(NgramConfig::default()).unwrap(), AdaptiveConfig::default());
        d.extend(1, &[10, 11, 12, 13, 14, 99, 10, 11, 12]);
        let p = d.propose(1, 7);
        assert!(!p.is_empty() && [13, 14, 99, 10, 11, 12].starts_with(&p), "{p:?}");
        assert_eq!(d.len(1), 9);
    }
}
