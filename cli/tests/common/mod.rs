//! Helpers shared by the CLI's integration tests.

use std::path::{Path, PathBuf};

/// The CLI binary to run: `FLASH_ATTN_CLI` if set, else the one cargo built, else (in the GPU
/// bundle, where the test binaries sit in `bundle/tests/`) `bundle/bin/flash-attn-cli`.
pub fn cli() -> PathBuf {
    if let Some(p) = std::env::var_os("FLASH_ATTN_CLI") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_flash-attn-cli"));
    if built.is_file() {
        return built;
    }
    let exe = std::env::current_exe().expect("current_exe");
    let bundled = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("bin/flash-attn-cli"));
    match bundled {
        Some(p) if p.is_file() => p,
        _ => panic!(
            "flash-attn-cli not found at {} nor in the bundle; set FLASH_ATTN_CLI",
            built.display()
        ),
    }
}
