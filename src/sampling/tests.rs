//! Unit tests for `sampling`: each knob on hand-computed cases, HF transformers golden cases
//! (`testdata/gen_hf_reference.py`), determinism, frequency tests against `processed_probs`,
//! logprobs, validation and NaN/-inf robustness.

use super::*;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams { temperature, ..SamplingParams::default() }
}

fn softmax(xs: &[f64]) -> Vec<f64> {
    let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = xs.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

fn assert_probs(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length: got {got:?} want {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= tol, "prob[{i}]: got {g}, want {w} (all: {got:?} vs {want:?})");
        if w == 0.0 {
            assert_eq!(g, 0.0, "prob[{i}] must be exactly 0 (removed)");
        }
    }
}

fn ln(ps: &[f64]) -> Vec<f32> {
    ps.iter().map(|p| p.ln() as f32).collect()
}

// ---------------------------------------------------------------- defaults and validation

#[test]
fn default_is_greedy_and_valid() {
    let p = SamplingParams::default();
    assert!(p.is_greedy());
    assert_eq!(p.top_p, 1.0);
    assert_eq!(p.repetition_penalty, 1.0);
    assert_eq!(p.logprobs, None);
    p.validate().expect("defaults validate");
    assert!(!params(0.7).is_greedy());
    assert!(params(1e-6).is_greedy(), "below vLLM's epsilon is greedy");
    assert!(params(f32::NAN).is_greedy(), "NaN must not reach the division");
}

#[test]
fn serde_roundtrip_and_partial_json() {
    let p = SamplingParams {
        temperature: 0.5,
        top_k: 4,
        logit_bias: vec![(3, -1.5)],
        seed: 99,
        logprobs: Some(2),
        ..Default::default()
    };
    let s = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<SamplingParams>(&s).unwrap(), p);
    let partial: SamplingParams = serde_json::from_str(r#"{"temperature":0.3}"#).unwrap();
    assert_eq!(partial, SamplingParams { temperature: 0.3, ..Default::default() });
}

