//! HF model directories as written by transformers' `save_pretrained`: `config.json`, weights in
//! `model.safetensors` or shards listed by `model.safetensors.index.json` (memory-mapped, viewed
//! without copying), the tokenizer (`tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja`) and `generation_config.json`. Owns reading and checking those files;
//! the meaning of individual tensors belongs to the architecture code.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;
use tokenizers::processors::template::TemplateProcessing;

use super::quantized::{QuantScheme, RawTensor};
use super::{DType, GenerationDefaults, ModelBundle, ModelError, TensorView, WeightSource};
use crate::config::LlamaConfig;
use crate::tokenizer::TokenizerBundle;

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// transformers >= 4.43 saves the default chat template here instead of in tokenizer_config.json.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Open an HF model directory: config, weights, tokenizer (optional) and generation defaults.
pub fn open_dir(dir: &Path) -> Result<ModelBundle, ModelError> {
    let config_path = dir.join(CONFIG_FILE);
    let text = read_text(&config_path, " (an HF model directory needs config.json)")?;
    let config = LlamaConfig::from_hf_json(&text, &config_path)?;
    let weights = open_weights_checked(dir)?;
    let generation = read_generation_config(dir)?;
    let tokenizer = load_tokenizer(dir, &config, &generation)?;
    tracing::info!(
        dir = %dir.display(),
        model_type = %config.model_type,
        tensors = weights.len(),
        files = weights.files().count(),
        tokenizer = tokenizer.is_some(),
        "opened HF model directory"
    );
    Ok(ModelBundle { name: dir_name(dir), config, weights: Box::new(weights), tokenizer, generation })
}

/// `config.json`'s `quantization_config`, described for messages (`quant_method` and the
/// parameters that select a kernel), or `None` when the checkpoint declares none.
pub fn quantization_scheme(config: &Value) -> Option<String> {
    let q = config.get("quantization_config")?;
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut parts = vec![format!("quant_method `{}`", q.get("quant_method").map(text).unwrap_or_else(|| "?".into()))];
    for key in ["fmt", "format", "weight_block_size", "bits", "group_size"] {
        if let Some(v) = q.get(key) {
            parts.push(format!("{key} {}", text(v)));
        }
    }
    if let Some(Value::Object(groups)) = q.get("config_groups") {
        for (name, g) in groups {
            if let Some(w) = g.get("weights").filter(|w| !w.is_null()) {
                let field = |k: &str| w.get(k).filter(|v| !v.is_null()).map(text).unwrap_or_else(|| "-".into());
                parts.push(format!(
                    "{name}: {} {}-bit weights, strategy {}, group {}, symmetric {}",
                    field("type"),
                    field("num_bits"),
                    field("strategy"),
                    field("group_size"),
                    field("symmetric")
                ));
            }
        }
    }
    Some(parts.join(", "))
}

/// Open the directory's safetensors. A checkpoint whose `config.json` declares a
/// `quantization_config` opens only when the scheme is one [`QuantScheme`] serves and every tensor
/// is one that scheme stores; otherwise it is refused, naming the scheme and a tensor (the first
/// whose stored type is not a float, else the first tensor): computing with another scheme's codes,
/// or widening them to floats, would serve a different model than the one asked for.
pub fn open_weights_checked(dir: &Path) -> Result<SafetensorsWeights, ModelError> {
    let config_path = dir.join(CONFIG_FILE);
    let config: Value = serde_json::from_str(&read_text(&config_path, "")?)
        .map_err(|e| ModelError::Config { file: config_path.clone(), msg: e.to_string() })?;
    let Some(description) = quantization_scheme(&config) else {
        return SafetensorsWeights::open_dir(dir);
    };
    let why = match QuantScheme::from_config(&config) {
        Ok(Some(scheme)) => {
            let weights = SafetensorsWeights::open_dir_with(dir, Some((&scheme, &description)))?;
            tracing::info!(dir = %dir.display(), format = %scheme.format().name(), "quantized checkpoint");
            return Ok(weights);
        }
        Ok(None) => String::new(),
        Err(why) => why,
    };
    let scheme = format!("{description} ({why})");
    match SafetensorsWeights::open_dir(dir) {
        Err(ModelError::UnsupportedDType { file, tensor, dtype }) => {
            Err(ModelError::UnsupportedQuantization { file, scheme, tensor: format!("`{tensor}` ({dtype})") })
        }
        Err(other) => Err(other),
        Ok(weights) => {
            let names = weights.tensor_names();
            let first = names.first().cloned().unwrap_or_default();
            let file = weights.files().next().map(Path::to_path_buf).unwrap_or(config_path);
            Err(ModelError::UnsupportedQuantization { file, scheme, tensor: format!("`{first}`") })
        }
    }
}

