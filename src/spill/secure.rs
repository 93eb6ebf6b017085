//! File-system rules that keep the spill tier from being aimed: who may own the directory, how
//! page files are created (never through a symlink, never over an existing file) and opened
//! (never a FIFO, a device or someone else's file), and the per-directory secret that keys the
//! pages' MACs. Unix only: the whole spill tier is.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::format::KEY_BYTES;

/// Name of the per-directory secret, next to the pages.
pub const KEY_FILE: &str = "spill.key";

/// The effective user id of this process.
pub fn our_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why a directory may not hold spill files, or `None` when it may: it must be ours and writable
/// by nobody else (a directory others can write lets them plant links and files in it).
pub fn dir_refusal(owner: u32, mode: u32, us: u32) -> Option<String> {
    if owner != us {
        return Some(format!("it is owned by uid {owner}, not by this server (uid {us})"));
    }
    if mode & 0o022 != 0 {
        return Some(format!("its mode {:o} lets group or others write it (chmod go-w, or 0700)", mode & 0o7777));
    }
    None
}

/// Creates `dir` (and missing parents) 0700, or checks an existing one with [`dir_refusal`].
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    match fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => DirBuilder::new().recursive(true).mode(0o700).create(dir)?,
        Err(e) => return Err(e),
    }
    // Following a link here is fine: what matters is the directory the files land in.
    let meta = fs::metadata(dir)?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!("{} is not a directory", dir.display())));
    }
    match dir_refusal(meta.uid(), meta.mode(), our_uid()) {
        Some(why) => Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("{}: {why}", dir.display()))),
        None => Ok(()),
    }
}

/// Creates a new file 0600: fails if anything (a file, a link, a FIFO) is already at `path`.
pub fn create_new_private(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// What is at a path we were about to read.
#[derive(Debug)]
pub enum Opened {
    File(File),
    /// Nothing there.
    Missing,
    /// A symlink, FIFO, socket, device, directory, or a file another user owns: not read.
    NotRegular(String),
}

/// Opens a file for reading only if it is a regular file this process owns. The open itself
/// never follows a link and never blocks (a FIFO without a writer would block a plain open).
pub fn open_own_regular(path: &Path) -> io::Result<Opened> {
    let opened =
        OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY).open(path);
    let f = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Opened::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(Opened::NotRegular("a symlink".into())),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Ok(Opened::NotRegular(format!("not a regular file ({:?})", meta.file_type())));
    }
    if meta.uid() != our_uid() {
        return Ok(Opened::NotRegular(format!("owned by uid {}", meta.uid())));
    }
    Ok(Opened::File(f))
}

/// Reads the directory's secret, creating it (0600, through a temp name, so a crash never leaves
/// half a key) when absent. `Ok(None)` means there is no usable key file: a new one was needed
/// although the directory already had one that cannot be trusted (the caller discards every page,
/// since none can be verified, and calls again).
pub fn load_or_create_key(dir: &Path) -> io::Result<Option<[u8; KEY_BYTES]>> {
    let path = dir.join(KEY_FILE);
    match open_own_regular(&path)? {
        Opened::File(mut f) => {
            let mode = f.metadata()?.mode();
            let mut key = [0u8; KEY_BYTES];
            let mut rest = Vec::new();
            let whole = f.read_exact(&mut key).and_then(|_| f.read_to_end(&mut rest));
            if mode & 0o077 != 0 || whole.is_err() || !rest.is_empty() {
                tracing::warn!(path = %path.display(), "the spill key is readable by others or malformed; replacing it");
                fs::remove_file(&path)?;
                return Ok(None);
            }
            Ok(Some(key))
        }
        Opened::NotRegular(why) => {
            tracing::warn!(path = %path.display(), why, "the spill key is not a regular file of ours; replacing it");
            fs::remove_file(&path)?;
            Ok(None)
        }
        Opened::Missing => {
            let key: [u8; KEY_BYTES] = rand::random();
            let tmp = dir.join(format!("{KEY_FILE}.tmp"));
            let _ = fs::remove_file(&tmp);
            let mut f = create_new_private(&tmp)?;
            f.write_all(&key)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)?;
            sync_dir(dir)?;
            Ok(Some(key))
        }
    }
}

/// Makes renames and unlinks in `dir` durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_directory_of_ours_that_nobody_else_can_write_is_accepted() {
        assert_eq!(dir_refusal(1000, 0o40700, 1000), None);
        assert_eq!(dir_refusal(1000, 0o40755, 1000), None, "others may read and list");
        assert!(dir_refusal(1001, 0o40700, 1000).expect("refused").contains("owned by uid 1001"));
        assert!(dir_refusal(0, 0o40700, 1000).is_some(), "root's directory is not ours either");
        assert!(dir_refusal(1000, 0o40770, 1000).expect("refused").contains("group or others"));
        assert!(dir_refusal(1000, 0o41777, 1000).is_some(), "sticky world-writable /tmp-like");
        assert!(dir_refusal(1000, 0o40702, 1000).is_some());
    }

    #[test]
    fn a_new_directory_is_0700_and_a_world_writable_one_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("a/b");
        ensure_private_dir(&dir).expect("created");
        assert_eq!(fs::metadata(&dir).expect("meta").permissions().mode() & 0o777, 0o700);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
        let err = ensure_private_dir(&dir).expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("group or others"), "{err}");
    }

    #[test]
    fn creating_never_follows_or_replaces_and_opening_skips_links_and_fifos() {
        let tmp = tempfile::tempdir().expect("tmp");
        let target = tmp.path().join("victim");
        fs::write(&target, b"precious").expect("victim");
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert!(create_new_private(&link).is_err(), "a link is never written through");
        assert!(create_new_private(&target).is_err(), "an existing file is never replaced");
        assert_eq!(fs::read(&target).expect("read"), b"precious");
        assert!(matches!(open_own_regular(&link).expect("open"), Opened::NotRegular(_)));
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().expect("utf8")).expect("cstr");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(open_own_regular(&fifo).expect("no hang"), Opened::NotRegular(_)));
        assert!(matches!(open_own_regular(&tmp.path().join("none")).expect("open"), Opened::Missing));
        assert!(matches!(open_own_regular(&target).expect("open"), Opened::File(_)));
    }

    #[test]
    fn the_key_is_created_once_0600_and_a_readable_one_is_replaced() {
        let tmp = tempfile::tempdir().expect("tmp");
        let k1 = load_or_create_key(tmp.path()).expect("io").expect("created");
        let path = tmp.path().join(KEY_FILE);
        assert_eq!(fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o600);
        assert_eq!(load_or_create_key(tmp.path()).expect("io"), Some(k1), "the same key on reopen");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
        assert_eq!(load_or_create_key(tmp.path()).expect("io"), None, "an exposed key is not trusted");
        let k2 = load_or_create_key(tmp.path()).expect("io").expect("created");
        assert_ne!(k1, k2);
    }
}
