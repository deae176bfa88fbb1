//! The flags that make a process need tokens (`--auth-file`, or `--auth-etcd`) and the token it
//! presents itself (`--token-file`, or `DJINN_TOKEN`; never a flag's value, which any user of
//! the host can read in the process list).

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use djinn_auth::{Authenticator, Watcher};
use djinn_control::principals::{self, EtcdPrincipals};

/// Where the principals (tenants, nodes, operators) and their tokens come from.
#[derive(Args, Debug, Clone, Default)]
pub struct PrincipalsArgs {
    /// Require tokens: the principals and their tokens, as JSON (see docs/tenancy.md). The file is
    /// read again when it changes, so tokens rotate without a restart.
    #[arg(long, conflicts_with = "auth_etcd")]
    pub auth_file: Option<PathBuf>,
    /// Require tokens, kept in etcd (endpoints, comma-separated: http://HOST:PORT) at
    /// --auth-key, where `djinn tokens put` writes them. Every process watching the key sees a
    /// rotation at once.
    #[arg(long, value_delimiter = ',')]
    pub auth_etcd: Vec<String>,
    /// The etcd key of --auth-etcd.
    #[arg(long, default_value = principals::DEFAULT_KEY)]
    pub auth_key: String,
    /// Serve beyond loopback without tokens: everyone who reaches the address may do
    /// anything (every tenant's data, registering code). Without tokens and without this, a
    /// process listens on loopback only.
    #[arg(long)]
    pub insecure: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct AuthArgs {
    #[command(flatten)]
    pub principals: PrincipalsArgs,
    /// A file holding this process's own token (for the control plane and other nodes).
    /// Default: the DJINN_TOKEN environment variable.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

/// How often a token file is checked for changes.
const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// Keeps an authenticator's principals up to date while it lives.
#[derive(Debug)]
#[expect(dead_code, reason = "held to be dropped: dropping the watcher stops it")]
pub enum PrincipalsWatch {
    File(Watcher),
    Etcd(EtcdPrincipals),
}

impl PrincipalsArgs {
    /// Refuses to serve `listen` beyond loopback when no tokens are required (`tokens`),
    /// unless `--insecure` says so.
    pub fn check_exposure(&self, listen: &str, tokens: bool) -> Result<()> {
        if tokens || self.insecure {
            return Ok(());
        }
        let addrs = listen.to_socket_addrs().with_context(|| format!("cannot resolve {listen}"))?;
        if let Some(open) = addrs.into_iter().find(|a| !a.ip().is_loopback()) {
            bail!(
                "{listen} ({open}) is reachable beyond this host and no tokens are required: give --auth-file or \
                 --auth-etcd, or --insecure to serve everyone who reaches it with every right"
            );
        }
        Ok(())
    }

    /// The principals, watched for changes while the watch lives; none when tokens are not
    /// required.
    pub fn authenticator(&self) -> Result<Option<(Arc<Authenticator>, PrincipalsWatch)>> {
        if let Some(path) = &self.auth_file {
            let auth = Authenticator::load(path)?;
            let watcher = auth.watch(RELOAD_EVERY).context("cannot watch the token file")?;
            tracing::info!(path = %path.display(), "clients need tokens");
            return Ok(Some((auth, PrincipalsWatch::File(watcher))));
        }
        if self.auth_etcd.is_empty() {
            return Ok(None);
        }
        let (auth, watch) = EtcdPrincipals::start(self.auth_etcd.clone(), self.auth_key.clone())
            .with_context(|| format!("the principals in etcd at {:?}", self.auth_etcd))?;
        tracing::info!(endpoints = ?self.auth_etcd, key = %self.auth_key, "clients need tokens (kept in etcd)");
        Ok(Some((auth, PrincipalsWatch::Etcd(watch))))
    }
}

impl AuthArgs {
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

/// `djinn tokens`: the principals kept in etcd.
#[derive(clap::Subcommand, Debug)]
pub enum TokensCommand {
    /// Check a token file and write it to etcd, where every process started with --auth-etcd
    /// takes it up within moments (an invalid file is refused and nothing is written).
    Put {
        /// The principals and their tokens, as JSON (see docs/tenancy.md).
        file: PathBuf,
        /// etcd endpoints, comma-separated (http://HOST:PORT).
        #[arg(long, value_delimiter = ',', required = true)]
        etcd: Vec<String>,
        /// The key the processes watch (their --auth-key).
        #[arg(long, default_value = principals::DEFAULT_KEY)]
        key: String,
    },
}

pub fn tokens(command: TokensCommand) -> Result<()> {
    match command {
        TokensCommand::Put { file, etcd, key } => {
            let document = std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
            crate::runtime()?.block_on(async {
                let store = djinn_control::store::EtcdStore::connect(&etcd).await?;
                principals::put(&store, &key, document).await
            })?;
            println!("the principals of {} are at {key:?} in etcd", file.display());
            Ok(())
        }
    }
}
