//! The README's library example is `host/examples/quickstart.rs` verbatim, so that the example
//! that `cargo build --examples` compiles is the one people read.

use std::path::Path;

#[test]
fn readme_example_is_the_quickstart_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (Ok(readme), Ok(example)) = (
        std::fs::read_to_string(root.join("../README.md")),
        std::fs::read_to_string(root.join("examples/quickstart.rs")),
    ) else {
        // The GPU bundle carries no sources.
        eprintln!("README.md or examples/quickstart.rs not found; skipped");
        return;
    };
    let code = example
        .split_once("\n\n")
        .map(|(_, body)| body)
        .expect("the example starts with a doc comment");
    let block = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("README has a ```rust block");
    assert_eq!(
        block, code,
        "README's example and host/examples/quickstart.rs differ"
    );
}
