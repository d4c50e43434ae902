//! Running commands and finding the repository.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (the parent of this crate's directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Runs `cmd`, echoing it, and fails with its status if it does not succeed.
pub fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("+ {}", show(cmd));
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start {}: {e}", show(cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{} failed with {status}", show(cmd)))
    }
}

/// Runs `cmd` and returns its standard output (standard error passes through).
pub fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot start {}: {e}", show(cmd)))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed with {}:\n{}",
            show(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The command line as text, for messages.
pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Whether an executable of this name is on PATH (or is an existing path).
pub fn which(name: &str) -> Option<PathBuf> {
    let p = Path::new(name);
    if p.is_absolute() {
        return p.is_file().then(|| p.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|c| c.is_file())
    })
}