fn dir_name(dir: &Path) -> String {
    // `.` and `..` have no file name of their own; the canonical path does.
    dir.file_name()
        .map(|n| n.to_os_string())
        .or_else(|| dir.canonicalize().ok().and_then(|p| p.file_name().map(|n| n.to_os_string())))
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

fn read_text(path: &Path, missing_hint: &str) -> Result<String, ModelError> {
    fs::read_to_string(path).map_err(|e| match ModelError::io(path, e) {
        ModelError::MissingFile { path, .. } => ModelError::MissingFile { path, hint: missing_hint.to_string() },
        other => other,
    })
}

/// Read an optional JSON file: `Ok(None)` when it does not exist.
fn read_optional_json(path: &Path, bad: impl Fn(String) -> ModelError) -> Result<Option<Value>, ModelError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ModelError::io(path, e)),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| bad(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Weights

struct Shard {
    path: PathBuf,
    map: Mmap,
}

struct Entry {
    shard: usize,
    /// `None` for the non-float types only a quantization scheme stores (packed ints, FP8).
    dtype: Option<DType>,
    stored: StDtype,
    shape: Vec<usize>,
    /// Byte range in the shard's memory map (header included in the offset).
    start: usize,
    end: usize,
}

/// Tensors of one or more memory-mapped safetensors files, looked up by name.
pub struct SafetensorsWeights {
    origin: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
    quant: Option<QuantScheme>,
}

/// A declared quantization scheme and its description for messages.
type Declared<'a> = Option<(&'a QuantScheme, &'a str)>;

impl SafetensorsWeights {
    /// Find the weights of an HF directory: `model.safetensors.index.json` (sharded) if present,
    /// else `model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, ModelError> {
        Self::open_dir_with(dir, None)
    }

    /// [`open_dir`](Self::open_dir) for a checkpoint stored in `quant`'s scheme (checked tensor by
    /// tensor).
    pub fn open_dir_with(dir: &Path, quant: Declared<'_>) -> Result<Self, ModelError> {
        let index = dir.join(WEIGHTS_INDEX_FILE);
        if index.is_file() {
            return Self::open_index_with(dir, &index, quant);
        }
        let single = dir.join(SINGLE_WEIGHTS_FILE);
        if single.is_file() {
            return Self::open_files_with(dir, &[single], quant);
        }
        Err(ModelError::MissingFile { path: single, hint: missing_weights_hint(dir) })
    }

    /// Open the shards named by a `model.safetensors.index.json` and check that every tensor it
    /// lists is where it says.
    pub fn open_index(dir: &Path, index: &Path) -> Result<Self, ModelError> {
        Self::open_index_with(dir, index, None)
    }

    fn open_index_with(dir: &Path, index: &Path, quant: Declared<'_>) -> Result<Self, ModelError> {
        let bad = |msg: String| ModelError::Format { file: index.to_path_buf(), msg };
        let text = read_text(index, "")?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map =
            json.get("weight_map").and_then(Value::as_object).ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut weight_map = Vec::with_capacity(map.len());
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("`weight_map[{name}]` is not a file name")))?;
            // The index is data, not a licence to read arbitrary paths.
            let rel = Path::new(file);
            if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
                return Err(bad(format!("shard name `{file}` (for `{name}`) must be a plain relative path")));
            }
            weight_map.push((name.as_str(), file));
        }
        let shard_names: BTreeSet<&str> = weight_map.iter().map(|&(_, f)| f).collect();
        if shard_names.is_empty() {
            return Err(bad("`weight_map` is empty".into()));
        }
        let mut paths = Vec::with_capacity(shard_names.len());
        for name in &shard_names {
            let path = dir.join(name);
            if !path.is_file() {
                return Err(ModelError::MissingFile { path, hint: format!(" (listed in {})", index.display()) });
            }
            paths.push(path);
        }
        let weights = Self::open_files_with(dir, &paths, quant)?;
        for (name, file) in weight_map {
            let holder = weights.tensors.get(name).map(|e| &weights.shards[e.shard].path);
            if holder != Some(&dir.join(file)) {
                let found =
                    holder.map(|p| format!("it is in {}", p.display())).unwrap_or_else(|| "no shard has it".into());
                return Err(bad(format!("maps `{name}` to {file}, but {found}")));
            }
        }
        Ok(weights)
    }

    /// Memory-map and index the given safetensors files. `origin` is what messages call the set.
    pub fn open_files(origin: &Path, files: &[PathBuf]) -> Result<Self, ModelError> {
        Self::open_files_with(origin, files, None)
    }

    fn open_files_with(origin: &Path, files: &[PathBuf], quant: Declared<'_>) -> Result<Self, ModelError> {
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for (shard, path) in files.iter().enumerate() {
            let map = map_file(path)?;
            let bad = |msg: String| ModelError::Format { file: path.clone(), msg };
            let (header_len, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
            // Offsets in the header are relative to the end of the 8-byte length and the header.
            let base = 8 + header_len;
            // In name order, so that the tensor an error names does not depend on hashing.
            let mut listed: Vec<_> = meta.tensors().into_iter().collect();
            listed.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, info) in listed {
                let dtype = match info.dtype {
                    StDtype::F32 => Some(DType::F32),
                    StDtype::F16 => Some(DType::F16),
                    StDtype::BF16 => Some(DType::BF16),
                    _ => None,
                };
                match quant {
                    None if dtype.is_none() => {
                        return Err(ModelError::UnsupportedDType {
                            file: path.clone(),
                            tensor: name,
                            dtype: format!("{:?} (supported: F32, F16, BF16)", info.dtype),
                        })
                    }
                    Some((scheme, description)) => {
                        if let Err(why) = scheme.check_tensor(&name, info.dtype) {
                            return Err(ModelError::UnsupportedQuantization {
                                file: path.clone(),
                                scheme: format!("{description} ({why})"),
                                tensor: format!("`{name}`"),
                            });
                        }
                    }
                    None => {}
                }
                let (start, end) = info.data_offsets;
                let entry = Entry {
                    shard,
                    dtype,
                    stored: info.dtype,
                    shape: info.shape.clone(),
                    start: base + start,
                    end: base + end,
                };
                if let Some(prev) = tensors.get(&name) {
                    return Err(bad(format!(
                        "tensor `{name}` is also in {}",
                        shards.get(prev.shard).map(|s: &Shard| s.path.display().to_string()).unwrap_or_default()
                    )));
                }
                tensors.insert(name, entry);
            }
            tracing::debug!(file = %path.display(), tensors = meta.tensors().len(), "mapped safetensors file");
            shards.push(Shard { path: path.clone(), map });
        }
        Ok(SafetensorsWeights { origin: origin.to_path_buf(), shards, tensors, quant: quant.map(|(q, _)| q.clone()) })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The mapped files, in the order they were opened.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }
}

