//! An executor double: it holds models by fingerprint and kept tensors as bytes, and runs every
//! model as the identity of its one input. What it answers, and with which errors, is what the
//! real executor answers to the conformance suite.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use djinn_auth::TenantId;
use djinn_proto::{
    DataMessage, ErrorCode, Fingerprint, Handle, HandleInfo, KeptEntry, KeptMessage, ModelInfo, ModelMessage, Refusal,
    SessionMessage, SharedBytes, TensorDesc, Value, payload_layout,
};

use crate::{CallInputs, Executor, Job, Replier, Reply, ReplyTo};

/// What the double's handles carry as their epoch (the node's life they belong to).
const EPOCH: u64 = 1;

#[derive(Debug, Default)]
pub struct FakeExecutor {
    models: HashSet<Fingerprint>,
    kept: BTreeMap<u64, (TensorDesc, Arc<Vec<u8>>)>,
    last_kept: u64,
}

fn unknown_model(fingerprint: &Fingerprint) -> Reply {
    Reply::error(ErrorCode::UnknownModel, format!("no model {fingerprint} on this node"))
}

impl FakeExecutor {
    /// The kept tensor `handle` names, if it is one of the double's.
    fn kept(&self, handle: Handle) -> Option<&(TensorDesc, Arc<Vec<u8>>)> {
        self.kept.get(&handle.id).filter(|_| handle.epoch == EPOCH)
    }

    /// The identity of the call's one tensor input.
    fn identity(inputs: CallInputs) -> Reply {
        let (Some(desc), [Value::Tensor(0)]) = (inputs.tensors.first(), inputs.values.as_slice()) else {
            return Reply::error(ErrorCode::ExecutionFailed, "the double runs models of one tensor input");
        };
        let bytes = match (payload_layout(&inputs.tensors), &inputs.payload) {
            (Ok((offsets, _)), Some(p)) => {
                let start = offsets[0] as usize;
                p.buf.as_slice()[start..start + desc.byte_len as usize].to_vec()
            }
            _ => Vec::new(),
        };
        let message =
            ModelMessage::ExecuteReply { tensors: vec![desc.clone()], output: Value::Tensor(0), kept: Vec::new() };
        Reply { message: message.into(), tensors: vec![Arc::new(bytes) as SharedBytes] }
    }
}

impl Executor for FakeExecutor {
    fn run(&mut self, job: Job, _: ReplyTo, _: &Replier) -> Option<Reply> {
        Some(match job {
            Job::Load { upload } => match upload.archives.verify() {
                Ok(()) => {
                    let fingerprint = upload.archives.fingerprint();
                    self.models.insert(fingerprint);
                    let model = ModelInfo {
                        fingerprint,
                        blocks: upload.archives.block_lens().len() as u32,
                        weight_bytes: 0,
                        device: "cpu".into(),
                        executions: 0,
                        owners: Vec::new(),
                    };
                    Reply::message(ModelMessage::Registered { model })
                }
                Err(e) => Reply::error(ErrorCode::BadArchive, e.to_string()),
            },
            Job::Execute { fingerprint, inputs, .. } if self.models.contains(&fingerprint) => Self::identity(inputs),
            Job::Execute { fingerprint, .. }
            | Job::OpenSession { fingerprint, .. }
            | Job::ReadArchives { fingerprint, .. } => unknown_model(&fingerprint),
            Job::Unregister { fingerprint } if self.models.remove(&fingerprint) => {
                Reply::message(ModelMessage::UnregisterAck)
            }
            Job::Unregister { fingerprint } => unknown_model(&fingerprint),
            Job::ListModels { .. } => {
                let models = self
                    .models
                    .iter()
                    .map(|&fingerprint| ModelInfo {
                        fingerprint,
                        blocks: 1,
                        weight_bytes: 0,
                        device: "cpu".into(),
                        executions: 0,
                        owners: Vec::new(),
                    })
                    .collect();
                Reply::message(ModelMessage::ModelList { models })
            }
            Job::Keep { tensor, payload } => {
                let bytes = payload.map_or_else(Vec::new, |p| p.buf.as_slice().to_vec());
                self.last_kept += 1;
                self.kept.insert(self.last_kept, (tensor.clone(), Arc::new(bytes)));
                let handle = Handle { id: self.last_kept, epoch: EPOCH };
                Reply::message(KeptMessage::Kept { kept: HandleInfo { handle, tensor } })
            }
            Job::Fetch { handle } => match self.kept(handle) {
                Some((desc, bytes)) => Reply {
                    message: DataMessage::GetReply { tensor: desc.clone() }.into(),
                    tensors: vec![Arc::clone(bytes) as SharedBytes],
                },
                None => Reply::error(ErrorCode::NotFound, format!("no kept tensor {handle}")),
            },
            Job::ListKept { after, .. } => {
                let tensors = self
                    .kept
                    .range(after + 1..)
                    .map(|(&id, (desc, _))| KeptEntry {
                        tenant: String::new(),
                        kept: HandleInfo { handle: Handle { id, epoch: EPOCH }, tensor: desc.clone() },
                    })
                    .collect();
                Reply::message(KeptMessage::KeptList { tensors, more: false })
            }
            Job::Release { handles } => {
                let released = handles.iter().filter(|h| h.epoch == EPOCH && self.kept.remove(&h.id).is_some()).count();
                Reply::message(KeptMessage::Released { released: released as u32 })
            }
            Job::ListSessions { .. } => {
                Reply::message(SessionMessage::SessionList { sessions: Vec::new(), more: false })
            }
            other => Reply::error(ErrorCode::Unexpected, format!("the executor double does not serve {other:?}")),
        })
    }

    fn claim(&mut self, _: TenantId, fingerprint: &Fingerprint, _: bool, _: bool) -> Result<bool, Refusal> {
        Ok(self.models.contains(fingerprint))
    }

    fn stats(&self, out: &mut Vec<(String, u64)>) {
        out.push(("handles".into(), self.kept.len() as u64));
    }
}