#[test]
fn validation_names_field_and_value() {
    let cases: Vec<(SamplingParams, &str, &str)> = vec![
        (SamplingParams { temperature: -0.1, ..Default::default() }, "temperature", "-0.1"),
        (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature", "NaN"),
        (SamplingParams { temperature: f32::INFINITY, ..Default::default() }, "temperature", "inf"),
        (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p", "0"),
        (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p", "1.5"),
        (SamplingParams { top_p: f32::NAN, ..Default::default() }, "top_p", "NaN"),
        (SamplingParams { min_p: -0.01, ..Default::default() }, "min_p", "-0.01"),
        (SamplingParams { min_p: 1.01, ..Default::default() }, "min_p", "1.01"),
        (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty", "0"),
        (SamplingParams { repetition_penalty: -1.0, ..Default::default() }, "repetition_penalty", "-1"),
        (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty", "2.5"),
        (SamplingParams { frequency_penalty: -2.01, ..Default::default() }, "frequency_penalty", "-2.01"),
        (SamplingParams { logit_bias: vec![(7, 101.0)], ..Default::default() }, "logit_bias", "101 (token 7)"),
        (SamplingParams { logit_bias: vec![(7, f32::NAN)], ..Default::default() }, "logit_bias", "NaN"),
        (SamplingParams { logprobs: Some(21), ..Default::default() }, "logprobs", "21"),
    ];
    for (p, field, value) in cases {
        let err = p.validate().expect_err(field);
        assert_eq!(err.field, field);
        let msg = err.to_string();
        assert!(msg.contains(&format!("`{field}`")), "{msg}");
        assert!(msg.contains(value), "message {msg:?} should contain {value:?}");
    }
    // Boundaries that are allowed.
    let ok = SamplingParams {
        temperature: 2.0,
        top_p: 1.0,
        min_p: 1.0,
        repetition_penalty: 0.01,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        logit_bias: vec![(0, -100.0), (1, 100.0)],
        logprobs: Some(20),
        ..Default::default()
    };
    ok.validate().expect("boundaries are valid");
}

// ---------------------------------------------------------------- greedy and robustness

#[test]
fn greedy_argmax_ties_to_lowest_id() {
    let st = PenaltyState::default();
    assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0], &params(0.0), &st, 0).token, 1);
    assert_eq!(sample(&[5.0, 5.0], &params(0.0), &st, 0).token, 0);
    assert_eq!(sample(&[-0.0, 0.0, -1.0], &params(0.0), &st, 0).token, 0);
    // Greedy ignores the seed and the step.
    let p = SamplingParams { seed: 1234, ..params(0.0) };
    for step in 0..10 {
        assert_eq!(sample(&[0.0, 1.0, 0.5], &p, &st, step).token, 1);
    }
    assert_eq!(processed_probs(&[0.0, 1.0, 0.5], &p, &st), vec![0.0, 1.0, 0.0]);
}

#[test]
fn nan_is_never_chosen() {
    let st = PenaltyState::default();
    let logits = [f32::NAN, 1.0, f32::NAN, 0.5, f32::NAN];
    assert_eq!(sample(&logits, &params(0.0), &st, 0).token, 1);
    let hot = SamplingParams { temperature: 2.0, seed: 3, ..Default::default() };
    for step in 0..500 {
        let t = sample(&logits, &hot, &st, step).token;
        assert!(t == 1 || t == 3, "step {step} chose NaN token {t}");
    }
    let probs = processed_probs(&logits, &hot, &st);
    assert_eq!(probs[0], 0.0);
    assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    // With top-k/top-p paths too.
    let trunc = SamplingParams { temperature: 1.0, top_k: 2, top_p: 0.99, ..Default::default() };
    let probs = processed_probs(&logits, &trunc, &st);
    assert_eq!(probs[0] + probs[2] + probs[4], 0.0);
}

#[test]
fn degenerate_rows_fall_back_without_panicking() {
    let st = PenaltyState::default();
    let hot = SamplingParams { temperature: 1.0, top_k: 3, top_p: 0.5, min_p: 0.5, ..Default::default() };
    // All NaN: token 0.
    let nan = [f32::NAN; 4];
    assert_eq!(sample(&nan, &hot, &st, 0).token, 0);
    assert_eq!(sample(&nan, &params(0.0), &st, 0).token, 0);
    // All -inf: argmax of raw, lowest id.
    let ninf = [f32::NEG_INFINITY; 4];
    assert_eq!(sample(&ninf, &hot, &st, 0).token, 0);
    assert_eq!(processed_probs(&ninf, &hot, &st), vec![1.0, 0.0, 0.0, 0.0]);
    // Unvalidated -inf bias on everything: fall back to the raw argmax.
    let raw = [0.5, 2.0, 1.0];
    let banned = SamplingParams {
        logit_bias: vec![(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY), (2, f32::NEG_INFINITY)],
        ..hot.clone()
    };
    assert_eq!(sample(&raw, &banned, &st, 0).token, 1);
    // Repetition penalty overflowing to -inf (x * 2 below -f32::MAX).
    let huge = [-3e38, -3.1e38];
    let rep = SamplingParams { repetition_penalty: 2.0, ..params(0.0) };
    assert_eq!(sample(&huge, &rep, &PenaltyState::new(&[0, 1]), 0).token, 0);
    // +inf logits share the mass.
    let inf = [f32::INFINITY, 0.0, f32::INFINITY];
    let probs = processed_probs(&inf, &params(1.0), &st);
    assert_eq!(probs, vec![0.5, 0.0, 0.5]);
    // Empty row.
    assert_eq!(sample(&[], &hot, &st, 0).token, 0);
    assert!(processed_probs(&[], &hot, &st).is_empty());
    // Out-of-vocabulary ids in bias and history are ignored.
    let oov = SamplingParams { logit_bias: vec![(99, 50.0)], repetition_penalty: 3.0, ..params(0.0) };
    assert_eq!(sample(&raw, &oov, &PenaltyState::new(&[1000]), 0).token, 1);
    // min_p above 1 (unvalidated) still keeps the best token.
    let strict = SamplingParams { temperature: 1.0, min_p: 5.0, ..Default::default() };
    assert_eq!(processed_probs(&raw, &strict, &st), vec![0.0, 1.0, 0.0]);
    let strict_k = SamplingParams { top_k: 2, ..strict };
    assert_eq!(processed_probs(&raw, &strict_k, &st), vec![0.0, 1.0, 0.0]);
    // Infinite temperature (unvalidated): uniform over finite tokens, no NaN.
    let inf_t = SamplingParams { temperature: f32::INFINITY, ..Default::default() };
    let probs = processed_probs(&[1.0, f32::NEG_INFINITY, -1.0], &inf_t, &st);
    assert_eq!(probs, vec![0.5, 0.0, 0.5]);
}

// ---------------------------------------------------------------- each knob, by hand

#[test]
fn temperature_scales_logits() {
    // softmax([0, ln 2] / 0.5) = softmax([0, 2 ln 2]) = [1/5, 4/5].
    let probs = processed_probs(&[0.0, 2f32.ln()], &params(0.5), &PenaltyState::default());
    assert_probs(&probs, &[0.2, 0.8], 1e-6);
    // T = 1 is the plain softmax.
    let probs = processed_probs(&[1.0, 2.0, 3.0], &params(1.0), &PenaltyState::default());
    assert_probs(&probs, &softmax(&[1.0, 2.0, 3.0]), 1e-6);
}

#[test]
fn logit_bias_adds_before_everything() {
    let st = PenaltyState::default();
    let p = SamplingParams { logit_bias: vec![(0, 5.0)], ..params(0.0) };
    assert_eq!(sample(&[1.0, 2.0, 3.0], &p, &st, 0).token, 0);
    // Listed twice: both apply (1 + 1.5 + 1.5 = 4 > 3).
    let twice = SamplingParams { logit_bias: vec![(0, 1.5), (0, 1.5)], ..params(0.0) };
    assert_eq!(sample(&[1.0, 2.0, 3.0], &twice, &st, 0).token, 0);
    // Under sampling: softmax([1 + 1, 2, 3 - 1]).
    let s = SamplingParams { logit_bias: vec![(0, 1.0), (2, -1.0)], ..params(1.0) };
    assert_probs(&processed_probs(&[1.0, 2.0, 3.0], &s, &st), &softmax(&[2.0, 2.0, 2.0]), 1e-6);
    // Bias happens before the repetition penalty: (1 + 3) / 2 = 2 vs 2.5.
    let order = SamplingParams { logit_bias: vec![(0, 3.0)], repetition_penalty: 2.0, ..params(0.0) };
    assert_eq!(sample(&[1.0, 2.5], &order, &PenaltyState::new(&[0]), 0).token, 1);
}

#[test]
fn repetition_penalty_hf_semantics_over_prompt_and_output() {
    // Positive logits divided, negative multiplied, untouched tokens unchanged.
    let logits = [2.0, -1.0, 0.5, 1.0];
    let mut st = PenaltyState::new(&[0, 1, 0, 0]);
    let p = SamplingParams { repetition_penalty: 2.0, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &softmax(&[1.0, -2.0, 0.5, 1.0]), 1e-6);
    // Output tokens are penalised too, once however often they appear.
    st.push_output(2);
    st.push_output(2);
    assert_probs(&processed_probs(&logits, &p, &st), &softmax(&[1.0, -2.0, 0.25, 1.0]), 1e-6);
    // Greedy flips when the prompt contains the favourite.
    let g = SamplingParams { repetition_penalty: 2.0, ..params(0.0) };
    assert_eq!(sample(&[2.0, 1.5], &g, &PenaltyState::new(&[0]), 0).token, 1);
    assert_eq!(sample(&[2.0, 1.5], &g, &PenaltyState::new(&[]), 0).token, 0);
    // A penalty below 1 rewards repetition.
    let reward = SamplingParams { repetition_penalty: 0.5, ..params(0.0) };
    assert_eq!(sample(&[2.0, 1.5], &reward, &PenaltyState::new(&[1]), 0).token, 1);
}

#[test]
fn presence_and_frequency_only_on_output() {
    let logits = [1.0, 1.0, 1.0];
    let mut st = PenaltyState::new(&[0, 0, 0]);
    st.push_output(1);
    st.push_output(1);
    let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..params(1.0) };
    // Token 0 (prompt only) untouched; token 1: 1 - 0.5 - 2 * 0.25 = 0.
    assert_probs(&processed_probs(&logits, &p, &st), &softmax(&[1.0, 0.0, 1.0]), 1e-6);
    // Frequency grows with each repeat; presence does not.
    st.push_output(1);
    let freq = SamplingParams { frequency_penalty: 1.0, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &freq, &st), &softmax(&[1.0, -2.0, 1.0]), 1e-6);
    let pres = SamplingParams { presence_penalty: 1.0, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &pres, &st), &softmax(&[1.0, 0.0, 1.0]), 1e-6);
    // Negative penalties encourage.
    let enc = SamplingParams { presence_penalty: -2.0, ..params(0.0) };
    assert_eq!(sample(&[1.0, 0.0, 1.5], &enc, &st, 0).token, 1);
    // Repetition, then presence/frequency (vLLM order): (1 / 2) - 1 = -0.5 for token 1.
    let both = SamplingParams { repetition_penalty: 2.0, presence_penalty: 1.0, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &both, &st), &softmax(&[0.5, -0.5, 1.0]), 1e-6);
}

