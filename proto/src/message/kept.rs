//! Kept tensors: tensors that stay in a node's device memory under a handle, fetched, released,
//! or pushed node to node.

use super::wire::{Reader, Writer};
use crate::error::ProtocolError;
use crate::tensor::TensorDesc;
use crate::value::Handle;

family! {
    /// The messages of tensors kept on a node.
    "kept", KeptMessage, KeptKind {
        /// Keeps the payload's tensor in the node's device memory.
        Keep { tensor: TensorDesc } = 0x10d request,
        Kept { kept: HandleInfo } = 0x10e reply,
        /// Asks for a kept tensor's bytes; answered by a `GetReply`.
        Fetch { handle: Handle } = 0x10f request,
        /// Frees kept tensors; handles the node does not hold are skipped.
        Release { handles: Vec<Handle> } = 0x110 request,
        Released { released: u32 } = 0x111 reply,
        /// Copies a tensor of this node into the device memory of the node at `to` (host:port),
        /// where it is kept. `grant` is what that node gave the tenant for it (`PushGrant`):
        /// this node presents it there, in its hello, instead of any credential of its own.
        Push { source: TensorSource, to: String, grant: String } = 0x112 request,
        /// `kept` is the handle on the peer; `path` says how the bytes went there.
        Pushed { kept: HandleInfo, path: String } = 0x113 reply,
        /// Asks this node for a one-time capability to receive `tensor` for the caller's tenant,
        /// pushed from another node. Answered by `PushGranted`.
        PushGrant { tensor: TensorDesc } = 0x120 request,
        PushGranted { grant: String } = 0x121 reply,
        /// Lists the caller's kept tensors (a node's or an operator's: every tenant's, what a
        /// draining node moves) whose ids come after `after`, in order; a page at most.
        List { after: u64 } = 0x129 request,
        /// `more`: tensors past the last listed remain.
        KeptList { tensors: Vec<KeptEntry>, more: bool } = 0x12a reply,
        /// The tensor under `handle` is kept at the node at `to` now, as `kept` (pushed there):
        /// this node frees it and answers later requests that name it with `Moved`.
        Forward { handle: Handle, to: String, kept: HandleInfo } = 0x12b request,
        Forwarded = 0x12c reply,
        /// The tensor a request named is kept at the node at `to` now, as `kept`.
        Moved { to: String, kept: HandleInfo } = 0x12d reply,
    }
}

/// A tensor a node keeps, as `List` tells of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptEntry {
    /// Whose it is, by name: empty in a tenant's own list, and where the node needs no token.
    pub tenant: String,
    pub kept: HandleInfo,
}

/// A tensor kept on a node and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleInfo {
    pub handle: Handle,
    pub tensor: TensorDesc,
}

/// A tensor a node holds: a named tensor of its store, or a kept one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorSource {
    Named(String),
    Handle(Handle),
}

