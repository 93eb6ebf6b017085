//! Shared helpers for integration tests: locating the real default model.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use shelfserve::model::default_model::{ensure_default, CacheDir};

/// The SmolLM2 GGUF: `SHELFSERVE_DEFAULT_GGUF` if set, else the default model from the cache
/// (fetched once per test binary). Without it a test is skipped with a printed reason — except
/// under CI (`CI` set), where a missing model is a failure, never a silent pass.
pub fn default_gguf() -> Option<PathBuf> {
    static PATH: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("SHELFSERVE_DEFAULT_GGUF") {
            return Ok(PathBuf::from(p));
        }
        ensure_default(&CacheDir::from_env(), false).map_err(|e| e.to_string())
    });
    match r {
        Ok(p) => Some(p.clone()),
        Err(e) if std::env::var_os("CI").is_some() => panic!("default model unavailable under CI: {e}"),
        Err(e) => {
            eprintln!("skipped: default model unavailable: {e}");
            None
        }
    }
}

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}
