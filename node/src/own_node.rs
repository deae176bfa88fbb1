//! What the node's membership agent, /metrics and drain ask of their own node, typed. In
//! process ([`LocalNode`]): no socket, no frame, no token; the poller serves each request in its
//! turn, as it serves a connection's.

use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use djinn_node_core::{LocalNode, Reply};
use djinn_proto::{
    DataMessage, Fingerprint, Handle, HandleInfo, KeptEntry, KeptMessage, Message, ModelInfo, ModelMessage,
    SessionEntry, SessionMessage, SharedBytes, TensorSource,
};

/// How long the node's own request waits for its answer (a push or a move to a slow peer takes
/// a while).
const TIMEOUT: Duration = Duration::from_secs(60);

/// The most pages of a listing read: the node's own lists are bounded by what it holds; this
/// only stops a listing whose cursor would not advance.
const MAX_PAGES: usize = 1 << 16;

/// The node, asked in process: as itself (it sees every tenant's lists) or for a tenant by name.
#[derive(Debug, Clone)]
pub struct OwnNode(LocalNode);

impl OwnNode {
    pub fn new(local: LocalNode) -> Self {
        Self(local)
    }

    fn call(&self, tenant: &str, message: impl Into<Message>) -> Result<Reply> {
        let message = message.into();
        let kind = message.kind().name();
        self.0.request(tenant, message, TIMEOUT).with_context(|| format!("{kind} on this node"))
    }

    /// The node's counters, the data plane's and the core's (as `djinn stats` shows them).
    pub fn stats(&self) -> Result<Vec<(String, u64)>> {
        match self.call("", DataMessage::Stats)?.message {
            Message::Data(DataMessage::StatsReply { counters }) => Ok(counters),
            other => Err(unexpected(&other)),
        }
    }

    /// The models the node holds: every tenant's, with their holders' names, for the node
    /// itself (`tenant` empty); else the tenant's.
    pub fn list_models(&self, tenant: &str) -> Result<Vec<ModelInfo>> {
        match self.call(tenant, ModelMessage::ListModels)?.message {
            Message::Model(ModelMessage::ModelList { models }) => Ok(models),
            other => Err(unexpected(&other)),
        }
    }

    /// Every tenant's sessions, by name.
    pub fn list_sessions(&self) -> Result<Vec<SessionEntry>> {
        self.pages(
            |after| match self.call("", SessionMessage::List { after })?.message {
                Message::Session(SessionMessage::SessionList { sessions, more }) => Ok((sessions, more)),
                other => Err(unexpected(&other)),
            },
            |e| e.session.id,
        )
    }

    /// Every tenant's kept tensors, by name.
    pub fn list_kept(&self) -> Result<Vec<KeptEntry>> {
        self.pages(
            |after| match self.call("", KeptMessage::List { after })?.message {
                Message::Kept(KeptMessage::KeptList { tensors, more }) => Ok((tensors, more)),
                other => Err(unexpected(&other)),
            },
            |e| e.kept.handle.id,
        )
    }

    /// A listing read page by page from the start, each page after the last one's key.
    fn pages<E>(&self, page: impl Fn(u64) -> Result<(Vec<E>, bool)>, key: impl Fn(&E) -> u64) -> Result<Vec<E>> {
        let mut all: Vec<E> = Vec::new();
        let mut after = 0;
        for _ in 0..MAX_PAGES {
            let (entries, more) = page(after)?;
            let last = entries.last().map(&key);
            all.extend(entries);
            match last {
                Some(last) if more && last > after => after = last,
                _ => return Ok(all),
            }
        }
        Err(anyhow!("a listing of more than {MAX_PAGES} pages"))
    }

    /// Pushes `tenant`'s kept tensor to the node at `to` on its `grant`: the copy there.
    pub fn push(&self, tenant: &str, handle: Handle, to: &str, grant: &str) -> Result<HandleInfo> {
        let push =
            KeptMessage::Push { source: TensorSource::Handle(handle), to: to.to_owned(), grant: grant.to_owned() };
        match self.call(tenant, push)?.message {
            Message::Kept(KeptMessage::Pushed { kept, .. }) => Ok(kept),
            other => Err(unexpected(&other)),
        }
    }

    /// Tells requests for `tenant`'s kept tensor `handle` that it is at `to` now, as `kept`.
    pub fn forward(&self, tenant: &str, handle: Handle, to: &str, kept: &HandleInfo) -> Result<()> {
        let forward = KeptMessage::Forward { handle, to: to.to_owned(), kept: kept.clone() };
        match self.call(tenant, forward)?.message {
            Message::Kept(KeptMessage::Forwarded) => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Moves `tenant`'s session to the node at `to` on its `grant`: where it went and its
    /// handle there.
    pub fn session_move(&self, tenant: &str, session: Handle, to: &str, grant: &str) -> Result<(String, Handle)> {
        let moving = SessionMessage::Move { session, to: to.to_owned(), grant: grant.to_owned() };
        match self.call(tenant, moving)?.message {
            Message::Session(SessionMessage::Moved { to, session }) => Ok((to, session)),
            other => Err(unexpected(&other)),
        }
    }

    /// Bytes `offset..offset + len` of `tenant`'s model's archives: the archives' lengths,
    /// whether the node holds the model as public, and the bytes (shared with the reply).
    pub fn read_archives(
        &self,
        tenant: &str,
        fingerprint: &Fingerprint,
        offset: u64,
        len: u64,
    ) -> Result<(Vec<u64>, bool, Chunk)> {
        let read = ModelMessage::ReadArchives { fingerprint: *fingerprint, offset, len };
        let Reply { message, tensors } = self.call(tenant, read)?;
        match (message, tensors.into_iter().next()) {
            (Message::Model(ModelMessage::ArchiveBytes { blocks, public, .. }), Some(bytes)) => {
                Ok((blocks, public, Chunk(bytes)))
            }
            (other, _) => Err(unexpected(&other)),
        }
    }
}

/// Bytes of a model's archives, as the node's reply holds them.
pub struct Chunk(SharedBytes);

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk").field("len", &self.as_ref().len()).finish()
    }
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().as_ref()
    }
}

fn unexpected(message: &Message) -> anyhow::Error {
    anyhow!("this node answered with a {}", message.kind().name())
}
