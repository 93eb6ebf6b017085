//! Models: finding and opening model files (HF directories, GGUF files, the embedded default),
//! weight sources over memory-mapped files, quantized block formats, and each architecture's
//! weight layout. Owns file formats and shape checks; never touches devices, scheduling or
//! per-sequence state (the KV cache is passed into backends, not owned by models).

pub mod default_model;
pub mod gguf;
pub mod glm5_next;
pub mod hf;
pub mod llama;
pub mod quant;
pub mod quantized;
pub mod synthetic;
pub mod tensor;

use std::path::{Path, PathBuf};

pub use tensor::{DType, OwnedTensor, TensorView};

/// Everything that can go wrong opening or validating a model. Messages name the file and,
/// where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: file not found{hint}", path.display())]
    MissingFile { path: PathBuf, hint: String },
    #[error("{}: tensor `{tensor}` not found", file.display())]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{}: tensor `{tensor}` has shape {found:?}, expected {expected:?}", file.display())]
    ShapeMismatch { file: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{}: tensor `{tensor}` has unsupported dtype {dtype}", file.display())]
    UnsupportedDType { file: PathBuf, tensor: String, dtype: String },
    #[error(
        "{}: tensor {tensor} is stored with quantization scheme {scheme}, which this build cannot compute with \
         (quantized formats supported: GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; safetensors FP8 with \
         128x128 block scales, compressed-tensors int4 pack-quantized and NVFP4, weight-only); refusing \
         rather than converting it to another precision",
        file.display()
    )]
    UnsupportedQuantization { file: PathBuf, scheme: String, tensor: String },
    #[error("{}: unsupported architecture `{arch}` (supported: llama, mistral, qwen2, qwen3)", file.display())]
    UnsupportedArchitecture { file: PathBuf, arch: String },
    #[error("{}: invalid file: {msg}", file.display())]
    Format { file: PathBuf, msg: String },
    #[error("{}: invalid config: {msg}", file.display())]
    Config { file: PathBuf, msg: String },
    #[error("{}: tokenizer: {msg}", file.display())]
    Tokenizer { file: PathBuf, msg: String },
    #[error("fetching the default model failed: {0}")]
    Fetch(String),
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile { path: path.to_path_buf(), hint: String::new() }
        } else {
            ModelError::Io { path: path.to_path_buf(), source }
        }
    }
}

/// A set of named tensors, looked up by their HF name (`model.layers.0.self_attn.q_proj.weight`).
/// GGUF sources translate their own names and layouts to this convention.
pub trait WeightSource: Send + Sync {
    /// Where the weights come from (file or directory), for messages.
    fn origin(&self) -> &Path;
    /// The file holding `name`, for messages (defaults to the origin).
    fn file_of(&self, _name: &str) -> PathBuf {
        self.origin().to_path_buf()
    }
    fn tensor(&self, name: &str) -> Option<TensorView<'_>>;
    fn tensor_names(&self) -> Vec<String>;

    /// The quantization scheme this source's projections are stored in (`None`: plain tensors;
    /// see [`quantized`]). Backends that cannot compute in it must refuse the source.
    fn quantization(&self) -> Option<&quantized::QuantScheme> {
        None
    }

    /// Any tensor as stored, including those [`tensor`](Self::tensor) does not return (packed
    /// integers and FP8 codes of a quantized checkpoint).
    fn raw_tensor(&self, _name: &str) -> Option<quantized::RawTensor<'_>> {
        None
    }

    /// Look up a tensor and check its shape, with an error that names file, tensor and shapes.
    fn expect(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>, ModelError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor { file: self.file_of(name), tensor: name.to_string() })?;
        if t.shape != shape {
            return Err(ModelError::ShapeMismatch {
                file: self.file_of(name),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        Ok(t)
    }
}

/// Sampling defaults a model ships with (HF `generation_config.json`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

/// An opened model: its config, weights, optional tokenizer and generation defaults.
pub struct ModelBundle {
    /// Display name (`default`, a directory or file name).
    pub name: String,
    pub config: crate::config::LlamaConfig,
    pub weights: Box<dyn WeightSource>,
    /// `None` for a directory without tokenizer files: usable with token ids only.
    pub tokenizer: Option<crate::tokenizer::TokenizerBundle>,
    pub generation: GenerationDefaults,
}

impl ModelBundle {
    /// Bytes of every tensor as stored (quantized where the file is): what a decode step reads,
    /// for the capacity card and for pricing a draft model against its target.
    pub fn stored_weight_bytes(&self) -> u64 {
        let w = &self.weights;
        let bytes = |n: &String| w.tensor(n).map(|t| t.data.len()).or_else(|| w.raw_tensor(n).map(|t| t.data.len()));
        w.tensor_names().iter().filter_map(bytes).map(|b| b as u64).sum()
    }

    /// Ids that end generation: the tokenizer's end-of-generation set, else the config's.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.generation.eos_token_ids.clone();
        if let Some(t) = &self.tokenizer {
            ids.extend(&t.eos_token_ids);
        }
        ids.extend(&self.config.eos_token_ids);
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Open a model given on the command line: `default` (the embedded SmolLM2, fetched on first
/// use), a `.gguf` file, or an HF model directory.
pub fn open(spec: &str, cache: &default_model::CacheDir) -> Result<ModelBundle, ModelError> {
    if spec == default_model::DEFAULT_MODEL_NAME {
        let path = default_model::ensure_default(cache, true)?;
        let mut bundle = gguf::open_file(&path)?;
        bundle.name = default_model::DEFAULT_MODEL_NAME.to_string();
        return Ok(bundle);
    }
    let path = Path::new(spec);
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            hint: " (give a model directory, a .gguf file, or `default`)".into(),
        });
    }
    if path.is_dir() && glm5_next::is_glm5_dir(path) {
        glm5_next::open_dir(path)
    } else if path.is_dir() {
        hf::open_dir(path)
    } else {
        gguf::open_file(path)
    }
}