fn map_file(path: &Path) -> Result<Mmap, ModelError> {
    let file = fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: the map is only read. Like every mmap-based loader we rely on model files not being
    // truncated or rewritten while the server runs; that would be an operator error, not input.
    unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))
}

fn missing_weights_hint(dir: &Path) -> String {
    let has = |ext: &str| {
        fs::read_dir(dir)
            .map(|rd| rd.flatten().any(|e| e.path().extension().is_some_and(|x| x == ext)))
            .unwrap_or(false)
    };
    if has("bin") || has("pt") || has("pth") {
        " (this directory has only PyTorch pickle weights; re-save it with safetensors, e.g. \
         `model.save_pretrained(dir, safe_serialization=True)`)"
            .into()
    } else {
        format!(" (an HF model directory needs {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} with its shards)")
    }
}

impl WeightSource for SafetensorsWeights {
    fn origin(&self) -> &Path {
        &self.origin
    }

    fn file_of(&self, name: &str) -> PathBuf {
        match self.tensors.get(name) {
            Some(e) => self.shards[e.shard].path.clone(),
            // A missing tensor of a single-file model is missing from that file.
            None if self.shards.len() == 1 => self.shards[0].path.clone(),
            None => self.origin.clone(),
        }
    }

    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let e = self.tensors.get(name)?;
        // The range was validated against the file length by `read_metadata`.
        let data = self.shards[e.shard].map.get(e.start..e.end)?;
        Some(TensorView { dtype: e.dtype?, shape: &e.shape, data })
    }

    fn raw_tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let e = self.tensors.get(name)?;
        let data = self.shards[e.shard].map.get(e.start..e.end)?;
        Some(RawTensor { dtype: e.stored, shape: &e.shape, data })
    }

    fn quantization(&self) -> Option<&QuantScheme> {
        self.quant.as_ref()
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort_unstable();
        names
    }
}

// ---------------------------------------------------------------------------------------------
// generation_config.json