#[test]
fn top_k_keeps_k_best_and_ties() {
    let st = PenaltyState::default();
    let p = SamplingParams { top_k: 2, ..params(1.0) };
    let probs = processed_probs(&[1.0, 2.0, 3.0, 4.0], &p, &st);
    let want = softmax(&[3.0, 4.0]);
    assert_probs(&probs, &[0.0, 0.0, want[0], want[1]], 1e-6);
    // HF/vLLM keep every token tied with the k-th.
    let tie = SamplingParams { top_k: 1, ..params(1.0) };
    assert_probs(&processed_probs(&[1.0, 3.0, 3.0, 2.0], &tie, &st), &[0.0, 0.5, 0.5, 0.0], 1e-6);
    // k >= vocab is off.
    let big = SamplingParams { top_k: 10, ..params(1.0) };
    assert_probs(&processed_probs(&[1.0, 2.0], &big, &st), &softmax(&[1.0, 2.0]), 1e-6);
    // Many ties across compactions: all 10 000 equal logits tie with the 5th best.
    let flat = vec![0.25f32; 10_000];
    let probs = processed_probs(&flat, &SamplingParams { top_k: 5, ..params(1.0) }, &st);
    assert!(probs.iter().all(|&x| (x - 1e-4).abs() < 1e-9));
    // -inf tokens never fill a top-k slot.
    let probs = processed_probs(&[f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY], &p, &st);
    assert_eq!(probs, vec![0.0, 1.0, 0.0]);
}

