//! Compiled kernel modules: NVRTC compiles each module straight to a CUBIN for the device's
//! exact architecture (so the driver has no PTX to JIT at load), the modules of a backend in
//! parallel, and keeps the CUBIN under the cache directory keyed by everything that decides it
//! (NVRTC version, architecture, options, full source). A second start loads them from disk.
//!
//! `SHELFSERVE_KERNEL_CACHE=off` turns the disk cache off; `SHELFSERVE_KERNEL_CACHE=DIR` puts it
//! elsewhere (default: `<cache>/kernels`, the cache of the default model).

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

use crate::backend::BackendError;

/// Where compiled modules are kept (`None`: compile every time).
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

/// One module to build: its name (for messages and file names) and its full source.
pub struct ModuleSource<'a> {
    pub name: &'a str,
    pub source: String,
}

impl KernelCache {
    pub fn from_env() -> Self {
        let dir = match std::env::var("SHELFSERVE_KERNEL_CACHE") {
            Ok(v) if v == "off" || v == "0" => None,
            Ok(v) if !v.is_empty() => Some(PathBuf::from(v)),
            _ => Some(crate::model::default_model::CacheDir::from_env().path().join("kernels")),
        };
        KernelCache { dir }
    }

    pub fn disabled() -> Self {
        KernelCache { dir: None }
    }

    /// CUBINs of `modules` for `sm_{major}{minor}`, compiled on one thread each where the disk
    /// does not have them.
    pub fn cubins(
        &self,
        modules: &[ModuleSource<'_>],
        arch: (i32, i32),
        defines: &[String],
    ) -> Result<Vec<Vec<u8>>, BackendError> {
        std::thread::scope(|s| {
            let jobs: Vec<_> = modules.iter().map(|m| s.spawn(move || self.cubin(m, arch, defines))).collect();
            jobs.into_iter()
                .map(|j| {
                    j.join().unwrap_or_else(|_| Err(BackendError::Device("kernel compile thread panicked".into())))
                })
                .collect()
        })
    }

    fn cubin(&self, m: &ModuleSource<'_>, arch: (i32, i32), defines: &[String]) -> Result<Vec<u8>, BackendError> {
        let options = nvrtc_options(arch, defines);
        let path = self.path(m, &options);
        if let Some(bytes) = path.as_deref().and_then(read_cached) {
            return Ok(bytes);
        }
        let started = std::time::Instant::now();
        let cubin = compile_cubin(m.name, &m.source, &options)?;
        tracing::debug!(module = m.name, ms = started.elapsed().as_millis() as u64, "kernels compiled");
        if let Some(p) = path {
            if let Err(e) = write_cached(&p, &cubin) {
                tracing::debug!(path = %p.display(), error = %e, "kernel cache not written");
            }
        }
        Ok(cubin)
    }

    /// Forget a cached module that the driver refused (a truncated or foreign file).
    pub fn evict(&self, m: &ModuleSource<'_>, arch: (i32, i32), defines: &[String]) {
        if let Some(p) = self.path(m, &nvrtc_options(arch, defines)) {
            let _ = std::fs::remove_file(p);
        }
    }

    fn path(&self, m: &ModuleSource<'_>, options: &[String]) -> Option<PathBuf> {
        let d = self.dir.as_ref()?;
        Some(d.join(format!("{}-{}.cubin", m.name, key(&nvrtc_version(), options, &m.source))))
    }
}

pub fn nvrtc_options((major, minor): (i32, i32), defines: &[String]) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture=sm_{major}{minor}"), "--std=c++17".into()];
    options.extend(defines.iter().map(|d| format!("--define-macro={d}")));
    options
}

fn key(nvrtc_version: &str, options: &[String], source: &str) -> String {
    let mut h = Sha256::new();
    h.update(nvrtc_version.as_bytes());
    for o in options {
        h.update((o.len() as u64).to_le_bytes());
        h.update(o.as_bytes());
    }
    h.update(source.as_bytes());
    h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
}

fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters, written by the library.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    format!("nvrtc {major}.{minor}")
}

/// A cached CUBIN is an ELF file; anything else is ignored (and overwritten by the compile).
fn read_cached(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    bytes.starts_with(b"\x7fELF").then_some(bytes)
}

fn write_cached(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp =
        dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("k"), std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// NVRTC to a CUBIN (the options name a real architecture, `sm_XY`).
fn compile_cubin(module: &str, src: &str, options: &[String]) -> Result<Vec<u8>, BackendError> {
    let fail = |what: &str, detail: String| {
        BackendError::Device(format!("NVRTC failed on cuda/{module}.cu ({what}): {detail}"))
    };
    let src_c = CString::new(src).map_err(|e| fail("source", e.to_string()))?;
    let name_c = CString::new(format!("{module}.cu")).map_err(|e| fail("name", e.to_string()))?;
    let prog = nvrtc::create_program(&src_c, Some(&name_c)).map_err(|e| fail("create", format!("{e:?}")))?;
    struct Program(nvrtc_sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { nvrtc::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    // SAFETY: a live program and valid option strings.
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, options) } {
        // SAFETY: the log of the live program.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .map(|l| unsafe { std::ffi::CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Err(fail("compile", format!("{e:?}\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: an out-parameter, then a buffer of exactly that size.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| fail("cubin size", format!("{e:?}")))?;
    let mut cubin = vec![0u8; size];
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| fail("cubin", format!("{e:?}")))?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_changes_with_every_input_and_only_elf_files_are_read_back() {
        let o = nvrtc_options((9, 0), &[]);
        let k = key("12.8", &o, "src");
        assert_eq!(k, key("12.8", &o, "src"));
        assert_ne!(k, key("12.8", &o, "src2"));
        assert_ne!(k, key("13.0", &o, "src"));
        assert_ne!(k, key("12.8", &nvrtc_options((8, 0), &[]), "src"));
        assert_ne!(k, key("12.8", &nvrtc_options((9, 0), &["X=1".into()]), "src"));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.cubin");
        write_cached(&p, b"\x7fELFbody").unwrap();
        assert_eq!(read_cached(&p).as_deref(), Some(&b"\x7fELFbody"[..]));
        std::fs::write(&p, b"garbage").unwrap();
        assert_eq!(read_cached(&p), None);
    }
}