/// Read `generation_config.json`; defaults when the file is absent.
pub fn read_generation_config(dir: &Path) -> Result<GenerationDefaults, ModelError> {
    let path = dir.join(GENERATION_CONFIG_FILE);
    let bad = |msg: String| ModelError::Config { file: path.clone(), msg };
    let Some(json) = read_optional_json(&path, bad)? else {
        return Ok(GenerationDefaults::default());
    };
    let num = |k: &str| json.get(k).and_then(Value::as_f64).map(|x| x as f32);
    Ok(GenerationDefaults {
        eos_token_ids: crate::config::token_ids(&json.get("eos_token_id").cloned()),
        temperature: num("temperature"),
        top_p: num("top_p"),
        top_k: json.get("top_k").and_then(Value::as_u64).map(|k| k as usize),
        repetition_penalty: num("repetition_penalty"),
    })
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

/// A special token in `tokenizer_config.json`: a plain string or an AddedToken object.
fn special_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The default chat template: `chat_template.jinja` wins (transformers reads it last), else
/// `chat_template` in tokenizer_config.json, either a string or a list of named templates.
fn chat_template(dir: &Path, tok_config: Option<&Value>, tok_config_path: &Path) -> Result<Option<String>, ModelError> {
    let jinja = dir.join(CHAT_TEMPLATE_FILE);
    match fs::read_to_string(&jinja) {
        Ok(t) => return Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ModelError::io(&jinja, e)),
    }
    let Some(v) = tok_config.and_then(|c| c.get("chat_template")) else { return Ok(None) };
    match v {
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            let named = |n: &str| {
                list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some(n)).and_then(|t| t.get("template"))
            };
            match named("default").and_then(Value::as_str) {
                Some(t) => Ok(Some(t.to_string())),
                None => {
                    let names: Vec<&str> = list.iter().filter_map(|t| t.get("name").and_then(Value::as_str)).collect();
                    tracing::warn!(
                        file = %tok_config_path.display(),
                        templates = ?names,
                        "several chat templates and none named `default`; chat requests will be refused"
                    );
                    Ok(None)
                }
            }
        }
        Value::Null => Ok(None),
        _ => Err(ModelError::Tokenizer {
            file: tok_config_path.to_path_buf(),
            msg: "`chat_template` must be a string or a list of {name, template}".into(),
        }),
    }
}

/// Load `tokenizer.json` plus its config. `Ok(None)` when there is no `tokenizer.json`: the
/// model is then usable with token ids only.
pub fn load_tokenizer(
    dir: &Path,
    config: &LlamaConfig,
    generation: &GenerationDefaults,
) -> Result<Option<TokenizerBundle>, ModelError> {
    let path = dir.join(TOKENIZER_FILE);
    if !path.is_file() {
        tracing::warn!(dir = %dir.display(), "no tokenizer.json: this model accepts and returns token ids only");
        return Ok(None);
    }
    let mut tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| ModelError::Tokenizer { file: path.clone(), msg: e.to_string() })?;

    let tc_path = dir.join(TOKENIZER_CONFIG_FILE);
    let tc = read_optional_json(&tc_path, |msg| ModelError::Tokenizer { file: tc_path.clone(), msg })?;
    let tc_ref = tc.as_ref();
    let chat_template = chat_template(dir, tc_ref, &tc_path)?;
    let bos_token = special_token(tc_ref.and_then(|c| c.get("bos_token")));
    let eos_token = special_token(tc_ref.and_then(|c| c.get("eos_token")));
    let bos_id = bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
    let bos_token_id = bos_id.or(config.bos_token_id);
    let eos_id = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
    if let (Some(t), None) = (&eos_token, eos_id) {
        tracing::warn!(file = %tc_path.display(), eos_token = %t, "eos_token is not in the vocabulary");
    }

    let flag = |k: &str| tc_ref.and_then(|c| c.get(k)).and_then(Value::as_bool);
    let (explicit_bos, explicit_eos) = (flag("add_bos_token"), flag("add_eos_token"));
    let mut add_bos_token = None;
    if explicit_bos.is_some() || explicit_eos.is_some() {
        // transformers (>= 5) rebuilds the post-processor from these flags whenever the config
        // states them (dropping a flag whose token is unknown), so encode(text, add_special =
        // true) matches it only if we do the same.
        let bos = explicit_bos.unwrap_or(false).then(|| bos_token.clone().zip(bos_id)).flatten();
        let eos = explicit_eos.unwrap_or(false).then(|| eos_token.clone().zip(eos_id)).flatten();
        match template_processor(bos.as_ref(), eos.as_ref()) {
            Ok(pp) => {
                tokenizer.with_post_processor(Some(pp));
                add_bos_token = Some(bos.is_some());
            }
            Err(msg) => tracing::warn!(file = %tc_path.display(), %msg, "keeping tokenizer.json's post-processor"),
        }
    }
    let add_bos_token = add_bos_token.unwrap_or_else(|| post_processor_adds(&tokenizer, bos_token_id));

    let mut eos_token_ids: Vec<u32> = eos_id.into_iter().collect();
    eos_token_ids.extend(&config.eos_token_ids);
    eos_token_ids.extend(&generation.eos_token_ids);
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();

    Ok(Some(TokenizerBundle {
        tokenizer,
        origin: path,
        chat_template,
        bos_token,
        eos_token,
        bos_token_id,
        eos_token_ids,
        add_bos_token,
    }))
}

