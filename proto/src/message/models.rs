//! Models: registering one (its blocks uploaded in chunks), running it, listing and dropping it.

use super::breakpoints::Breakpoint;
use super::kept::HandleInfo;
use super::wire::{Reader, Writer};
use crate::error::ProtocolError;
use crate::tensor::TensorDesc;
use crate::value::Value;

family! {
    /// The messages that register, run, list and drop models.
    "models", ModelMessage, ModelKind {
        /// Starts uploading a model: the lengths of its blocks' archives, in execution order.
        /// A private model is the tenant's alone; a `public` one is held once on the node for
        /// every tenant that registers the same bytes as public.
        RegisterBegin { fingerprint: Fingerprint, blocks: Vec<u64>, public: bool } = 0x101 request,
        /// `registered`: the node already holds this model and nothing needs uploading.
        RegisterReady { upload: u64, registered: bool } = 0x102 reply,
        /// Bytes `offset..offset + len` of the upload (the blocks' archives concatenated); the
        /// payload is the chunk, described as a u8 tensor.
        RegisterChunk { upload: u64, offset: u64, chunk: TensorDesc } = 0x103 request,
        RegisterProgress { received: u64, total: u64 } = 0x104 reply,
        /// Checks the fingerprint and loads the model on the node's device.
        RegisterCommit { upload: u64 } = 0x105 request,
        Registered { model: ModelInfo } = 0x106 reply,
        /// Runs a model on positional `inputs`; their tensors are the payload, or handles of
        /// tensors kept on the node. With `keep`, every output tensor stays on the node and
        /// comes back as a handle. With `until`, the run stops at that breakpoint (answered by
        /// `Paused`).
        Execute {
            fingerprint: Fingerprint,
            tensors: Vec<TensorDesc>,
            inputs: Vec<Value>,
            keep: bool,
            until: Option<Breakpoint>,
        } = 0x107 request,
        /// The output's `Value::Handle`s are described in `kept`. Also the end of a session's
        /// step and of a resumed request.
        ExecuteReply { tensors: Vec<TensorDesc>, output: Value, kept: Vec<HandleInfo> } = 0x108 reply,
        Unregister { fingerprint: Fingerprint } = 0x109 request,
        UnregisterAck = 0x10a reply,
        ListModels = 0x10b request,
        ModelList { models: Vec<ModelInfo> } = 0x10c reply,
        /// Reads bytes `offset..offset + len` of a model's archives (concatenated, as
        /// `RegisterChunk` numbers them) back from the node that holds it: what a draining node
        /// sends another to register the model there. Answered by `ArchiveBytes`.
        ReadArchives { fingerprint: Fingerprint, offset: u64, len: u64 } = 0x125 request,
        /// The payload is the bytes, described as a u8 tensor; `blocks` are the archives'
        /// lengths and `public` whether the model is held as public.
        ArchiveBytes { blocks: Vec<u64>, public: bool, chunk: TensorDesc } = 0x126 reply,
    }
}

/// A model's identity: BLAKE3 over its blocks' archives (see [`Fingerprint::of_blocks`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Hashes the number of blocks, then each block's length and bytes, so that no two
    /// different splits of the same bytes collide.
    pub fn of_blocks<B: AsRef<[u8]>>(blocks: &[B]) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(&(blocks.len() as u64).to_le_bytes());
        for b in blocks {
            h.update(&(b.as_ref().len() as u64).to_le_bytes());
            h.update(b.as_ref());
        }
        Self(*h.finalize().as_bytes())
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(out))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// What a node says of a model it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub fingerprint: Fingerprint,
    pub blocks: u32,
    /// Bytes of parameters and buffers on the device (what the budget is charged).
    pub weight_bytes: u64,
    /// `cpu` or `cuda:N`.
    pub device: String,
    pub executions: u64,
    /// The tenants holding it, by name: listed to nodes and operators only (a tenant's own list
    /// leaves it empty, so it never learns who else holds a public model).
    pub owners: Vec<String>,
}

