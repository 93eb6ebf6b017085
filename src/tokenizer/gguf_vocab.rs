//! Builds a HF `tokenizers::Tokenizer` from GGUF tokenizer metadata (gpt2-style byte-level BPE),
//! reproducing llama.cpp's tokenization: its pre-tokenizer regexes per `tokenizer.ggml.pre`,
//! its special-token parsing, BOS handling and end-of-generation set. Owns only the translation
//! from GGUF keys to a tokenizer; GGUF parsing lives in `model::gguf`.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::TokenizerBundle;
use crate::model::gguf::GgufFile;
use crate::model::ModelError;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_UNKNOWN: i32 = 2;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;

/// Token texts that end generation, as in llama.cpp's `special_eog_ids`: end-of-turn markers,
/// plus the fill-in-the-middle pad/repo/file-separator tokens that llama.cpp also stops on.
/// Matched by text whatever the token's type, as llama.cpp does.
const END_OF_GENERATION: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<end_of_turn>",
    "<|end|>",
    "<EOT>",
    "<end_of_utterance>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

// Pre-tokenizer regexes, as llama.cpp's `llm_tokenizer_bpe` applies them: each splits the pieces
// the previous one produced, keeping both matches and the text between them.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How one `tokenizer.ggml.pre` value tokenizes.
struct PreTokenizer {
    regexes: &'static [&'static str],
    /// Whole pieces found in the vocabulary skip BPE merging (llama.cpp `ignore_merges`).
    ignore_merges: bool,
    /// BOS default when `tokenizer.ggml.add_bos_token` is absent.
    add_bos: bool,
}