/// The post-processor transformers builds from `add_bos_token` / `add_eos_token`.
fn template_processor(bos: Option<&(String, u32)>, eos: Option<&(String, u32)>) -> Result<TemplateProcessing, String> {
    let piece = |t: Option<&(String, u32)>, seq: u32| t.map(|(s, _)| format!("{s}:{seq}"));
    let single: Vec<String> = piece(bos, 0).into_iter().chain(["$A:0".to_string()]).chain(piece(eos, 0)).collect();
    let mut pair = single.clone();
    pair.extend(piece(bos, 1).into_iter().chain(["$B:1".to_string()]).chain(piece(eos, 1)));
    let specials: Vec<(String, u32)> = bos.into_iter().chain(eos).cloned().collect();
    TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| e.to_string())?
        .try_pair(pair)
        .map_err(|e| e.to_string())?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())
}

/// Whether encoding with special tokens puts BOS in front (the tokenizer's own post-processor).
fn post_processor_adds(tokenizer: &tokenizers::Tokenizer, bos: Option<u32>) -> bool {
    let Some(bos) = bos else { return false };
    let first = |special| tokenizer.encode("a", special).ok().and_then(|e| e.get_ids().first().copied());
    first(true) == Some(bos) && first(false) != Some(bos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView as StView;

    const CONFIG: &str = r#"{"model_type":"llama","vocab_size":5,"hidden_size":4,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"eos_token_id":1,
        "bos_token_id":0,"tie_word_embeddings":true}"#;

    /// A five-word vocabulary, whitespace pre-tokenizer, no post-processor.
    const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[
          {"id":0,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
          {"id":1,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
          {"id":4,"content":"<eot>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"<s>":0,"</s>":1,"hello":2,"world":3,"<eot>":4,"<unk>":5},
                 "unk_token":"<unk>"}}"#;

    fn write_st(path: &Path, tensors: &[(&str, StDtype, Vec<usize>)]) {
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, dt, shape)| {
                let n = shape.iter().product::<usize>() * dt.bitsize() / 8;
                (0..n).map(|i| i as u8).collect()
            })
            .collect();
        let views: Vec<(&str, StView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, dt, shape), d)| (*name, StView::new(*dt, shape.clone(), d).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn model_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(CONFIG_FILE), CONFIG).unwrap();
        dir
    }

    fn err_text(r: Result<ModelBundle, ModelError>) -> (ModelError, String) {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => {
                let s = e.to_string();
                (e, s)
            }
        }
    }

    #[test]
    fn single_file_views_are_zero_copy_and_named() {
        let dir = model_dir();
        let file = dir.path().join(SINGLE_WEIGHTS_FILE);
        write_st(
            &file,
            &[("a", StDtype::F32, vec![2, 3]), ("b", StDtype::BF16, vec![4]), ("c", StDtype::F16, vec![1])],
        );
        let b = open_dir(dir.path()).unwrap();
        assert_eq!(b.name, dir.path().file_name().unwrap().to_string_lossy());
        assert!(b.tokenizer.is_none());
        assert_eq!(b.weights.tensor_names(), vec!["a", "b", "c"]);
        let a = b.weights.tensor("a").unwrap();
        assert_eq!((a.dtype, a.shape), (DType::F32, &[2usize, 3][..]));
        assert_eq!(a.data, (0..24).map(|i| i as u8).collect::<Vec<_>>().as_slice());
        let bb = b.weights.tensor("b").unwrap();
        assert_eq!((bb.dtype, bb.data.len()), (DType::BF16, 8));
        assert_eq!(b.weights.tensor("c").unwrap().dtype, DType::F16);
        assert!(b.weights.tensor("zz").is_none());
        assert_eq!(b.weights.file_of("a"), file);
        // The view borrows the map: it points inside the file's bytes as laid out on disk.
        let bytes = fs::read(&file).unwrap();
        let at = bytes.windows(24).position(|w| w == a.data).unwrap();
        assert!(at > 8);
        let e = b.weights.expect("a", &[3, 2]).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("`a`") && e.contains("[2, 3]"), "{e}");
        assert_eq!(b.generation, GenerationDefaults::default());
    }

    #[test]
    fn unsupported_dtype_names_file_and_tensor() {
        let dir = model_dir();
        write_st(
            &dir.path().join(SINGLE_WEIGHTS_FILE),
            &[("w", StDtype::F32, vec![2]), ("qweight", StDtype::I32, vec![2])],
        );
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::UnsupportedDType { ref tensor, .. } if tensor == "qweight"), "{s}");
        assert!(s.contains("model.safetensors") && s.contains("I32"), "{s}");
    }

    /// A declared `quantization_config` that is not served, or a served one with a tensor its
    /// scheme does not store, is refused at load with the scheme and a tensor, whether the tensors
    /// have a type the loader rejects anyway or look like floats (where loading them would
    /// silently compute with codes as weights).
    #[test]
    fn unserved_quantization_is_refused_naming_scheme_and_tensor() {
        let int4 = |extra: &str| {
            format!(
                r#"{{"quant_method":"compressed-tensors","format":"pack-quantized","quantization_status":"compressed",
                "config_groups":{{"group_0":{{"targets":["Linear"],"weights":{{"num_bits":4,"type":"int",
                "strategy":"group","group_size":128,"symmetric":true,"dynamic":false}}{extra}}}}}}}"#
            )
        };
        let cases = [
            // Not served at all: GPTQ's own format, with float-looking tensors.
            (
                r#"{"quant_method":"gptq","bits":4,"group_size":128}"#.to_string(),
                ("qweight", StDtype::I32),
                vec!["quant_method `gptq`", "bits 4", "`a.qweight`"],
            ),
            (
                r#"{"quant_method":"fp8","fmt":"e4m3","weight_block_size":[64,64]}"#.to_string(),
                ("weight_scale_inv", StDtype::F32),
                vec!["weight_block_size [64,64]", "[128, 128]", "`a.weight`"],
            ),
            (
                r#"{"quant_method":"fp8","weight_block_size":[128,128],"activation_scheme":"static"}"#.to_string(),
                ("weight_scale_inv", StDtype::F32),
                vec!["activation_scheme `static`"],
            ),
            // Activation quantization (W4A8-style) is not served.
            (
                int4(r#","input_activations":{"num_bits":8,"type":"int","strategy":"token","dynamic":true}"#),
                ("weight_packed", StDtype::I32),
                vec!["pack-quantized", "input_activations", "`a.weight_packed`"],
            ),
            // A served scheme with a tensor it does not store: a zero point, an input scale.
            (int4(""), ("weight_zero_point", StDtype::I32), vec!["`a.weight_zero_point`", "weight_zero_point"]),
            (
                r#"{"quant_method":"fp8","weight_block_size":[128,128],"activation_scheme":"dynamic"}"#.to_string(),
                ("input_scale", StDtype::F32),
                vec!["`a.input_scale`", "activation"],
            ),
        ];
        for (qc, (suffix, dtype), wants) in cases {
            let dir = tempfile::tempdir().unwrap();
            let config = CONFIG.replacen('{', &format!("{{\"quantization_config\":{qc},"), 1);
            fs::write(dir.path().join(CONFIG_FILE), config).unwrap();
            let packed = format!("a.{suffix}");
            let tensors = [("a.weight", StDtype::F32, vec![2]), (packed.as_str(), dtype, vec![2])];
            write_st(&dir.path().join(SINGLE_WEIGHTS_FILE), &tensors);
            let (e, s) = err_text(open_dir(dir.path()));
            assert!(matches!(e, ModelError::UnsupportedQuantization { .. }), "{s}");
            assert!(s.contains("model.safetensors"), "{s}");
            for want in wants {
                assert!(s.contains(want), "`{want}` not in: {s}");
            }
        }
        // The same weights without a quantization_config load.
        let dir = model_dir();
        write_st(&dir.path().join(SINGLE_WEIGHTS_FILE), &[("a.weight", StDtype::F32, vec![2])]);
        assert!(open_weights_checked(dir.path()).is_ok());
        // A served scheme opens, packed tensors visible only as raw tensors.
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(CONFIG_FILE),
            CONFIG.replacen('{', &format!("{{\"quantization_config\":{},", int4("")), 1),
        )
        .unwrap();
        write_st(
            &dir.path().join(SINGLE_WEIGHTS_FILE),
            &[("a.weight_packed", StDtype::I32, vec![2, 16]), ("a.weight_scale", StDtype::BF16, vec![2, 1])],
        );
        let w = open_weights_checked(dir.path()).unwrap();
        assert!(w.quantization().is_some());
        assert!(w.tensor("a.weight_packed").is_none());
        assert_eq!(w.raw_tensor("a.weight_packed").unwrap().shape, &[2, 16]);
        assert_eq!(w.tensor_names(), vec!["a.weight_packed", "a.weight_scale"]);
    }

    #[test]
    fn no_weights_is_missing_file_with_hint() {
        let dir = model_dir();
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::MissingFile { .. }), "{s}");
        assert!(s.contains(WEIGHTS_INDEX_FILE), "{s}");
        fs::write(dir.path().join("pytorch_model.bin"), b"x").unwrap();
        let (_, s) = err_text(open_dir(dir.path()));
        assert!(s.contains("PyTorch") && s.contains("safetensors"), "{s}");
    }

    #[test]
    fn missing_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::MissingFile { ref path, .. } if path.ends_with(CONFIG_FILE)), "{s}");
    }

    #[test]
    fn corrupt_safetensors_header_is_a_format_error() {
        let dir = model_dir();
        let file = dir.path().join(SINGLE_WEIGHTS_FILE);
        write_st(&file, &[("w", StDtype::F32, vec![4])]);
        let mut bytes = fs::read(&file).unwrap();
        bytes.truncate(bytes.len() - 3);
        fs::write(&file, &bytes).unwrap();
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Format { ref file, .. } if file.ends_with(SINGLE_WEIGHTS_FILE)), "{s}");
        fs::write(&file, b"").unwrap();
        let (e, _) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Format { .. }));
    }

    fn write_index(dir: &Path, map: &[(&str, &str)]) -> PathBuf {
        let wm: serde_json::Map<String, Value> = map.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
        let path = dir.join(WEIGHTS_INDEX_FILE);
        fs::write(&path, serde_json::json!({"metadata": {}, "weight_map": wm}).to_string()).unwrap();
        path
    }

    #[test]
    fn sharded_weights_report_their_shard() {
        let dir = model_dir();
        let (s1, s2) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
        write_st(&dir.path().join(s1), &[("a", StDtype::F32, vec![2])]);
        write_st(&dir.path().join(s2), &[("b", StDtype::F32, vec![3])]);
        // A leftover single file must not be preferred over the index.
        write_st(&dir.path().join(SINGLE_WEIGHTS_FILE), &[("stale", StDtype::F32, vec![1])]);
        write_index(dir.path(), &[("a", s1), ("b", s2)]);
        let b = open_dir(dir.path()).unwrap();
        assert_eq!(b.weights.tensor_names(), vec!["a", "b"]);
        assert_eq!(b.weights.file_of("b"), dir.path().join(s2));
        assert_eq!(b.weights.file_of("a"), dir.path().join(s1));
        let e = b.weights.expect("b", &[2]).unwrap_err().to_string();
        assert!(e.contains(s2) && e.contains("`b`"), "{e}");
    }

    #[test]
    fn index_naming_a_missing_shard_names_both() {
        let dir = model_dir();
        let s1 = "model-00001-of-00002.safetensors";
        write_st(&dir.path().join(s1), &[("a", StDtype::F32, vec![2])]);
        write_index(dir.path(), &[("a", s1), ("b", "model-00002-of-00002.safetensors")]);
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::MissingFile { .. }), "{s}");
        assert!(s.contains("model-00002-of-00002.safetensors") && s.contains(WEIGHTS_INDEX_FILE), "{s}");
    }

    #[test]
    fn index_disagreeing_with_shards_is_an_error() {
        let dir = model_dir();
        let (s1, s2) = ("s1.safetensors", "s2.safetensors");
        write_st(&dir.path().join(s1), &[("a", StDtype::F32, vec![2])]);
        write_st(&dir.path().join(s2), &[("b", StDtype::F32, vec![2])]);
        write_index(dir.path(), &[("a", s2), ("b", s2)]);
        let (e, s) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Format { .. }) && s.contains("`a`") && s.contains(s2), "{s}");

        // The same tensor in two shards is ambiguous.
        write_st(&dir.path().join(s2), &[("a", StDtype::F32, vec![2])]);
        write_index(dir.path(), &[("a", s1), ("b", s2)]);
        let (_, s) = err_text(open_dir(dir.path()));
        assert!(s.contains("`a`") && s.contains(s1) && s.contains(s2), "{s}");

        write_index(dir.path(), &[("a", "../s1.safetensors")]);
        let (_, s) = err_text(open_dir(dir.path()));
        assert!(s.contains("plain relative path"), "{s}");
    }

    fn tokenizer_dir(tok_config: &str) -> tempfile::TempDir {
        let dir = model_dir();
        write_st(&dir.path().join(SINGLE_WEIGHTS_FILE), &[("w", StDtype::F32, vec![1])]);
        fs::write(dir.path().join(TOKENIZER_FILE), TOKENIZER).unwrap();
        fs::write(dir.path().join(TOKENIZER_CONFIG_FILE), tok_config).unwrap();
        dir
    }

    #[test]
    fn tokenizer_config_string_forms_and_add_bos() {
        let dir = tokenizer_dir(
            r#"{"bos_token":{"content":"<s>","lstrip":false},"eos_token":"<eot>","add_bos_token":true,
               "chat_template":"{{ messages[0]['content'] }}"}"#,
        );
        fs::write(
            dir.path().join(GENERATION_CONFIG_FILE),
            r#"{"eos_token_id":[1,3],"temperature":0.7,"top_p":0.8,"top_k":20,"repetition_penalty":1.05}"#,
        )
        .unwrap();
        let b = open_dir(dir.path()).unwrap();
        let t = b.tokenizer.as_ref().unwrap();
        assert_eq!(t.bos_token.as_deref(), Some("<s>"));
        assert_eq!(t.eos_token.as_deref(), Some("<eot>"));
        assert_eq!(t.bos_token_id, Some(0));
        // eos token (4) + config.json (1) + generation_config.json (1, 3)
        assert_eq!(t.eos_token_ids, vec![1, 3, 4]);
        assert_eq!(t.chat_template.as_deref(), Some("{{ messages[0]['content'] }}"));
        assert!(t.add_bos_token);
        assert_eq!(t.encode("hello world", true).unwrap(), vec![0, 2, 3]);
        assert_eq!(t.encode("hello world", false).unwrap(), vec![2, 3]);
        assert_eq!(
            b.generation,
            GenerationDefaults {
                eos_token_ids: vec![1, 3],
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                repetition_penalty: Some(1.05),
            }
        );
    }

    #[test]
    fn tokenizer_without_flags_keeps_its_post_processor() {
        let dir = tokenizer_dir(r#"{"bos_token":"<s>","eos_token":"</s>","chat_template":null}"#);
        let b = open_dir(dir.path()).unwrap();
        let t = b.tokenizer.unwrap();
        assert!(!t.add_bos_token);
        assert_eq!(t.encode("hello world", true).unwrap(), vec![2, 3]);
        assert_eq!(t.chat_template, None);
        assert_eq!(t.eos_token_ids, vec![1]);
    }

    #[test]
    fn add_eos_and_unknown_bos_follow_transformers() {
        let dir =
            tokenizer_dir(r#"{"bos_token":"<nope>","eos_token":"</s>","add_bos_token":true,"add_eos_token":true}"#);
        let t = open_dir(dir.path()).unwrap().tokenizer.unwrap();
        assert!(!t.add_bos_token);
        // Unknown bos falls back to config.json's id for the engine's own use.
        assert_eq!(t.bos_token_id, Some(0));
        assert_eq!(t.encode("hello", true).unwrap(), vec![2, 1]);
    }

    #[test]
    fn named_chat_templates_pick_default_and_jinja_file_wins() {
        let dir = tokenizer_dir(
            r#"{"chat_template":[{"name":"tool_use","template":"T"},{"name":"default","template":"D"}]}"#,
        );
        assert_eq!(open_dir(dir.path()).unwrap().tokenizer.unwrap().chat_template.as_deref(), Some("D"));
        fs::write(dir.path().join(CHAT_TEMPLATE_FILE), "J").unwrap();
        assert_eq!(open_dir(dir.path()).unwrap().tokenizer.unwrap().chat_template.as_deref(), Some("J"));

        let dir = tokenizer_dir(r#"{"chat_template":[{"name":"tool_use","template":"T"}]}"#);
        assert_eq!(open_dir(dir.path()).unwrap().tokenizer.unwrap().chat_template, None);
        let dir = tokenizer_dir(r#"{"chat_template":7}"#);
        let (e, _) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Tokenizer { ref file, .. } if file.ends_with(TOKENIZER_CONFIG_FILE)));
    }

    #[test]
    fn broken_tokenizer_and_generation_files_are_named() {
        let dir = tokenizer_dir("{}");
        fs::write(dir.path().join(TOKENIZER_FILE), "{not json").unwrap();
        let (e, _) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Tokenizer { ref file, .. } if file.ends_with(TOKENIZER_FILE)));

        let dir = tokenizer_dir("{");
        let (e, _) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Tokenizer { ref file, .. } if file.ends_with(TOKENIZER_CONFIG_FILE)));

        let dir = tokenizer_dir("{}");
        fs::write(dir.path().join(GENERATION_CONFIG_FILE), "[").unwrap();
        let (e, _) = err_text(open_dir(dir.path()));
        assert!(matches!(e, ModelError::Config { ref file, .. } if file.ends_with(GENERATION_CONFIG_FILE)));
    }

    #[test]
    fn generation_eos_as_int() {
        let dir = model_dir();
        fs::write(dir.path().join(GENERATION_CONFIG_FILE), r#"{"eos_token_id":7}"#).unwrap();
        let g = read_generation_config(dir.path()).unwrap();
        assert_eq!(g.eos_token_ids, vec![7]);
        assert_eq!(g.temperature, None);
    }
}
