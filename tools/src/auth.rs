//! The flags that make a process need tokens (`--auth-file`) and the token it presents itself
//! (`--token-file`, or `DJINN_TOKEN`; never a flag's value, which any user of the host can read
//! in the process list).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use djinn_auth::{Authenticator, Watcher};

#[derive(Args, Debug, Clone, Default)]
pub struct AuthArgs {
    /// Require tokens: the principals (tenants, nodes, operators) and their tokens, as JSON
    /// (see the README). The file is read again when it changes, so tokens rotate without a
    /// restart.
    #[arg(long)]
    pub auth_file: Option<PathBuf>,
    /// A file holding this process's own token (for the control plane and other nodes).
    /// Default: the DJINN_TOKEN environment variable.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

/// How often a token file is checked for changes.
const RELOAD_EVERY: Duration = Duration::from_secs(1);

impl AuthArgs {
    /// The token file's principals, watched for changes while the watcher lives.
    pub fn authenticator(&self) -> Result<Option<(Arc<Authenticator>, Watcher)>> {
        let Some(path) = &self.auth_file else { return Ok(None) };
        let auth = Authenticator::load(path)?;
        let watcher = auth.watch(RELOAD_EVERY).context("cannot watch the token file")?;
        tracing::info!(path = %path.display(), "clients need tokens");
        Ok(Some((auth, watcher)))
    }

    pub fn token(&self) -> Result<String> {
        token(self.token_file.as_deref())
    }
}

/// The token in `file` (surrounding whitespace dropped), else DJINN_TOKEN, else none.
pub fn token(file: Option<&Path>) -> Result<String> {
    match file {
        Some(path) => Ok(std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?
            .trim()
            .to_owned()),
        None => Ok(std::env::var("DJINN_TOKEN").unwrap_or_default()),
    }
}