#[test]
fn top_p_keeps_smallest_prefix_reaching_p() {
    let st = PenaltyState::default();
    let logits = ln(&[0.05, 0.5, 0.15, 0.3]);
    let with = |top_p| processed_probs(&logits, &SamplingParams { top_p, ..params(1.0) }, &st);
    // Desc order 0.5, 0.3, 0.15, 0.05; keep while the mass before the token is < p.
    assert_probs(&with(0.4), &[0.0, 1.0, 0.0, 0.0], 1e-6);
    assert_probs(&with(0.75), &[0.0, 0.625, 0.0, 0.375], 1e-6);
    assert_probs(&with(0.85), &[0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], 1e-6);
    assert_probs(&with(0.99), &[0.05, 0.5, 0.15, 0.3], 1e-6);
    // Temperature first: T = 0.5 squares the ratios: [0.0025, 0.25, 0.0225, 0.09] / 0.365.
    let t = processed_probs(&logits, &SamplingParams { top_p: 0.9, ..params(0.5) }, &st);
    // 0.25/0.365 = 0.685 < 0.9, + 0.09/0.365 = 0.932 >= 0.9: keep two.
    assert_probs(&t, &[0.0, 0.25 / 0.34, 0.0, 0.09 / 0.34], 1e-6);
}

#[test]
fn min_p_relative_to_best() {
    let st = PenaltyState::default();
    let logits = ln(&[0.05, 0.5, 0.15, 0.3]);
    // Threshold 0.2 * 0.5 = 0.1: drops 0.05 only.
    let p = SamplingParams { min_p: 0.2, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], 1e-6);
    // Threshold 0.7 * 0.5 = 0.35: only the best.
    let p = SamplingParams { min_p: 0.7, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.0, 1.0, 0.0, 0.0], 1e-6);
}

#[test]
fn knobs_compose_in_vllm_order() {
    let st = PenaltyState::default();
    // probs [0.4, 0.25, 0.2, 0.1, 0.05]; top_k 4 → [0.4, .25, .2, .1]/0.95;
    // top_p 0.8 on that: masses before: 0, .421, .684, .895 → keep 3 → [.4, .25, .2]/.85;
    // min_p 0.55: threshold 0.55 * 0.4 = 0.22 → keep 0.4, 0.25.
    let logits = ln(&[0.25, 0.05, 0.4, 0.1, 0.2]);
    let p = SamplingParams { top_k: 4, top_p: 0.8, min_p: 0.55, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.25 / 0.65, 0.0, 0.4 / 0.65, 0.0, 0.0], 1e-6);
    // Without min_p three survive.
    let p = SamplingParams { top_k: 4, top_p: 0.8, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.25 / 0.85, 0.0, 0.4 / 0.85, 0.0, 0.2 / 0.85], 1e-6);
    // Top-p renormalises over the top-k set: with top_k 2 ([.4, .25]/.65) and top_p 0.6, 0.4/0.65
    // = 0.615 ≥ 0.6 stops after one token (over the full vocab it would keep two).
    let p = SamplingParams { top_k: 2, top_p: 0.6, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.0, 0.0, 1.0, 0.0, 0.0], 1e-6);
    let p = SamplingParams { top_p: 0.6, ..params(1.0) };
    assert_probs(&processed_probs(&logits, &p, &st), &[0.25 / 0.65, 0.0, 0.4 / 0.65, 0.0, 0.0], 1e-6);
}