impl ModelMessage {
    pub(super) fn tensors(&self) -> &[TensorDesc] {
        match self {
            Self::RegisterChunk { chunk, .. } | Self::ArchiveBytes { chunk, .. } => std::slice::from_ref(chunk),
            Self::Execute { tensors, .. } | Self::ExecuteReply { tensors, .. } => tensors,
            Self::RegisterBegin { .. }
            | Self::RegisterReady { .. }
            | Self::RegisterProgress { .. }
            | Self::RegisterCommit { .. }
            | Self::Registered { .. }
            | Self::Unregister { .. }
            | Self::UnregisterAck
            | Self::ListModels
            | Self::ModelList { .. }
            | Self::ReadArchives { .. } => &[],
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        match self {
            Self::RegisterBegin { fingerprint, blocks, public } => {
                w.fingerprint(fingerprint);
                w.list(blocks, |w, b| w.u64(*b));
                w.bool(*public);
            }
            Self::RegisterReady { upload, registered } => {
                w.u64(*upload);
                w.bool(*registered);
            }
            Self::RegisterChunk { upload, offset, chunk } => {
                w.u64(*upload);
                w.u64(*offset);
                w.tensor(chunk);
            }
            Self::RegisterProgress { received, total } => {
                w.u64(*received);
                w.u64(*total);
            }
            Self::RegisterCommit { upload } => w.u64(*upload),
            Self::Registered { model } => w.model(model),
            Self::Execute { fingerprint, tensors, inputs, keep, until } => {
                w.fingerprint(fingerprint);
                w.bool(*keep);
                w.tensors(tensors);
                w.values(inputs);
                w.breakpoint(until);
            }
            Self::ExecuteReply { tensors, output, kept } => {
                w.tensors(tensors);
                output.encode(w.0);
                w.list(kept, Writer::kept);
            }
            Self::Unregister { fingerprint } => w.fingerprint(fingerprint),
            Self::UnregisterAck | Self::ListModels => {}
            Self::ModelList { models } => w.list(models, Writer::model),
            Self::ReadArchives { fingerprint, offset, len } => {
                w.fingerprint(fingerprint);
                w.u64(*offset);
                w.u64(*len);
            }
            Self::ArchiveBytes { blocks, public, chunk } => {
                w.list(blocks, |w, b| w.u64(*b));
                w.bool(*public);
                w.tensor(chunk);
            }
        }
    }

    pub(super) fn decode(kind: ModelKind, r: &mut Reader) -> Result<Self, ProtocolError> {
        Ok(match kind {
            ModelKind::RegisterBegin => Self::RegisterBegin {
                fingerprint: r.fingerprint()?,
                blocks: r.list("blocks", 8, |r| r.u64("block length"))?,
                public: r.bool("public")?,
            },
            ModelKind::RegisterReady => {
                Self::RegisterReady { upload: r.u64("upload")?, registered: r.bool("registered")? }
            }
            ModelKind::RegisterChunk => {
                Self::RegisterChunk { upload: r.u64("upload")?, offset: r.u64("offset")?, chunk: r.tensor()? }
            }
            ModelKind::RegisterProgress => {
                Self::RegisterProgress { received: r.u64("received")?, total: r.u64("total")? }
            }
            ModelKind::RegisterCommit => Self::RegisterCommit { upload: r.u64("upload")? },
            ModelKind::Registered => Self::Registered { model: r.model()? },
            ModelKind::Execute => {
                let fingerprint = r.fingerprint()?;
                let keep = r.bool("keep")?;
                let tensors = r.tensors()?;
                let inputs = r.values(tensors.len())?;
                Self::Execute { fingerprint, tensors, inputs, keep, until: r.breakpoint()? }
            }
            ModelKind::ExecuteReply => {
                let tensors = r.tensors()?;
                let output = Value::decode(&mut r.bytes, tensors.len())?;
                // The smallest entry: a handle and a rank-0 descriptor.
                let kept = r.list("kept tensors", 16 + Reader::TENSOR_MIN, Reader::kept)?;
                Self::ExecuteReply { tensors, output, kept }
            }
            ModelKind::Unregister => Self::Unregister { fingerprint: r.fingerprint()? },
            ModelKind::UnregisterAck => Self::UnregisterAck,
            ModelKind::ListModels => Self::ListModels,
            // The smallest entry: fingerprint, u32, u64, empty string, u64, no owner.
            ModelKind::ModelList => {
                Self::ModelList { models: r.list("models", 32 + 4 + 8 + 2 + 8 + 4, Reader::model)? }
            }
            ModelKind::ReadArchives => {
                Self::ReadArchives { fingerprint: r.fingerprint()?, offset: r.u64("offset")?, len: r.u64("length")? }
            }
            ModelKind::ArchiveBytes => Self::ArchiveBytes {
                blocks: r.list("blocks", 8, |r| r.u64("block length"))?,
                public: r.bool("public")?,
                chunk: r.tensor()?,
            },
        })
    }
}

impl Writer<'_> {
    pub fn fingerprint(&mut self, f: &Fingerprint) {
        self.0.extend_from_slice(&f.0);
    }

