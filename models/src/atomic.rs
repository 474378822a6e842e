//! Files that are either whole or untouched: every write of a model, checkpoint, metrics
//! or summary goes to a temporary file beside its target (`.NAME.tmp-PID`, same directory,
//! so the rename cannot cross file systems), is flushed to disk, and only then renamed
//! over the target. A write that fails (disk full, a file-size limit, a kill) leaves the
//! old file as it was; the temporary is removed on failure, and temporaries left by a
//! process that died are removed by [`remove_stale_temps`] the next time the target is
//! written.
//!
//! Several files that belong together (a model directory's `config.json`,
//! `model.safetensors` and `tokenizer.json`) are [`Staged`]: all of them are written to
//! temporaries first, which is where a write can fail, and renamed into place only when
//! every one is complete, so a failure leaves the old directory whole and loadable.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The temporary `path` is written to: `.NAME.tmp-PID` in the same directory.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    parent_dir(path).join(format!(".{name}.tmp-{}", std::process::id()))
}

/// The directory `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Writes `path` atomically with `write` (given a buffered writer on the temporary).
/// Errors name the file.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let mut staged = Staged::default();
    staged.write(path, write)?;
    staged.commit()
}

/// [`write_atomic`] of a byte string.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic(path, |w| w.write_all(bytes))
}

/// Removes the temporaries of `path` (`.NAME.tmp-PID`) whose process is no longer
/// running (on Linux, where that can be told from `/proc`; elsewhere only this process's
/// own). Returns how many were removed.
pub fn remove_stale_temps(path: &Path) -> io::Result<usize> {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(0);
    };
    let prefix = format!(".{name}.tmp-");
    let dir = parent_dir(path);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = file
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = pid != std::process::id() && process_alive(pid);
        if !alive && entry.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Whether process `pid` is running (on Linux; elsewhere every other process counts as
/// running, so only this process's temporaries are ever removed).
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new(&format!("/proc/{pid}")).exists()
    } else {
        true
    }
}

/// Files written to temporaries, renamed into place together by [`Staged::commit`];
/// dropped uncommitted, it removes its temporaries and leaves the targets untouched.
#[derive(Debug, Default)]
pub struct Staged {
    /// `(temporary, target)`, in the order they were written.
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// Writes `path`'s new contents to its temporary with `write`, then flushes it to disk.
    pub fn write(
        &mut self,
        path: &Path,
        write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
    ) -> io::Result<()> {
        self.write_with(path, |tmp| {
            let mut w = BufWriter::new(File::create(tmp)?);
            write(&mut w)?;
            w.into_inner().map_err(|e| e.into_error())?.sync_all()
        })
    }