// ---------------------------------------------------------------- HF transformers golden cases

/// Rebuilds the hashed logits row of `gen_hf_reference.py` bit for bit.
fn hashed_logits(n: usize, salt: u64, scale: f64, mul: u64, salt_mul: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i.wrapping_mul(mul).wrapping_add(salt * salt_mul)) % (1u64 << 32);
            (h as f64 / 2f64.powi(32) * scale - scale / 2.0) as f32
        })
        .collect()
}

#[test]
fn matches_hf_transformers_logits_processors() {
    let doc: serde_json::Value =
        serde_json::from_str(include_str!("testdata/hf_reference.json")).expect("golden file parses");
    let mul = doc["hash"]["mul"].as_u64().unwrap();
    let salt_mul = doc["hash"]["salt_mul"].as_u64().unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let vocab = c["vocab"].as_u64().unwrap() as usize;
        let logits = hashed_logits(vocab, c["salt"].as_u64().unwrap(), c["scale"].as_f64().unwrap(), mul, salt_mul);
        let p = SamplingParams {
            temperature: c["temperature"].as_f64().unwrap() as f32,
            top_k: c["top_k"].as_u64().unwrap() as usize,
            top_p: c["top_p"].as_f64().unwrap() as f32,
            min_p: c["min_p"].as_f64().unwrap() as f32,
            repetition_penalty: c["repetition_penalty"].as_f64().unwrap() as f32,
            presence_penalty: c["presence_penalty"].as_f64().unwrap() as f32,
            frequency_penalty: c["frequency_penalty"].as_f64().unwrap() as f32,
            logit_bias: c["logit_bias"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| (b[0].as_u64().unwrap() as u32, b[1].as_f64().unwrap() as f32))
                .collect(),
            seed: 5,
            logprobs: Some(5),
        };
        p.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut st = PenaltyState::new(&ids(&c["prompt"]));
        for t in ids(&c["output"]) {
            st.push_output(t);
        }
        let exp = &c["expected"];
        let got = sample(&logits, &p, &st, 0);
        let probs = processed_probs(&logits, &p, &st);
        if let Some(g) = exp.get("greedy_token") {
            assert_eq!(got.token as u64, g.as_u64().unwrap(), "{name}: greedy token");
            assert_eq!(probs[got.token as usize], 1.0, "{name}: one-hot");
        } else {
            let kept: Vec<u64> = (0..vocab).filter(|&i| probs[i] > 0.0).map(|i| i as u64).collect();
            assert_eq!(kept.len() as u64, exp["kept_count"].as_u64().unwrap(), "{name}: support size");
            assert_eq!(kept.iter().sum::<u64>(), exp["kept_id_sum"].as_u64().unwrap(), "{name}: support ids");
            assert_eq!(kept.iter().map(|i| i * i).sum::<u64>(), exp["kept_id_sq_sum"].as_u64().unwrap(), "{name}");
            for e in exp["probs"].as_array().unwrap() {
                let (id, want) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap());
                let g = probs[id] as f64;
                assert!((g - want).abs() <= 1e-7 + 1e-4 * want, "{name}: prob[{id}] = {g}, HF {want}");
            }
            assert!(probs[got.token as usize] > 0.0, "{name}: sampled a removed token");
            assert!((probs.iter().map(|&x| x as f64).sum::<f64>() - 1.0).abs() < 1e-5, "{name}: sums to 1");
        }
        let want_top = exp["top5_raw_logprobs"].as_array().unwrap();
        assert_eq!(got.top_logprobs.len(), 5, "{name}");
        for (g, w) in got.top_logprobs.iter().zip(want_top) {
            assert_eq!(g.0 as u64, w[0].as_u64().unwrap(), "{name}: top logprob ids {:?}", got.top_logprobs);
            assert!((g.1 as f64 - w[1].as_f64().unwrap()).abs() < 1e-4, "{name}: top logprob {g:?} vs {w}");
        }
    }
}

// ---------------------------------------------------------------- determinism and frequencies