    fn model(&mut self, m: &ModelInfo) {
        self.fingerprint(&m.fingerprint);
        self.u32(m.blocks);
        self.u64(m.weight_bytes);
        self.str(&m.device);
        self.u64(m.executions);
        self.list(&m.owners, |w, o| w.str(o));
    }
}

impl Reader<'_> {
    pub fn fingerprint(&mut self) -> Result<Fingerprint, ProtocolError> {
        self.array("fingerprint").map(Fingerprint)
    }

    fn model(&mut self) -> Result<ModelInfo, ProtocolError> {
        Ok(ModelInfo {
            fingerprint: self.fingerprint()?,
            blocks: self.u32("blocks")?,
            weight_bytes: self.u64("weight bytes")?,
            device: self.string("device")?,
            executions: self.u64("executions")?,
            owners: self.list("owners", 2, |r| r.string("owner"))?,
        })
    }
}

#[cfg(test)]
pub(crate) fn fingerprint() -> impl proptest::strategy::Strategy<Value = Fingerprint> {
    use proptest::prelude::*;
    any::<[u8; 32]>().prop_map(Fingerprint)
}

#[cfg(test)]
pub(crate) fn arbitrary() -> impl proptest::strategy::Strategy<Value = ModelMessage> {
    use super::breakpoints::breakpoint;
    use super::kept::handle_info;
    use crate::strategies::{tensors, value, values};
    use crate::tensor::DType;
    use proptest::prelude::*;

    let model = || {
        let owners = prop::collection::vec("[a-z]{1,8}", 0..3);
        (fingerprint(), any::<u32>(), any::<u64>(), "(cpu|cuda:[0-7])", any::<u64>(), owners).prop_map(
            |(fingerprint, blocks, weight_bytes, device, executions, owners)| ModelInfo {
                fingerprint,
                blocks,
                weight_bytes,
                device,
                executions,
                owners,
            },
        )
    };
    prop_oneof![
        (fingerprint(), prop::collection::vec(any::<u64>(), 0..5), any::<bool>())
            .prop_map(|(fingerprint, blocks, public)| ModelMessage::RegisterBegin { fingerprint, blocks, public }),
        (any::<u64>(), any::<bool>())
            .prop_map(|(upload, registered)| ModelMessage::RegisterReady { upload, registered }),
        (any::<u64>(), any::<u64>(), 0u64..300).prop_map(|(upload, offset, n)| ModelMessage::RegisterChunk {
            upload,
            offset,
            chunk: TensorDesc::new(DType::U8, vec![n]).unwrap()
        }),
        (any::<u64>(), any::<u64>()).prop_map(|(received, total)| ModelMessage::RegisterProgress { received, total }),
        any::<u64>().prop_map(|upload| ModelMessage::RegisterCommit { upload }),
        model().prop_map(|model| ModelMessage::Registered { model }),
        (fingerprint(), tensors())
            .prop_flat_map(|(f, tensors)| {
                let n = tensors.len();
                (Just(f), Just(tensors), values(n), any::<bool>(), breakpoint())
            })
            .prop_map(|(fingerprint, tensors, inputs, keep, until)| ModelMessage::Execute {
                fingerprint,
                tensors,
                inputs,
                keep,
                until
            }),
        tensors()
            .prop_flat_map(|tensors| {
                let n = tensors.len();
                (Just(tensors), value(n), prop::collection::vec(handle_info(), 0..3))
            })
            .prop_map(|(tensors, output, kept)| ModelMessage::ExecuteReply { tensors, output, kept }),
        fingerprint().prop_map(|fingerprint| ModelMessage::Unregister { fingerprint }),
        Just(ModelMessage::UnregisterAck),
        Just(ModelMessage::ListModels),
        prop::collection::vec(model(), 0..3).prop_map(|models| ModelMessage::ModelList { models }),
        (fingerprint(), any::<u64>(), any::<u64>()).prop_map(|(fingerprint, offset, len)| ModelMessage::ReadArchives {
            fingerprint,
            offset,
            len
        }),
        (prop::collection::vec(any::<u64>(), 1..4), any::<bool>(), 0u64..300).prop_map(|(blocks, public, n)| {
            ModelMessage::ArchiveBytes { blocks, public, chunk: TensorDesc::new(DType::U8, vec![n]).unwrap() }
        }),
    ]
}
