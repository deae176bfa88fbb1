//! An executor double: it holds models by fingerprint and kept tensors as bytes, and runs every
//! model as the identity of its one input. What it answers, and with which errors, is what the
//! real executor answers to the conformance suite.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use djinn_proto::{
    DataMessage, ErrorCode, Fingerprint, Handle, HandleInfo, KeptMessage, ModelInfo, ModelMessage, SessionMessage,
    SharedBytes, TensorDesc, Value, payload_layout,
};

use crate::{CallInputs, Executor, Job, Replier, Reply, ReplyTo};

/// What the double's handles carry as their epoch (the executor's life they belong to).
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
    /// A double whose kept tensors' ids start at `first_id` (as an executor in a process of its
    /// own numbers from the range its node gave it).
    pub fn numbered_from(first_id: u64) -> Self {
        Self { last_kept: first_id.saturating_sub(1), ..Self::default() }
    }

    /// The kept tensor `handle` names, if it is one of the double's.
    fn kept(&self, handle: Handle) -> Option<&(TensorDesc, Arc<Vec<u8>>)> {
        self.kept.get(&handle.id).filter(|_| handle.epoch == EPOCH)
    }

    /// The identity of the call's one tensor input (sent, or kept when `keep`).
    fn identity(&mut self, inputs: CallInputs, keep: bool) -> Reply {
        let (desc, bytes) = match (inputs.values.as_slice(), inputs.tensors.first()) {
            ([Value::Tensor(0)], Some(desc)) => {
                let bytes = match (payload_layout(&inputs.tensors), &inputs.payload) {
                    (Ok((offsets, _)), Some(p)) => {
                        let start = offsets[0] as usize;
                        p.buf.as_slice()[start..start + desc.byte_len as usize].to_vec()
                    }
                    _ => Vec::new(),
                };
                (desc.clone(), Arc::new(bytes))
            }
            ([Value::Handle(handle)], _) => match self.kept(*handle) {
                Some((desc, bytes)) => (desc.clone(), Arc::clone(bytes)),
                None => return Reply::error(ErrorCode::NotFound, format!("no kept tensor {handle}")),
            },
            _ => return Reply::error(ErrorCode::ExecutionFailed, "the double runs models of one tensor input"),
        };
        if keep {
            let kept = self.keep(desc, bytes);
            let message = ModelMessage::ExecuteReply {
                tensors: Vec::new(),
                output: Value::Handle(kept.handle),
                kept: vec![kept],
            };
            return Reply::message(message);
        }
        let message = ModelMessage::ExecuteReply { tensors: vec![desc], output: Value::Tensor(0), kept: Vec::new() };
        Reply { message: message.into(), tensors: vec![bytes as SharedBytes] }
    }

    fn keep(&mut self, tensor: TensorDesc, bytes: Arc<Vec<u8>>) -> HandleInfo {
        self.last_kept += 1;
        self.kept.insert(self.last_kept, (tensor.clone(), bytes));
        HandleInfo { handle: Handle { id: self.last_kept, epoch: EPOCH }, tensor }
    }
}

impl Executor for FakeExecutor {
    fn run(&mut self, job: Job, to: ReplyTo, replier: &Replier) {
        let reply = match job {
            Job::Claim { fingerprint, .. } => {
                let registered = self.models.contains(&fingerprint);
                Reply::message(ModelMessage::RegisterReady { upload: 0, registered })
            }
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
            Job::Execute { fingerprint, inputs, keep, .. } if self.models.contains(&fingerprint) => {
                self.identity(inputs, keep)
            }
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
                Reply::message(KeptMessage::Kept { kept: self.keep(tensor, Arc::new(bytes)) })
            }
            Job::Fetch { handle } => match self.kept(handle) {
                Some((desc, bytes)) => Reply {
                    message: DataMessage::GetReply { tensor: desc.clone() }.into(),
                    tensors: vec![Arc::clone(bytes) as SharedBytes],
                },
                None => Reply::error(ErrorCode::NotFound, format!("no kept tensor {handle}")),
            },
            Job::Stats => {
                let counters = vec![("executor_kept_tensors".into(), self.kept.len() as u64)];
                Reply::message(DataMessage::StatsReply { counters })
            }
            Job::ListSessions { .. } => {
                Reply::message(SessionMessage::SessionList { sessions: Vec::new(), more: false })
            }
            other => Reply::error(ErrorCode::Unexpected, format!("the executor double does not serve {other:?}")),
        };
        replier.executed(to, reply);
    }

    fn epoch(&self) -> u64 {
        EPOCH
    }

    fn free_kept(&mut self, ids: &[u64]) {
        for id in ids {
            self.kept.remove(id);
        }
    }

    /// It parks nothing: it runs no breakpoints.
    fn free_parked(&mut self, _: &[u64]) {}

    /// It opens no session.
    fn free_sessions(&mut self, _: &[u64]) {}
}