#[test]
fn uniform_is_counter_based() {
    for seed in [0u64, 1, 42, u64::MAX] {
        for step in [0u64, 1, 2, 1000, u64::MAX] {
            let u = uniform(seed, step);
            assert!((0.0..1.0).contains(&u), "{u}");
            assert_eq!(u.to_bits(), uniform(seed, step).to_bits(), "same (seed, step), same value");
        }
        assert_ne!(uniform(seed, 0), uniform(seed, 1));
    }
    assert_ne!(uniform(0, 7), uniform(1, 7));
    // Mean and spread of 100k draws over steps (deterministic, so a wide margin cannot flake).
    let n = 100_000;
    let xs: Vec<f64> = (0..n).map(|s| uniform(9, s) as f64).collect();
    let mean = xs.iter().sum::<f64>() / n as f64;
    assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    let below_tenth = xs.iter().filter(|&&x| x < 0.1).count() as f64 / n as f64;
    assert!((below_tenth - 0.1).abs() < 0.005, "{below_tenth}");
}

#[test]
fn seeded_sampling_is_deterministic_and_seed_sensitive() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) * 0.01).collect();
    let st = PenaltyState::new(&[1, 2, 3]);
    let p = SamplingParams { temperature: 1.0, seed: 77, top_p: 0.95, ..Default::default() };
    let a: Vec<u32> = (0..64).map(|s| sample(&logits, &p, &st, s).token).collect();
    let b: Vec<u32> = (0..64).map(|s| sample(&logits, &p, &st, s).token).collect();
    assert_eq!(a, b, "same inputs, same tokens");
    // Order of evaluation does not matter (counter-based, no hidden state).
    let rev: Vec<u32> = (0..64).rev().map(|s| sample(&logits, &p, &st, s).token).collect();
    assert_eq!(a, rev.into_iter().rev().collect::<Vec<_>>());
    let distinct_steps: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct_steps.len() > 40, "steps give different draws: {}", distinct_steps.len());
    let other: Vec<u32> =
        (0..64).map(|s| sample(&logits, &SamplingParams { seed: 78, ..p.clone() }, &st, s).token).collect();
    let same = a.iter().zip(&other).filter(|(x, y)| x == y).count();
    assert!(same < 8, "another seed gives another sequence ({same} of 64 equal)");
}

/// Upper tail of the chi-square distribution with `k` degrees of freedom (series for the lower
/// regularised gamma; accurate for the moderate `x` used here).
fn chi2_sf(x: f64, k: usize) -> f64 {
    let a = k as f64 / 2.0;
    let z = x / 2.0;
    let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, 1.0);
    while term > 1e-16 * sum {
        term *= z / (a + n);
        sum += term;
        n += 1.0;
    }
    let ln_gamma_a = ln_gamma(a);
    1.0 - (-z + a * z.ln() - ln_gamma_a).exp() * sum
}

/// Lanczos approximation (g = 7, n = 9), plenty for half-integers up to a few hundred.
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let t = x + 7.5;
    let mut s = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        s += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + s.ln()
}

#[test]
fn chi2_helper_matches_known_quantiles() {
    // Reference values: df 5 at 1e-6 is 35.89, df 9 at 1e-3 is 27.88.
    assert!((chi2_sf(35.89, 5) - 1e-6).abs() < 2e-8);
    assert!((chi2_sf(27.877, 9) - 1e-3).abs() < 1e-5);
}

/// Draws `n` tokens over steps 0..n and checks the frequencies against `processed_probs` with a
/// chi-square test at p = 1e-6 (draws are deterministic, so this cannot flake; a wrong CDF or
/// truncation gives statistics in the thousands).
fn assert_frequencies_match(logits: &[f32], p: &SamplingParams, st: &PenaltyState, n: u64) {
    let probs = processed_probs(logits, p, st);
    let mut counts = vec![0u64; logits.len()];
    for step in 0..n {
        counts[sample(logits, p, st, step).token as usize] += 1;
    }
    let mut chi2 = 0.0;
    let mut df = 0usize;
    for (i, (&c, &q)) in counts.iter().zip(&probs).enumerate() {
        if q == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 but was drawn {c} times");
            continue;
        }
        let e = q as f64 * n as f64;
        assert!(e >= 5.0, "test design: expected count {e} too small for chi-square");
        chi2 += (c as f64 - e).powi(2) / e;
        df += 1;
    }
    let pval = chi2_sf(chi2, df.saturating_sub(1).max(1));
    assert!(pval > 1e-6, "chi2 = {chi2} over {df} cells (p = {pval}); counts {counts:?} probs {probs:?}");
}

