//! GGUF reader: parses GGUF (v2/v3, little-endian) metadata and tensor infos over a memory map,
//! validates every offset and size against the file, and opens `llama`-architecture files as a
//! [`ModelBundle`] whose weights are served under HF names. Owns the GGUF container format, the
//! GGUF→HF tensor naming, and undoing llama.cpp's q/k row permutation; block decoding lives in
//! `quant`, tokenizer construction in `tokenizer::gguf_vocab`.
//!
//! Files: `types` (GGML type ids, metadata values), `file` (reader, header, tensor infos, typed
//! metadata), `weights` (HF names, q/k un-permutation), `config` (config from metadata, opening
//! a bundle).

mod config;
mod file;
mod types;
mod weights;

pub use config::open_file;
pub use file::{GgufFile, GgufTensorInfo};
pub use types::{GgmlType, MetaArray, MetaValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};
pub use weights::{hf_tensor_name, unpermute_qk_rows, GgufWeights};

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;