/// The pre-tokenizer llama.cpp picks for `pre` (`llama_vocab::impl::load`), or `None` when it is
/// one we do not reproduce.
fn pre_tokenizer(pre: &str) -> Option<PreTokenizer> {
    let p = |regexes, ignore_merges, add_bos| Some(PreTokenizer { regexes, ignore_merges, add_bos });
    match pre {
        "default" => p(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => p(&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => p(&[LLAMA3], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            p(&[r"\p{N}", GPT2], false, false)
        }
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" => p(&[GPT2], false, false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => p(&[QWEN2], false, false),
        _ => None,
    }
}

fn err(origin: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer { file: origin.to_path_buf(), msg: msg.into() }
}

/// Build the tokenizer of a GGUF file whose `tokenizer.ggml.model` is `gpt2`.
pub fn tokenizer_from_gguf(g: &GgufFile, origin: &Path) -> Result<TokenizerBundle, ModelError> {
    match g.get_str("tokenizer.ggml.model")? {
        Some("gpt2") => {}
        other => {
            return Err(err(
                origin,
                format!("tokenizer.ggml.model is {other:?}; only gpt2-style byte-level BPE is supported"),
            ))
        }
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?.ok_or_else(|| err(origin, "no tokenizer.ggml.tokens"))?;
    if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
        return Err(err(origin, format!("tokenizer.ggml.tokens has {} entries", tokens.len())));
    }
    let types = match g.get_i32_array("tokenizer.ggml.token_type")? {
        Some(t) if t.len() == tokens.len() => t,
        Some(t) => {
            return Err(err(
                origin,
                format!("tokenizer.ggml.token_type has {} entries for {} tokens", t.len(), tokens.len()),
            ))
        }
        None => vec![1; tokens.len()],
    };
    let merges_raw =
        g.get_str_array("tokenizer.ggml.merges")?.ok_or_else(|| err(origin, "no tokenizer.ggml.merges"))?;

    let pre_name = g.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre = pre_tokenizer(pre_name).unwrap_or_else(|| {
        tracing::warn!(
            file = %origin.display(),
            pre = pre_name,
            "unknown tokenizer.ggml.pre; using the GPT-2 pre-tokenizer, tokenization may differ from llama.cpp"
        );
        PreTokenizer { regexes: &[GPT2], ignore_merges: false, add_bos: false }
    });

    let mut vocab = Vocab::default();
    let mut duplicates = 0usize;
    for (id, t) in tokens.iter().enumerate() {
        // First occurrence wins, as in llama.cpp's `token_to_id`; later ids still decode.
        if vocab.contains_key(t) {
            duplicates += 1;
        } else {
            vocab.insert(t.clone(), id as u32);
        }
    }
    if duplicates > 0 {
        tracing::warn!(file = %origin.display(), duplicates, "GGUF vocabulary has duplicate token texts");
    }

    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        // llama.cpp splits at the first space after the first character, so a merge whose left
        // token is a space still parses.
        let first = m.chars().next().map_or(0, char::len_utf8);
        let split = m[first..].find(' ').map(|p| p + first);
        let Some(at) = split else {
            return Err(err(origin, format!("tokenizer.ggml.merges[{i}] = {m:?} is not two space-separated tokens")));
        };
        merges.push((m[..at].to_string(), m[at + 1..].to_string()));
    }

    // Control (and unknown) tokens are special: parsed from text, dropped by
    // decode(skip_special). User-defined tokens are parsed from text too but stay visible when
    // decoding, as HF marks them (`special: false`): a reasoning parser must see `<think>`.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (id, (text, &ty)) in tokens.iter().zip(&types).enumerate() {
        if text.is_empty() || vocab.get(text) != Some(&(id as u32)) {
            continue;
        }
        match ty {
            TOKEN_CONTROL | TOKEN_UNKNOWN => special.push(AddedToken::from(text.clone(), true).normalized(false)),
            TOKEN_USER_DEFINED => user.push(AddedToken::from(text.clone(), false).normalized(false)),
            _ => {}
        }
    }

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| err(origin, format!("building BPE model: {e}")))?;

    let mut pieces: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in pre.regexes {
        let split = Split::new(SplitPattern::Regex((*re).to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| err(origin, format!("pre-tokenizer regex {re:?}: {e}")))?;
        pieces.push(split.into());
    }
    // Regexes already split the text; ByteLevel only maps bytes to the GPT-2 alphabet.
    pieces.push(ByteLevel::new(false, true, false).into());

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(pieces)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&user);

    let id_key = |k: &str| -> Result<Option<u32>, ModelError> {
        match g.get_u32(k)? {
            Some(id) if (id as usize) < tokens.len() => Ok(Some(id)),
            // llama.cpp writes -1 (as u32 max) or out-of-range ids for "none".
            Some(id) => {
                tracing::warn!(file = %origin.display(), key = k, id, "token id out of range; ignored");
                Ok(None)
            }
            None => Ok(None),
        }
    };
    let bos_id = id_key("tokenizer.ggml.bos_token_id")?;
    let eos_id = id_key("tokenizer.ggml.eos_token_id")?;
    let add_bos = g.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(pre.add_bos);
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

    let text_of = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());
    let mut single = Vec::new();
    let mut specials = Vec::new();
    if add_bos {
        let bos = bos_id.ok_or_else(|| err(origin, "add_bos_token is set but there is no valid bos_token_id"))?;
        single.push("BOS");
        specials.push(special_token("BOS", bos, &tokens[bos as usize], origin)?);
    }
    single.push("$A");
    if add_eos {
        let eos = eos_id.ok_or_else(|| err(origin, "add_eos_token is set but there is no valid eos_token_id"))?;
        single.push("EOS");
        specials.push(special_token("EOS", eos, &tokens[eos as usize], origin)?);
    }
    if !specials.is_empty() {
        let pair: Vec<&str> =
            single.iter().copied().chain(single.iter().map(|p| if *p == "$A" { "$B:1" } else { p })).collect();
        let processor = TemplateProcessing::builder()
            .try_single(single.join(" "))
            .and_then(|b| b.try_pair(pair.join(" ")))
            .map_err(|e| err(origin, format!("post-processor template: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| err(origin, format!("post-processor: {e}")))?;
        tokenizer.with_post_processor(Some(processor));
    }

    let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
    eos_ids.extend(id_key("tokenizer.ggml.eot_token_id")?);
    eos_ids.extend(id_key("tokenizer.ggml.eom_token_id")?);
    for (id, text) in tokens.iter().enumerate() {
        if END_OF_GENERATION.contains(&text.as_str()) {
            eos_ids.push(id as u32);
        }
    }
    eos_ids.sort_unstable();
    eos_ids.dedup();

    for (k, id) in [
        ("unknown", id_key("tokenizer.ggml.unknown_token_id")?),
        ("padding", id_key("tokenizer.ggml.padding_token_id")?),
    ] {
        tracing::debug!(file = %origin.display(), kind = k, id = ?id, "GGUF special token id");
    }

    Ok(TokenizerBundle {
        tokenizer,
        origin: origin.to_path_buf(),
        chat_template: g.get_str("tokenizer.chat_template")?.map(str::to_string),
        bos_token: text_of(bos_id),
        eos_token: text_of(eos_id),
        bos_token_id: bos_id,
        eos_token_ids: eos_ids,
        add_bos_token: add_bos,
    })
}

fn special_token(key: &str, id: u32, text: &str, origin: &Path) -> Result<SpecialToken, ModelError> {
    SpecialToken::new(key.to_string(), vec![id], vec![text.to_string()])
        .map_err(|e| err(origin, format!("special token {text:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::testutil::GgufBuilder;

    /// A tiny byte-level vocabulary: the bytes of "hello world", merges building "hello" and
    /// "Ġworld", digits, and three special tokens.
    fn tiny(pre: &str, add_bos: Option<bool>) -> (tempfile::TempDir, GgufFile) {
        let tokens = [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "h",
            "e",
            "l",
            "o",
            "Ġ",
            "w",
            "r",
            "d",
            "he",
            "ll",
            "llo",
            "hello",
            "Ġw",
            "or",
            "Ġwor",
            "ld",
            "Ġworld",
            "1",
            "2",
            "12",
            "Ċ",
        ];
        let types: Vec<i32> = (0..tokens.len())
            .map(|i| {
                if i < 3 {
                    3
                } else if i == 3 {
                    4
                } else {
                    1
                }
            })
            .collect();
        let merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"];
        let mut b = GgufBuilder::new();
        b.str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", pre)
            .str_array("tokenizer.ggml.tokens", &tokens)
            .i32_array("tokenizer.ggml.token_type", &types)
            .str_array("tokenizer.ggml.merges", &merges)
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2)
            .str("tokenizer.chat_template", "{{ messages }}");
        if let Some(v) = add_bos {
            b.bool("tokenizer.ggml.add_bos_token", v);
        }
        let dir = tempfile::tempdir().unwrap();
        let p = b.write(dir.path(), "tok.gguf");
        let g = GgufFile::open(&p).unwrap();
        (dir, g)
    }

    #[test]
    fn encodes_with_merges_specials_and_digit_splitting() {
        let (_d, g) = tiny("smollm", Some(false));
        let t = tokenizer_from_gguf(&g, g.path()).unwrap();
        assert_eq!(t.encode("hello world", true).unwrap(), vec![15, 20]);
        // smollm splits digits individually, so "12" never merges.
        assert_eq!(t.encode("12", false).unwrap(), vec![21, 22]);
        assert_eq!(t.encode("<|im_start|>hello<|im_end|>\n", false).unwrap(), vec![1, 15, 2, 24]);
        assert_eq!(t.decode(&[1, 15, 2, 3], false).unwrap(), "<|im_start|>hello<|im_end|><think>");
        // Control tokens are skipped, user-defined ones are kept.
        assert_eq!(t.decode(&[1, 15, 2, 3], true).unwrap(), "hello<think>");
        assert_eq!(t.eos_token_ids, vec![0, 2]);
        assert_eq!(
            (t.bos_token_id, t.bos_token.as_deref(), t.eos_token.as_deref()),
            (Some(1), Some("<|im_start|>"), Some("<|im_end|>"))
        );
        assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
        assert!(!t.add_bos_token);

        // The gpt-2 pre-tokenizer keeps digit runs together, so the merge applies.
        let (_d, g) = tiny("gpt-2", None);
        let t = tokenizer_from_gguf(&g, g.path()).unwrap();
        assert_eq!(t.encode("12", false).unwrap(), vec![23]);
    }

    #[test]
    fn add_bos_prepends_and_defaults_follow_the_pre_tokenizer() {
        let (_d, g) = tiny("smollm", Some(true));
        let t = tokenizer_from_gguf(&g, g.path()).unwrap();
        assert!(t.add_bos_token);
        assert_eq!(t.encode("hello", true).unwrap(), vec![1, 15]);
        assert_eq!(t.encode("hello", false).unwrap(), vec![15]);
        // llama.cpp adds BOS by default for llama3-style vocabularies.
        let (_d, g) = tiny("llama-bpe", None);
        let t = tokenizer_from_gguf(&g, g.path()).unwrap();
        assert_eq!(t.encode("hello", true).unwrap(), vec![1, 15]);
    }

    #[test]
    fn unknown_pre_falls_back_and_bad_merges_are_named() {
        let (_d, g) = tiny("some-new-model", None);
        let t = tokenizer_from_gguf(&g, g.path()).unwrap();
        assert_eq!(t.encode("hello world", false).unwrap(), vec![15, 20]);

        let mut b = GgufBuilder::new();
        b.str("tokenizer.ggml.model", "gpt2")
            .str_array("tokenizer.ggml.tokens", &["a", "b"])
            .str_array("tokenizer.ggml.merges", &["ab"]);
        let dir = tempfile::tempdir().unwrap();
        let g = GgufFile::open(&b.write(dir.path(), "bad.gguf")).unwrap();
        let e = tokenizer_from_gguf(&g, g.path()).err().expect("bad merge").to_string();
        assert!(e.contains("bad.gguf") && e.contains("merges[0]"), "{e}");
    }
}