#[test]
fn frequencies_match_processed_probs_dense() {
    let logits = [0.3, -1.0, 2.0, 0.0, 1.1, -0.4, 0.9, 1.5];
    let p = SamplingParams { temperature: 0.8, seed: 11, ..Default::default() };
    assert_frequencies_match(&logits, &p, &PenaltyState::default(), 200_000);
    let p = SamplingParams { temperature: 1.3, min_p: 0.1, seed: 12, ..Default::default() };
    assert_frequencies_match(&logits, &p, &PenaltyState::default(), 200_000);
}

#[test]
fn frequencies_match_processed_probs_truncated_and_penalised() {
    let logits: Vec<f32> = (0..40).map(|i| ((i * 7 % 13) as f32) * 0.3 - 1.0).collect();
    let mut st = PenaltyState::new(&[0, 5, 12]);
    st.push_output(12);
    st.push_output(3);
    let p = SamplingParams {
        temperature: 0.9,
        top_k: 25,
        top_p: 0.9,
        min_p: 0.05,
        repetition_penalty: 1.2,
        presence_penalty: 0.4,
        frequency_penalty: 0.3,
        logit_bias: vec![(7, 0.5)],
        seed: 2024,
        logprobs: None,
    };
    assert_frequencies_match(&logits, &p, &st, 300_000);
}

#[test]
fn sample_agrees_with_inverse_cdf_of_processed_probs() {
    // The draw is defined as the inverse CDF over ascending ids; rejection sampling will rely on it.
    // Sparse support (top-p) and dense support over several draw blocks (temperature only).
    let st = PenaltyState::default();
    for (vocab, p) in [
        (300, SamplingParams { temperature: 0.7, top_p: 0.8, seed: 5, ..Default::default() }),
        (3000, SamplingParams { temperature: 1.5, seed: 6, ..Default::default() }),
        (3000, SamplingParams { temperature: 1.0, min_p: 0.3, seed: 7, ..Default::default() }),
    ] {
        let logits: Vec<f32> = (0..vocab).map(|i| ((i * 31 % 17) as f32) * 0.25).collect();
        let probs = processed_probs(&logits, &p, &st);
        let mut seen = std::collections::HashSet::new();
        for step in 0..2000 {
            let u = uniform(p.seed, step) as f64;
            let mut cum = 0.0;
            let mut want = None;
            for (i, &q) in probs.iter().enumerate() {
                cum += q as f64;
                if q > 0.0 && cum > u {
                    want = Some(i as u32);
                    break;
                }
            }
            let got = sample(&logits, &p, &st, step).token;
            seen.insert(got / 512);
            // Only a u within rounding of a CDF step may disagree, and then only with a neighbour.
            if let Some(w) = want {
                if got != w {
                    let edge: f64 = probs[..=got.min(w) as usize].iter().map(|&x| x as f64).sum();
                    assert!((edge - u).abs() < 1e-5, "vocab {vocab} step {step}: got {got}, inverse CDF says {w}");
                }
            }
        }
        if vocab > 512 {
            assert!(seen.len() >= 5, "draws landed in every block: {seen:?}");
        }
    }
}

// ---------------------------------------------------------------- large vocabularies

/// Reference truncation by full sort, written independently of the fast paths.
fn naive_probs(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
    let t = p.temperature as f64;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    let mut keep = vec![true; logits.len()];
    if p.top_k > 0 && p.top_k < logits.len() {
        let kth = logits[order[p.top_k - 1]];
        for i in 0..logits.len() {
            keep[i] = logits[i] >= kth;
        }
    }
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / t).collect();
    let z: f64 = (0..logits.len()).filter(|&i| keep[i]).map(|i| scaled[i].exp()).sum();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let survivors: Vec<usize> = order.iter().copied().filter(|&i| keep[i]).collect();
        for i in survivors {
            if cum >= p.top_p as f64 {
                keep[i] = false;
            } else {
                cum += scaled[i].exp() / z;
            }
        }
    }
    let best = scaled[order[0]];
    if p.min_p > 0.0 {
        for i in 0..logits.len() {
            keep[i] = keep[i] && (scaled[i] - best).exp() >= p.min_p as f64;
        }
    }
    let z: f64 = (0..logits.len()).filter(|&i| keep[i]).map(|i| scaled[i].exp()).sum();
    (0..logits.len()).map(|i| if keep[i] { scaled[i].exp() / z } else { 0.0 }).collect()
}

