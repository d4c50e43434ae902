//! Inline PTX has one home: `src/device/ptx/`. This fails if `asm!` or `global_asm!` appears in
//! any other source file of the kernel crate.

use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn inline_asm_only_in_the_ptx_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let ptx_dir = src.join("device").join("ptx");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(
        files.len() > 5,
        "found only {} files under {}",
        files.len(),
        src.display()
    );
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| !f.starts_with(&ptx_dir))
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("readable file");
            text.contains("asm!(")
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "inline asm outside device/ptx/: {offenders:?}"
    );
}