impl KeptMessage {
    pub(super) fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::Keep { tensor } => std::slice::from_ref(tensor),
            Self::Kept { .. }
            | Self::Fetch { .. }
            | Self::Release { .. }
            | Self::Released { .. }
            | Self::Push { .. }
            | Self::Pushed { .. }
            | Self::PushGrant { .. }
            | Self::PushGranted { .. }
            | Self::List { .. }
            | Self::KeptList { .. }
            | Self::Forward { .. }
            | Self::Forwarded
            | Self::Moved { .. } => &[],
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        match self {
            Self::Keep { tensor } | Self::PushGrant { tensor } => w.tensor(tensor),
            Self::Kept { kept } => w.kept(kept),
            Self::Fetch { handle } => w.handle(handle),
            Self::Release { handles } => w.list(handles, Writer::handle),
            Self::Released { released } => w.u32(*released),
            Self::Push { source, to, grant } => {
                match source {
                    TensorSource::Named(name) => {
                        w.u8(0);
                        w.str(name);
                    }
                    TensorSource::Handle(h) => {
                        w.u8(1);
                        w.handle(h);
                    }
                }
                w.str(to);
                w.str(grant);
            }
            Self::Pushed { kept, path } => {
                w.kept(kept);
                w.str(path);
            }
            Self::PushGranted { grant } => w.str(grant),
            Self::Forwarded => {}
            Self::List { after } => w.u64(*after),
            Self::KeptList { tensors, more } => {
                w.list(tensors, |w, e| {
                    w.str(&e.tenant);
                    w.kept(&e.kept);
                });
                w.bool(*more);
            }
            Self::Forward { handle, to, kept } => {
                w.handle(handle);
                w.str(to);
                w.kept(kept);
            }
            Self::Moved { to, kept } => {
                w.str(to);
                w.kept(kept);
            }
        }
    }

    pub(super) fn decode(kind: KeptKind, r: &mut Reader) -> Result<Self, ProtocolError> {
        Ok(match kind {
            KeptKind::Keep => Self::Keep { tensor: r.tensor()? },
            KeptKind::Kept => Self::Kept { kept: r.kept()? },
            KeptKind::Fetch => Self::Fetch { handle: r.handle()? },
            KeptKind::Release => Self::Release { handles: r.list("handles", 16, Reader::handle)? },
            KeptKind::Released => Self::Released { released: r.u32("released")? },
            KeptKind::Push => {
                let source = match r.u8("source")? {
                    0 => TensorSource::Named(r.name()?),
                    1 => TensorSource::Handle(r.handle()?),
                    v => return Err(ProtocolError::MalformedMeta(format!("tensor source {v} is neither 0 nor 1"))),
                };
                Self::Push { source, to: r.string("peer address")?, grant: r.string("grant")? }
            }
            KeptKind::Pushed => Self::Pushed { kept: r.kept()?, path: r.string("path")? },
            KeptKind::PushGrant => Self::PushGrant { tensor: r.tensor()? },
            KeptKind::PushGranted => Self::PushGranted { grant: r.string("grant")? },
            KeptKind::List => Self::List { after: r.u64("after")? },
            // The smallest entry: an empty name, a handle, a rank-0 descriptor.
            KeptKind::KeptList => Self::KeptList {
                tensors: r.list("kept tensors", 2 + 16 + Reader::TENSOR_MIN, |r| {
                    Ok(KeptEntry { tenant: r.string("tenant")?, kept: r.kept()? })
                })?,
                more: r.bool("more")?,
            },
            KeptKind::Forward => Self::Forward { handle: r.handle()?, to: r.string("peer address")?, kept: r.kept()? },
            KeptKind::Forwarded => Self::Forwarded,
            KeptKind::Moved => Self::Moved { to: r.string("peer address")?, kept: r.kept()? },
        })
    }
}

impl Writer<'_> {
    pub(super) fn kept(&mut self, k: &HandleInfo) {
        self.handle(&k.handle);
        self.tensor(&k.tensor);
    }
}

impl Reader<'_> {
    pub(super) fn kept(&mut self) -> Result<HandleInfo, ProtocolError> {
        Ok(HandleInfo { handle: self.handle()?, tensor: self.tensor()? })
    }
}

#[cfg(test)]
pub(crate) fn handle_info() -> impl proptest::strategy::Strategy<Value = HandleInfo> {
    use proptest::strategy::Strategy;
    (crate::strategies::handle(), crate::strategies::tensor())
        .prop_map(|(handle, tensor)| HandleInfo { handle, tensor })
}

#[cfg(test)]
pub(crate) fn arbitrary() -> impl proptest::strategy::Strategy<Value = KeptMessage> {
    use crate::strategies::{handle, name, tensor};
    use proptest::prelude::*;

    let source = prop_oneof![name().prop_map(TensorSource::Named), handle().prop_map(TensorSource::Handle)];
    prop_oneof![
        tensor().prop_map(|tensor| KeptMessage::Keep { tensor }),
        handle_info().prop_map(|kept| KeptMessage::Kept { kept }),
        handle().prop_map(|handle| KeptMessage::Fetch { handle }),
        prop::collection::vec(handle(), 0..5).prop_map(|handles| KeptMessage::Release { handles }),
        any::<u32>().prop_map(|released| KeptMessage::Released { released }),
        (source, name(), name()).prop_map(|(source, to, grant)| KeptMessage::Push { source, to, grant }),
        (handle_info(), name()).prop_map(|(kept, path)| KeptMessage::Pushed { kept, path }),
        tensor().prop_map(|tensor| KeptMessage::PushGrant { tensor }),
        name().prop_map(|grant| KeptMessage::PushGranted { grant }),
        any::<u64>().prop_map(|after| KeptMessage::List { after }),
        (
            prop::collection::vec(
                ("[a-z]{0,8}", handle_info()).prop_map(|(tenant, kept)| KeptEntry { tenant, kept }),
                0..4
            ),
            any::<bool>()
        )
            .prop_map(|(tensors, more)| KeptMessage::KeptList { tensors, more }),
        (handle(), name(), handle_info()).prop_map(|(handle, to, kept)| KeptMessage::Forward { handle, to, kept }),
        Just(KeptMessage::Forwarded),
        (name(), handle_info()).prop_map(|(to, kept)| KeptMessage::Moved { to, kept }),
    ]
}
