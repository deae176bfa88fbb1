//! Every fuzz target's seeds and regression cases run through the target's own checks
//! (`fuzz/targets/TARGET.rs`, which the cargo-fuzz binaries run too) on stable Rust, a few
//! seconds in all: an input that once found a bug keeps being tried, and the seeds a fresh
//! checkout's fuzzing starts from (`fuzz/run.sh`) stay valid. The seeds are
//! `fuzz/seeds/TARGET.hex`, an input per line in hex (a corpus merged to one input per coverage
//! edge); the regression cases are files in `fuzz/regressions/TARGET/`, each named for what it
//! found or tests and listed in `fuzz/regressions/README.md`.
//!
//! Nothing is skipped quietly: a target without seeds, without a folder of regression cases (or
//! with an empty one), a case the README does not list, and a target in `fuzz/targets/` or
//! `fuzz/fuzz_targets/` that this file does not replay all fail, saying what to do.

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// Every target this file replays: its `fuzz/targets/` module, and a `#[test]` of its own in
/// `replays` (named for the target) over its seeds and regression cases.
macro_rules! targets {
    ($($name:ident: $path:literal,)*) => {
        $(
            #[path = $path]
            mod $name;
        )*

        const TARGETS: &[&str] = &[$(stringify!($name)),*];

        mod replays {
            $(
                #[test]
                fn $name() {
                    super::replay(stringify!($name), super::$name::run);
                }
            )*
        }
    };
}

targets! {
    control_api: "../fuzz/targets/control_api.rs",
    executor_link: "../fuzz/targets/executor_link.rs",
    frame_reader: "../fuzz/targets/frame_reader.rs",
    graph_decode: "../fuzz/targets/graph_decode.rs",
    graph_exec: "../fuzz/targets/graph_exec.rs",
    message_decode: "../fuzz/targets/message_decode.rs",
    principals: "../fuzz/targets/principals.rs",
    rdma_session: "../fuzz/targets/rdma_session.rs",
    registration: "../fuzz/targets/registration.rs",
    tensor_layout: "../fuzz/targets/tensor_layout.rs",
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The plain files in `dir`, sorted; an error names what is missing.
fn files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// `target`'s regression cases, each with its name as the README lists it (`TARGET/FILE`).
fn regressions(target: &str) -> Result<Vec<(String, PathBuf)>, String> {
    let what_to_do = "every fuzz target keeps inputs worth replaying there: the input of each of \
                      its findings, or, for a target with none yet, hand-made inputs at its limits \
                      (a length exactly at a limit and one byte over, the largest count allowed), \
                      each named for what it found or tests, with a line in fuzz/regressions/README.md";
    let dir = fuzz_dir().join("regressions").join(target);
    let paths = files(&dir).map_err(|e| format!("fuzz/regressions/{target}/ is missing ({e}): {what_to_do}"))?;
    if paths.is_empty() {
        return Err(format!("fuzz/regressions/{target}/ holds no input: {what_to_do}"));
    }
    Ok(paths
        .into_iter()
        .map(|p| (format!("{target}/{}", p.file_name().expect("a file name").to_string_lossy()), p))
        .collect())
}

/// Runs `target` on each of its seeds and regression cases, naming the input that fails.
fn replay(target: &str, run: fn(&[u8])) {
    let fuzz = fuzz_dir();
    let seeds = std::fs::read_to_string(fuzz.join("seeds").join(format!("{target}.hex")))
        .unwrap_or_else(|e| panic!("fuzz/seeds/{target}.hex: {e}"));
    let mut inputs: Vec<(String, Vec<u8>)> = seeds
        .lines()
        .enumerate()
        .map(|(i, line)| (format!("fuzz/seeds/{target}.hex, line {}", i + 1), hex(line)))
        .collect();
    assert!(!inputs.is_empty(), "{target} has no seeds: see fuzz/run.sh for how to write them");
    let readme = std::fs::read_to_string(fuzz.join("regressions/README.md")).expect("fuzz/regressions/README.md");
    let cases = regressions(target).unwrap_or_else(|e| panic!("{e}"));
    for (name, path) in cases {
        assert!(
            readme.contains(&format!("`{name}`")),
            "fuzz/regressions/{name} has no line in fuzz/regressions/README.md: add one saying what it found or tests"
        );
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("fuzz/regressions/{name}: {e}"));
        inputs.push((format!("fuzz/regressions/{name}"), data));
    }
    for (name, data) in inputs {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| run(&data))) {
            let why = panic.downcast_ref::<String>().map(String::as_str).or(panic.downcast_ref::<&str>().copied());
            panic!("{name}: {}", why.unwrap_or("a panic"));
        }
    }
}

fn hex(line: &str) -> Vec<u8> {
    let digit = |c: u8| (c as char).to_digit(16).expect("a hex digit") as u8;
    line.as_bytes().chunks(2).map(|pair| digit(pair[0]) << 4 | digit(pair[1])).collect()
}

/// The names of the `.rs` files in `fuzz/DIR`.
fn target_files(dir: &str) -> BTreeSet<String> {
    let paths = files(&fuzz_dir().join(dir)).unwrap_or_else(|e| panic!("{e}"));
    paths
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| p.file_stem().expect("a file name").to_string_lossy().into_owned())
        .collect()
}

/// A target added to `fuzz/` is replayed here too, built by the fuzz crate, and has its
/// regression folder; a folder in `fuzz/regressions/` belongs to a target.
#[test]
fn every_target_is_replayed() {
    let replayed: BTreeSet<String> = TARGETS.iter().map(|t| t.to_string()).collect();
    for dir in ["targets", "fuzz_targets"] {
        let missing: Vec<_> = target_files(dir).difference(&replayed).cloned().collect();
        assert!(
            missing.is_empty(),
            "fuzz/{dir}/ has targets tests/fuzz_replay.rs does not replay: {missing:?}; add each to `targets!` \
             there (one line), its seeds (fuzz/seeds/TARGET.hex) \
             and its regression folder (fuzz/regressions/TARGET/)"
        );
    }
    for target in &replayed {
        for dir in ["targets", "fuzz_targets"] {
            assert!(fuzz_dir().join(dir).join(format!("{target}.rs")).is_file(), "fuzz/{dir}/{target}.rs is gone");
        }
    }
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for target in &replayed {
        assert!(
            manifest.contains(&format!("path = \"fuzz_targets/{target}.rs\"")),
            "fuzz/Cargo.toml has no [[bin]] for fuzz_targets/{target}.rs: cargo fuzz would not build it"
        );
    }
    let folders: BTreeSet<String> = std::fs::read_dir(fuzz_dir().join("regressions"))
        .expect("fuzz/regressions/")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().expect("a folder name").to_string_lossy().into_owned())
        .collect();
    let stray: Vec<_> = folders.difference(&replayed).collect();
    assert!(stray.is_empty(), "fuzz/regressions/ has folders of no target: {stray:?}");
}
