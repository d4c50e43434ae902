//! Output files: checked before the forward pass, written through a temporary file.
//!
//! [`check_aliases`] refuses an output that names an input or another output (the same
//! path, or the same file through a symlink or hard link). [`PendingOutput::prepare`] creates
//! the temporary file next to the target before any computing, which is the real test that
//! the target can be written; [`PendingOutput::commit`] renames it into place only once all of
//! it is on disk, so a failed write (a full disk) leaves an earlier file of that name intact,
//! and an error before the commit leaves no temporary file behind.

use crate::error::{CliError, Result};
use std::fs::{File, Metadata};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What identifies a file: (device, inode) for one that exists, which sees through symlinks
/// and hard links, else the path with its directory canonicalized.
#[derive(Debug, PartialEq, Eq)]
enum FileId {
    Inode(u64, u64),
    Path(PathBuf),
}

fn file_id(path: &Path) -> FileId {
    if let Ok(meta) = std::fs::metadata(path) {
        if let Some(id) = inode(&meta) {
            return id;
        }
        if let Ok(p) = path.canonicalize() {
            return FileId::Path(p);
        }
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (parent.canonicalize(), path.file_name()) {
        (Ok(dir), Some(name)) => FileId::Path(dir.join(name)),
        _ => FileId::Path(path.to_path_buf()),
    }
}

#[cfg(unix)]
fn inode(meta: &Metadata) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    Some(FileId::Inode(meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn inode(_: &Metadata) -> Option<FileId> {
    None
}

/// Fails with [`CliError::Alias`] if an output is the same file as an input or as another
/// output. Inputs may name one file several times.
pub fn check_aliases(
    inputs: &[(&'static str, &Path)],
    outputs: &[(&'static str, &Path)],
) -> Result<()> {
    let input_ids: Vec<FileId> = inputs.iter().map(|(_, p)| file_id(p)).collect();
    let output_ids: Vec<FileId> = outputs.iter().map(|(_, p)| file_id(p)).collect();
    for (i, ((what, path), id)) in outputs.iter().zip(&output_ids).enumerate() {
        let earlier_outputs = outputs.iter().zip(&output_ids).take(i);
        let clash = inputs
            .iter()
            .zip(&input_ids)
            .chain(earlier_outputs)
            .find(|(_, other)| *other == id);
        if let Some(((other, other_path), _)) = clash {
            return Err(CliError::Alias {
                what,
                path: path.to_path_buf(),
                other,
                other_path: other_path.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// An output file being written: a temporary file in the target's directory, or the target
/// itself when that is not a regular file (`/dev/null`, a FIFO), which cannot be replaced.
#[derive(Debug)]
pub struct PendingOutput {
    what: &'static str,
    /// The path as given, for messages.
    path: PathBuf,
    /// What is replaced: the path, or the file a symlink there points to.
    target: PathBuf,
    file: Sink,
}

#[derive(Debug)]
enum Sink {
    Temp(tempfile::NamedTempFile),
    Direct(File),
}

impl PendingOutput {
    /// Checks that `path` can be written and creates its temporary file; `what` names the
    /// output in messages (`-o`, `--npy-out O`, ...).
    pub fn prepare(what: &'static str, path: &Path) -> Result<Self> {
        let unwritable = |reason: String| CliError::Unwritable {
            what,
            path: path.to_path_buf(),
            reason,
        };
        let existing = std::fs::metadata(path).ok();
        if let Some(meta) = &existing {
            if meta.is_dir() {
                return Err(unwritable("it is a directory".into()));
            }
            if meta.permissions().readonly() {
                return Err(unwritable("the existing file is read-only".into()));
            }
            if !meta.is_file() {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| unwritable(e.to_string()))?;
                return Ok(PendingOutput {
                    what,
                    path: path.to_path_buf(),
                    target: path.to_path_buf(),
                    file: Sink::Direct(file),
                });
            }
        }
        // Through a symlink, the file it points to is replaced, as a plain write would.
        let target = match &existing {
            Some(_) => path.canonicalize().map_err(|e| unwritable(e.to_string()))?,
            None => path.to_path_buf(),
        };
        let name = target
            .file_name()
            .ok_or_else(|| unwritable("not a file name".into()))?;
        let dir = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(unwritable(format!(
                "directory {} does not exist",
                dir.display()
            )));
        }
        let mut prefix = std::ffi::OsString::from(".");
        prefix.push(name);
        prefix.push(".");
        // Mode 0o666 goes through the umask like any new file's; an existing file's mode is
        // kept below.
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".tmp");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            builder.permissions(std::fs::Permissions::from_mode(0o666));
        }
        let temp = builder
            .tempfile_in(dir)
            .map_err(|e| unwritable(e.to_string()))?;
        if let Some(meta) = existing {
            temp.as_file()
                .set_permissions(meta.permissions())
                .map_err(|e| unwritable(e.to_string()))?;
        }
        Ok(PendingOutput {
            what,
            path: path.to_path_buf(),
            target,
            file: Sink::Temp(temp),
        })
    }

    /// The path as given on the command line.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the whole content with `write` and flushes it to disk (not yet in place).
    pub fn fill(
        &mut self,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<()> {
        let file = match &mut self.file {
            Sink::Temp(t) => t.as_file_mut(),
            Sink::Direct(f) => f,
        };
        let mut w = std::io::BufWriter::new(file);
        let done = write(&mut w)
            .and_then(|()| w.flush())
            .and_then(|()| w.get_ref().sync_all().or_else(ignore_unsupported_sync));
        done.map_err(|e| CliError::Unwritable {
            what: self.what,
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }

    /// Renames the temporary file over the target.
    pub fn commit(self) -> Result<()> {
        match self.file {
            Sink::Temp(t) => t.persist(&self.target).map(drop).map_err(|e| CliError::Io {
                path: self.path,
                source: e.error,
            }),
            Sink::Direct(_) => Ok(()),
        }
    }
}

/// `sync_all` on a device or FIFO (`/dev/null`) may fail with EINVAL; that is not a failed
/// write.
fn ignore_unsupported_sync(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::InvalidInput {
        Ok(())
    } else {
        Err(e)
    }
}