#[test]
fn fast_paths_match_full_sort_on_large_vocab() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let st = PenaltyState::default();
    for (vocab, spread) in [(49_152usize, 12.0f32), (151_936, 20.0), (32_000, 1.0)] {
        let logits: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>() * spread).collect();
        for p in [
            SamplingParams { temperature: 1.0, top_k: 40, ..Default::default() },
            SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() },
            SamplingParams { temperature: 1.0, top_p: 0.3, ..Default::default() },
            SamplingParams { temperature: 1.2, top_k: 500, top_p: 0.95, min_p: 0.01, ..Default::default() },
            SamplingParams { temperature: 0.9, min_p: 0.2, ..Default::default() },
        ] {
            let got = processed_probs(&logits, &p, &st);
            let want = naive_probs(&logits, &p);
            let mismatched = got.iter().zip(&want).filter(|(g, w)| (**g > 0.0) != (**w > 0.0)).count();
            assert_eq!(mismatched, 0, "vocab {vocab} {p:?}: support differs");
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!((g as f64 - w).abs() <= 1e-6 + 1e-4 * w, "vocab {vocab} {p:?}: prob[{i}] {g} vs {w}");
            }
        }
    }
}

// ---------------------------------------------------------------- logprobs

#[test]
fn logprobs_are_raw_and_sorted() {
    let logits = [1.0, 3.0, 2.0, 3.0, -1.0];
    let mut st = PenaltyState::new(&[1]);
    st.push_output(3);
    // Heavy processing must not change the reported logprobs.
    let p = SamplingParams {
        temperature: 0.3,
        repetition_penalty: 1.7,
        presence_penalty: 1.0,
        logit_bias: vec![(4, 10.0)],
        logprobs: Some(5),
        seed: 1,
        ..Default::default()
    };
    let s = sample(&logits, &p, &st, 0);
    let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    let want = |i: usize| (logits[i] as f64 - lse) as f32;
    assert_eq!(s.token, 4, "bias makes token 4 overwhelming");
    assert!((s.logprob - want(4)).abs() < 1e-6);
    let ids: Vec<u32> = s.top_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![1, 3, 2, 0, 4], "desc by logprob, ties by id");
    for &(id, lp) in &s.top_logprobs {
        assert!((lp - want(id as usize)).abs() < 1e-6);
    }
    let total: f64 = s.top_logprobs.iter().map(|e| (e.1 as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6, "all five logprobs exponentiate to 1: {total}");
    // n smaller than the vocab; None and Some(0) give no alternatives.
    let two = sample(&logits, &SamplingParams { logprobs: Some(2), ..p.clone() }, &st, 0);
    assert_eq!(two.top_logprobs.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3]);
    let none = sample(&logits, &SamplingParams { logprobs: None, ..p.clone() }, &st, 0);
    assert!(none.top_logprobs.is_empty());
    assert!(none.logprob.is_nan(), "not computed without logprobs");
    let zero = sample(&logits, &SamplingParams { logprobs: Some(0), ..p }, &st, 0);
    assert!(zero.top_logprobs.is_empty());
    assert!((zero.logprob - want(4)).abs() < 1e-6, "Some(0) still reports the chosen token's logprob");
    // n larger than the vocab lists the whole vocab.
    let all = sample(&[0.0, 0.0], &SamplingParams { logprobs: Some(20), ..params(0.0) }, &st, 0);
    assert_eq!(all.top_logprobs.len(), 2);
    assert!((all.logprob - 0.5f32.ln()).abs() < 1e-6);
}

#[test]
fn logprobs_sum_to_one_on_large_vocab() {
    let logits: Vec<f32> = (0..50_000).map(|i| ((i * 7919 % 1000) as f32) * 0.01).collect();
    let p = SamplingParams { temperature: 1.0, logprobs: Some(20), seed: 9, ..Default::default() };
    let st = PenaltyState::default();
    let s = sample(&logits, &p, &st, 3);
    // Every token's logprob is x - lse, so summing exp over the vocab from the chosen one's offset:
    let lse = logits[s.token as usize] - s.logprob;
    let total: f64 = logits.iter().map(|&x| ((x - lse) as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-4, "{total}");
    assert_eq!(s.top_logprobs.len(), 20);
    assert!(s.top_logprobs.windows(2).all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0)));
    // The best logits are 9.99 (ids with i*7919 % 1000 == 999).
    assert!((s.top_logprobs[0].1 - (9.99 - lse)).abs() < 1e-5);
}

#[test]
fn nan_logprobs_are_neg_infinity() {
    let s = sample(&[f32::NAN, 0.0, 0.0], &SamplingParams { logprobs: Some(3), ..params(0.0) }, &Default::default(), 0);
    assert_eq!(s.token, 1);
    assert!((s.logprob - 0.5f32.ln()).abs() < 1e-6);
    assert_eq!(s.top_logprobs[2], (0, f32::NEG_INFINITY));
}