    /// Lets `write` create `path`'s temporary itself (for writers that take a path, such
    /// as `safetensors::serialize_to_file`), then flushes it to disk.
    pub fn write_with(
        &mut self,
        path: &Path,
        write: impl FnOnce(&Path) -> io::Result<()>,
    ) -> io::Result<()> {
        // A symlink's target is what gets replaced (the link stays). Only a regular file
        // (or nothing) is replaced: renaming over a device or a FIFO (`/dev/full`, a pipe
        // a user meant to stream to) would remove it.
        let resolved;
        let path = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                resolved = std::fs::canonicalize(path)
                    .map_err(|e| named(path, "cannot follow the link", e))?;
                resolved.as_path()
            }
            _ => path,
        };
        if let Ok(meta) = std::fs::metadata(path) {
            if !meta.is_file() {
                return Err(named(
                    path,
                    "cannot write",
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "it exists and is not a regular file (a directory, FIFO or device); give the path of a plain file",
                    ),
                ));
            }
        }
        remove_stale_temps(path).map_err(|e| named(path, "cannot remove old temporaries", e))?;
        let tmp = temp_path(path);
        // Registered first, so a failure below removes what was written.
        self.files.push((tmp.clone(), path.to_path_buf()));
        write(&tmp).map_err(|e| named(path, "cannot write", e))?;
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| named(path, "cannot flush", e))
    }

    /// Renames every temporary over its target (in the order written) and flushes the
    /// directories. Renames within a directory do not need space, so once every file is
    /// written this does not fail on a full disk.
    pub fn commit(mut self) -> io::Result<()> {
        let files = std::mem::take(&mut self.files);
        let mut dirs: Vec<PathBuf> = Vec::new();
        for (i, (tmp, path)) in files.iter().enumerate() {
            if let Err(e) = std::fs::rename(tmp, path) {
                // Put the rest back in `self`, so drop removes their temporaries.
                self.files = files[i..].to_vec();
                return Err(named(path, "cannot move the new file into place", e));
            }
            let d = parent_dir(path).to_path_buf();
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
        for d in dirs {
            // A directory's entries reach the disk when it is synced (Unix); where a
            // directory cannot be opened as a file, the rename is as durable as it gets.
            if let Ok(f) = File::open(&d) {
                let _ = f.sync_all();
            }
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// An I/O error that names its file and what was being done.
fn named(path: &Path, doing: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {doing}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hilore-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let d = dir("fail");
        let p = d.join("a.json");
        std::fs::write(&p, b"old").unwrap();
        let e = write_atomic(&p, |w| {
            w.write_all(b"new, half")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("a.json"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "a temporary was left"
        );
        write_bytes_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
    }

    #[test]
    fn staged_files_move_together_or_not_at_all() {
        let d = dir("staged");
        let (a, b) = (d.join("config.json"), d.join("model.safetensors"));
        std::fs::write(&a, b"old a").unwrap();
        std::fs::write(&b, b"old b").unwrap();
        {
            let mut s = Staged::default();
            s.write(&a, |w| w.write_all(b"new a")).unwrap();
            assert!(s.write(&b, |_| Err(io::Error::other("no space"))).is_err());
            // Dropped uncommitted.
        }
        assert_eq!(std::fs::read(&a).unwrap(), b"old a");
        assert_eq!(std::fs::read(&b).unwrap(), b"old b");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
        let mut s = Staged::default();
        s.write(&a, |w| w.write_all(b"new a")).unwrap();
        s.write(&b, |w| w.write_all(b"new b")).unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"new a");
        assert_eq!(std::fs::read(&b).unwrap(), b"new b");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
    }

    #[test]
    fn only_regular_files_are_replaced() {
        let d = dir("special");
        let link = d.join("link");
        std::fs::write(d.join("target"), b"kept").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(d.join("target"), &link).unwrap();
        #[cfg(unix)]
        {
            // Through a link: its target is replaced, the link kept.
            write_bytes_atomic(&link, b"new").unwrap();
            assert_eq!(std::fs::read(d.join("target")).unwrap(), b"new");
            assert!(std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink());
            // A FIFO is refused and left in place.
            let fifo = d.join("fifo");
            assert!(std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success());
            let e = write_bytes_atomic(&fifo, b"new").unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
            assert!(!std::fs::metadata(&fifo).unwrap().is_file());
        }
        let e = write_bytes_atomic(&d, b"new").unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn temporaries_of_dead_processes_are_removed() {
        let d = dir("stale");
        let p = d.join("run.ckpt");
        // A pid above Linux's limit (2^22) cannot be running.
        let dead = d.join(".run.ckpt.tmp-4194400");
        std::fs::write(&dead, b"partial").unwrap();
        let other = d.join(".other.tmp-4194400");
        std::fs::write(&other, b"not ours").unwrap();
        write_bytes_atomic(&p, b"whole").unwrap();
        if cfg!(target_os = "linux") {
            assert!(!dead.exists());
        }
        assert!(other.exists(), "another file's temporary was removed");
        assert_eq!(std::fs::read(&p).unwrap(), b"whole");
    }
}
