//! Which libtorch this process loaded, and whether it is the one the binary was built for. A
//! node bundle runs against the host's own torch (found through an rpath or LD_LIBRARY_PATH),
//! so the loader, not the build, decides which libtorch that is: a node says which it got and
//! refuses to serve with another release than its own.

use std::path::{Path, PathBuf};

/// The torch release (major.minor) this build binds (tch checks it at build time).
#[cfg(feature = "torch-2-11")]
pub const BUILT_FOR: &str = "2.11";
#[cfg(not(feature = "torch-2-11"))]
pub const BUILT_FOR: &str = "2.13";

/// The libtorch mapped into this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedLibtorch {
    /// The folder of `libtorch_cpu.so`.
    pub lib_dir: PathBuf,
    /// Its release as the torch install beside it says (`2.11.0+cu130`), when it says.
    pub version: Option<String>,
}

impl std::fmt::Display for LoadedLibtorch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "libtorch {} from {}", self.version.as_deref().unwrap_or("(version unknown)"), self.lib_dir.display())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LibtorchError {
    #[error("no libtorch_cpu.so is mapped into this process (/proc/self/maps)")]
    NotLoaded,
    #[error(
        "this djinn was built for torch {BUILT_FOR} but loaded {0}: run the build for that torch \
         (scripts/gpu-bundle.sh --torch ...), or point LD_LIBRARY_PATH at a torch {BUILT_FOR} install's torch/lib"
    )]
    Mismatch(LoadedLibtorch),
}

/// The libtorch this process loaded.
pub fn loaded() -> Result<LoadedLibtorch, LibtorchError> {
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|_| LibtorchError::NotLoaded)?;
    let lib = mapped_library(&maps, "libtorch_cpu.so").ok_or(LibtorchError::NotLoaded)?;
    let lib_dir = lib.parent().map(Path::to_path_buf).unwrap_or_default();
    let version = version_beside(&lib_dir);
    Ok(LoadedLibtorch { lib_dir, version })
}

/// The loaded libtorch, refused when its release is known and is not [`BUILT_FOR`]. An unknown
/// release (a libtorch with neither `version.py` nor `build-version` beside it) is let through:
/// the dynamic loader has already matched its symbols.
pub fn check() -> Result<LoadedLibtorch, LibtorchError> {
    admit(loaded()?)
}

fn admit(loaded: LoadedLibtorch) -> Result<LoadedLibtorch, LibtorchError> {
    match &loaded.version {
        Some(v) if !same_release(v, BUILT_FOR) => Err(LibtorchError::Mismatch(loaded)),
        _ => Ok(loaded),
    }
}

/// The path of the first mapping of a file named `name` in a `/proc/PID/maps` listing.
fn mapped_library(maps: &str, name: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(Path::new)
        .find(|p| p.file_name() == Some(name.as_ref()))
        .map(Path::to_path_buf)
}

/// The release of the torch whose `lib` folder is `lib_dir`: a pip install has `version.py` in
/// the folder above (`__version__ = '2.11.0+cu130'`), a libtorch archive `build-version`.
fn version_beside(lib_dir: &Path) -> Option<String> {
    let torch = lib_dir.parent()?;
    if let Ok(py) = std::fs::read_to_string(torch.join("version.py")) {
        return parse_version_py(&py);
    }
    let raw = std::fs::read_to_string(torch.join("build-version")).ok()?;
    Some(raw.trim().to_owned()).filter(|v| !v.is_empty())
}

fn parse_version_py(py: &str) -> Option<String> {
    py.lines().find_map(|line| {
        let value = line.strip_prefix("__version__")?.trim_start().strip_prefix('=')?.trim();
        Some(value.trim_matches(|c| c == '\'' || c == '"').to_owned()).filter(|v| !v.is_empty())
    })
}

/// Whether `version` (`2.11.0+cu130`) is of release `major_minor` (`2.11`).
fn same_release(version: &str, major_minor: &str) -> bool {
    version.strip_prefix(major_minor).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_found_in_a_maps_listing() {
        let maps = "\
7f00-7f01 r--p 00000000 00:2a 123  /usr/lib/x86_64-linux-gnu/libc.so.6
7f10-7f20 r-xp 00001000 00:2a 456  /opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so
7f30-7f31 rw-p 00000000 00:00 0 
7f40-7f41 r--p 00000000 00:2a 789  /x/libtorch_cpu.so.bak";
        assert_eq!(
            mapped_library(maps, "libtorch_cpu.so"),
            Some(PathBuf::from("/opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"))
        );
        assert_eq!(mapped_library(maps, "libtorch_cuda.so"), None);
    }

    #[test]
    fn versions_are_read_as_torch_writes_them_and_compared_by_release() {
        let py =
            "from typing import Optional\n__all__ = ['__version__']\n__version__ = '2.11.0+cu130'\ncuda = '13.0'\n";
        assert_eq!(parse_version_py(py).as_deref(), Some("2.11.0+cu130"));
        assert_eq!(parse_version_py("__version__=\"2.13.0\"").as_deref(), Some("2.13.0"));
        assert_eq!(parse_version_py("version = '1'"), None);
        assert!(same_release("2.11.0+cu130", "2.11"));
        assert!(same_release("2.11", "2.11"));
        assert!(!same_release("2.13.0+cu130", "2.11"));
        assert!(!same_release("2.110.0", "2.11"));
    }

    /// This test process links the libtorch of the build (the torch in .venv): it is found,
    /// its release read, and it passes the check.
    #[test]
    fn this_process_loaded_the_libtorch_it_was_built_for() {
        // Something from libtorch, so the library is certainly in use.
        let _ = tch::Tensor::from(1i64);
        let loaded = check().expect("the build's own libtorch");
        assert!(loaded.lib_dir.join("libtorch_cpu.so").exists(), "{loaded}");
        let version = loaded.version.expect("a pip install says its version");
        assert!(same_release(&version, BUILT_FOR), "{version}");
    }

    #[test]
    fn another_release_beside_the_library_is_named_in_the_refusal() {
        let torch = tempfile::tempdir().unwrap();
        std::fs::create_dir(torch.path().join("lib")).unwrap();
        std::fs::write(torch.path().join("version.py"), "__version__ = '2.9.1+cu128'\n").unwrap();
        let lib_dir = torch.path().join("lib");
        let version = version_beside(&lib_dir);
        assert_eq!(version.as_deref(), Some("2.9.1+cu128"));
        let e = admit(LoadedLibtorch { lib_dir: lib_dir.clone(), version }).unwrap_err();
        let message = e.to_string();
        assert!(message.contains("built for torch") && message.contains("2.9.1+cu128"), "{message}");
        // A libtorch that does not say its version is let through.
        std::fs::remove_file(torch.path().join("version.py")).unwrap();
        assert!(admit(LoadedLibtorch { version: version_beside(&lib_dir), lib_dir }).is_ok());
    }
}
