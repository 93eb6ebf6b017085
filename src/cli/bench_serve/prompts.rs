//! The prompts of a load run: random token ids with input and output lengths drawn from ranges
//! (exact prompt lengths on any server that accepts token-id prompts), or a JSONL dataset.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What one request sends.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptBody {
    /// Token ids (the completions endpoint takes them as they are).
    Ids(Vec<u32>),
    Text(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub body: PromptBody,
    /// `max_tokens` of the request.
    pub output_len: usize,
}

/// A length range `lo..=hi`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LenRange {
    pub lo: usize,
    pub hi: usize,
}

impl LenRange {
    /// `len` alone, or `len` ± `ratio` × `len` (vLLM's `--random-range-ratio`).
    pub fn around(len: usize, ratio: f64) -> Result<Self, String> {
        if !(0.0..1.0).contains(&ratio) {
            return Err(format!("the range ratio ({ratio}) must be in [0, 1)"));
        }
        let d = (len as f64 * ratio).floor() as usize;
        Ok(LenRange { lo: (len - d).max(1), hi: len + d })
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> usize {
        rng.random_range(self.lo..=self.hi)
    }
}

/// `n` prompts of random token ids in `token_ids` (a range every tokenizer of the target model
/// has), lengths drawn from `input` and `output`; the same seed gives the same prompts.
pub fn random(
    n: usize,
    input: LenRange,
    output: LenRange,
    token_ids: std::ops::Range<u32>,
    seed: u64,
) -> Result<Vec<Prompt>, String> {
    if token_ids.is_empty() {
        return Err("the random token-id range is empty".into());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let len = input.draw(&mut rng);
            let ids = (0..len).map(|_| rng.random_range(token_ids.clone())).collect();
            Prompt { body: PromptBody::Ids(ids), output_len: output.draw(&mut rng) }
        })
        .collect())
}

/// Prompts from JSONL text: one object per line with `prompt` (a string or a list of token ids)
/// and optionally `output_len` (else `default_output`). Lines are used in order and repeated
/// when `n` exceeds them.
pub fn from_jsonl(text: &str, n: usize, default_output: usize) -> Result<Vec<Prompt>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        let body = match v.get("prompt") {
            Some(serde_json::Value::String(s)) => PromptBody::Text(s.clone()),
            Some(serde_json::Value::Array(a)) => PromptBody::Ids(
                a.iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| format!("line {}: `prompt` must be a string or a list of token ids", i + 1))?,
            ),
            _ => return Err(format!("line {}: no `prompt` (a string or a list of token ids)", i + 1)),
        };
        let output_len = match v.get("output_len") {
            None => default_output,
            Some(x) => {
                x.as_u64().filter(|&x| x > 0).ok_or_else(|| format!("line {}: bad `output_len`", i + 1))? as usize
            }
        };
        rows.push(Prompt { body, output_len });
    }
    if rows.is_empty() {
        return Err("the dataset has no prompts".into());
    }
    Ok(rows.iter().cycle().take(n).cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_are_seeded_and_within_their_ranges() {
        let input = LenRange::around(100, 0.5).unwrap();
        assert_eq!(input, LenRange { lo: 50, hi: 150 });
        let output = LenRange { lo: 4, hi: 4 };
        let a = random(20, input, output, 10..20, 3).unwrap();
        assert_eq!(a, random(20, input, output, 10..20, 3).unwrap());
        assert_ne!(a, random(20, input, output, 10..20, 4).unwrap());
        for p in &a {
            let PromptBody::Ids(ids) = &p.body else { panic!("ids") };
            assert!((50..=150).contains(&ids.len()) && ids.iter().all(|t| (10..20).contains(t)));
            assert_eq!(p.output_len, 4);
        }
        assert!(LenRange::around(10, 1.0).is_err());
    }

    #[test]
    fn jsonl_rows_repeat_and_bad_lines_are_named() {
        let text = "{\"prompt\": \"hi\"}\n\n{\"prompt\": [1, 2], \"output_len\": 3}\n";
        let p = from_jsonl(text, 3, 8).unwrap();
        assert_eq!(p[0], Prompt { body: PromptBody::Text("hi".into()), output_len: 8 });
        assert_eq!(p[1], Prompt { body: PromptBody::Ids(vec![1, 2]), output_len: 3 });
        assert_eq!(p[2], p[0]);
        assert!(from_jsonl("{\"text\": 1}", 1, 8).unwrap_err().contains("line 1"));
        assert!(from_jsonl("", 1, 8).is_err());
    }
}
