//! Models being registered: their archives arrive in chunks, on one connection, before the
//! executor loads them.

use djinn_auth::TenantId;
use djinn_proto::{ArchiveError, Archives, Fingerprint};

/// Whose a model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    Private(TenantId),
    /// Shared by the tenants that registered it as public.
    Public,
}

/// A model being uploaded: its archives, and whose it will be.
#[derive(Debug)]
pub struct Upload {
    pub archives: Archives,
    pub scope: Scope,
    /// The tenant registering it.
    pub tenant: TenantId,
    pub connection: u64,
    /// Whether the uploader may register TorchScript (the right `torchscript`).
    pub torchscript: bool,
}

impl Upload {
    pub fn new(
        fingerprint: Fingerprint,
        block_lens: Vec<u64>,
        (tenant, public): (TenantId, bool),
        connection: u64,
    ) -> Result<Self, ArchiveError> {
        let scope = if public { Scope::Public } else { Scope::Private(tenant) };
        Ok(Self { archives: Archives::new(fingerprint, block_lens)?, scope, tenant, connection, torchscript: false })
    }
}
