//! The executor link: what the node and an executor in another process say to each other, as
//! bytes. The node sends jobs (with the request each answers) and the ids of what to free; the
//! executor sends its answers. No I/O here: a message is one record of a ring (`djinn-shm`),
//! and its bulk bytes (payloads, archives, reply tensors) lie beside it in memory both
//! processes map, placed and taken up through [`Bulk`], so only their [`Span`]s are encoded.
//!
//! Either side may be compromised, the executor above all: every decode checks every length
//! and count against what is left before it allocates, and every span is the [`Bulk`]'s to
//! check against its memory.

use std::sync::Arc;

use djinn_auth::TenantId;
use djinn_memory::HostBuf;
use djinn_proto::fields::{Reader, Writer};
use djinn_proto::{ArchiveError, Archives, ErrorCode, Kind, Limits, Message, Payload, ProtocolError, SharedBytes};

use crate::{Answer, CallInputs, Executed, Job, Reply, ReplyTo, Scope, TenantNames, Upload};

/// Bulk bytes in the memory both processes map: `len` bytes from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub offset: u64,
    pub len: u64,
}

impl Span {
    /// The bytes this span names in memory of `len` bytes, when it lies within it.
    pub fn range_in(&self, len: usize) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(self.offset).ok()?;
        let end = start.checked_add(usize::try_from(self.len).ok()?)?;
        (end <= len).then_some(start..end)
    }
}

/// Where a message's bulk bytes go and come from. The sender places each (a payload already in
/// the shared memory names its own span; other bytes are copied in); the receiver takes each
/// up once it has checked the span lies in the memory it maps.
pub trait Bulk {
    fn place(&mut self, bytes: SharedBytes) -> Result<Span, LinkError>;
    fn take(&mut self, span: Span) -> Result<HostBuf, LinkError>;
}

/// Bulk bytes in one vector, for the link's tests and its fuzz target: placed at its end,
/// taken from within it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct VecBulk(pub Vec<u8>);

impl Bulk for VecBulk {
    fn place(&mut self, bytes: SharedBytes) -> Result<Span, LinkError> {
        let offset = self.0.len() as u64;
        self.0.extend_from_slice((*bytes).as_ref());
        Ok(Span { offset, len: self.0.len() as u64 - offset })
    }

    fn take(&mut self, span: Span) -> Result<HostBuf, LinkError> {
        let outside = || LinkError::Bulk { span, reason: "outside the shared memory".into() };
        let range = span.range_in(self.0.len()).ok_or_else(outside)?;
        HostBuf::copy_from(&self.0[range]).map_err(|e| LinkError::Bulk { span, reason: e.to_string() })
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    #[error("a malformed link message: {0}")]
    Malformed(#[from] ProtocolError),
    #[error("bulk bytes at {}+{}: {reason}", span.offset, span.len)]
    Bulk { span: Span, reason: String },
    #[error("a model's archives: {0}")]
    Archives(#[from] ArchiveError),
}

fn malformed(what: String) -> LinkError {
    LinkError::Malformed(ProtocolError::MalformedMeta(what))
}

/// What the node sends an executor.
#[derive(Debug)]
pub enum ToExecutor {
    /// A job, and the request it answers.
    Run {
        job: Job,
        to: ReplyTo,
    },
    FreeKept(Vec<u64>),
    FreeParked(Vec<u64>),
    FreeSessions(Vec<u64>),
}

/// What an executor sends the node.
#[derive(Debug)]
pub enum FromExecutor {
    /// The executor is up: the epoch of the handles it makes.
    Ready { epoch: u64 },
    /// The answer to the request `to`, as the executor gave it to its [`crate::Replier`].
    Answered { to: ReplyTo, answer: Answer },
}

mod tag {
    pub const RUN: u8 = 0;
    pub const FREE_KEPT: u8 = 1;
    pub const FREE_PARKED: u8 = 2;
    pub const FREE_SESSIONS: u8 = 3;
    pub const READY: u8 = 0;
    pub const ANSWERED: u8 = 1;
    /// What an answer is: a reply to send as it is, or the executor's, for the core to
    /// complete (parked still or not).
    pub const REPLY: u8 = 0;
    pub const EXECUTED: u8 = 1;
    pub const STILL_PARKED: u8 = 2;
}

mod job {
    pub const CLAIM: u8 = 0;
    pub const LOAD: u8 = 1;
    pub const UNREGISTER: u8 = 2;
    pub const LIST_MODELS: u8 = 3;
    pub const READ_ARCHIVES: u8 = 4;
    pub const EXECUTE: u8 = 5;
    pub const KEEP: u8 = 6;
    pub const FETCH: u8 = 7;
    pub const OPEN_SESSION: u8 = 8;
    pub const STEP: u8 = 9;
    pub const SIGNAL: u8 = 10;
    pub const MOVE: u8 = 11;
    pub const END_MOVE: u8 = 12;
    pub const CLOSE: u8 = 13;
    pub const LIST_SESSIONS: u8 = 14;
    pub const RESUME: u8 = 15;
    pub const INSPECT: u8 = 16;
    pub const ABORT: u8 = 17;
    pub const STATS: u8 = 18;
}

/// The bytes of a span: offset and length.
const SPAN_LEN: usize = 16;

impl ToExecutor {
    /// Appends this message to `out`, its bulk bytes placed through `bulk`.
    pub fn encode(self, out: &mut Vec<u8>, bulk: &mut dyn Bulk) -> Result<(), LinkError> {
        let mut w = Writer(out);
        match self {
            Self::Run { job, to } => {
                w.u8(tag::RUN);
                reply_to(&mut w, &to);
                encode_job(&mut w, job, bulk)?;
            }
            Self::FreeKept(ids) => free(&mut w, tag::FREE_KEPT, &ids),
            Self::FreeParked(ids) => free(&mut w, tag::FREE_PARKED, &ids),
            Self::FreeSessions(ids) => free(&mut w, tag::FREE_SESSIONS, &ids),
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8], limits: &Limits, bulk: &mut dyn Bulk) -> Result<Self, LinkError> {
        let mut r = Reader::new(bytes, limits);
        let message = match r.u8("link message")? {
            tag::RUN => {
                let to = read_reply_to(&mut r)?;
                Self::Run { job: decode_job(&mut r, bulk)?, to }
            }
            tag::FREE_KEPT => Self::FreeKept(ids(&mut r)?),
            tag::FREE_PARKED => Self::FreeParked(ids(&mut r)?),
            tag::FREE_SESSIONS => Self::FreeSessions(ids(&mut r)?),
            t => return Err(malformed(format!("link message {t} is not one the node sends"))),
        };
        finished(&r)?;
        Ok(message)
    }
}

impl FromExecutor {
    /// Appends this message to `out`, its bulk bytes placed through `bulk`.
    pub fn encode(self, out: &mut Vec<u8>, bulk: &mut dyn Bulk) -> Result<(), LinkError> {
        let mut w = Writer(out);
        match self {
            Self::Ready { epoch } => {
                w.u8(tag::READY);
                w.u64(epoch);
            }
            Self::Answered { to, answer } => {
                w.u8(tag::ANSWERED);
                reply_to(&mut w, &to);
                let (how, Reply { message, tensors }) = match answer {
                    Answer::Reply(reply) => (tag::REPLY, reply),
                    Answer::Executed(Executed { reply, still_parked: false }) => (tag::EXECUTED, reply),
                    Answer::Executed(Executed { reply, still_parked: true }) => (tag::STILL_PARKED, reply),
                };
                w.u8(how);
                w.u16(message.kind().to_wire());
                let at = w.0.len();
                w.u32(0);
                message.encode(w.0);
                let meta =
                    u32::try_from(w.0.len() - at - 4).map_err(|_| malformed("a reply's metadata past 4 GiB".into()))?;
                w.0[at..at + 4].copy_from_slice(&meta.to_le_bytes());
                w.u32(len_u32(tensors.len())?);
                for bytes in tensors {
                    span(&mut w, bulk.place(bytes)?);
                }
            }
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8], limits: &Limits, bulk: &mut dyn Bulk) -> Result<Self, LinkError> {
        let mut r = Reader::new(bytes, limits);
        let message = match r.u8("link message")? {
            tag::READY => Self::Ready { epoch: r.u64("epoch")? },
            tag::ANSWERED => {
                let to = read_reply_to(&mut r)?;
                let how = r.u8("answer")?;
                if how > tag::STILL_PARKED {
                    return Err(malformed(format!("answer {how} is not 0, 1 or 2")));
                }
                let code = r.u16("reply kind")?;
                let kind = Kind::from_wire(code).ok_or_else(|| malformed(format!("reply kind {code:#x}")))?;
                let meta_len = r.u32("reply metadata length")? as usize;
                if meta_len > limits.max_meta as usize {
                    return Err(malformed(format!("a reply's metadata of {meta_len} bytes")));
                }
                let message = Message::decode(kind, r.take(meta_len, "reply metadata")?, limits)?;
                let spans = r.list("reply tensors", SPAN_LEN, read_span)?;
                if spans.len() != message.tensors().len() {
                    return Err(malformed(format!(
                        "{} tensors' bytes for a reply of {} tensors",
                        spans.len(),
                        message.tensors().len()
                    )));
                }
                let mut tensors = Vec::with_capacity(spans.len());
                for (span, desc) in spans.into_iter().zip(message.tensors()) {
                    if span.len != desc.byte_len {
                        return Err(malformed(format!("{} bytes for a tensor of {}", span.len, desc.byte_len)));
                    }
                    tensors.push(Arc::new(bulk.take(span)?) as SharedBytes);
                }
                let reply = Reply { message, tensors };
                let answer = match how {
                    tag::REPLY => Answer::Reply(reply),
                    tag::EXECUTED => Answer::Executed(Executed { reply, still_parked: false }),
                    _ => Answer::Executed(Executed { reply, still_parked: true }),
                };
                Self::Answered { to, answer }
            }
            t => return Err(malformed(format!("link message {t} is not one an executor sends"))),
        };
        finished(&r)?;
        Ok(message)
    }
}

fn finished(r: &Reader<'_>) -> Result<(), LinkError> {
    match r.rest().len() {
        0 => Ok(()),
        n => Err(malformed(format!("{n} bytes left over after a link message"))),
    }
}

fn len_u32(n: usize) -> Result<u32, LinkError> {
    u32::try_from(n).map_err(|_| malformed(format!("a list of {n} items")))
}

fn free(w: &mut Writer<'_>, tag: u8, ids: &[u64]) {
    w.u8(tag);
    w.list(ids, |w, &id| w.u64(id));
}

fn ids(r: &mut Reader<'_>) -> Result<Vec<u64>, LinkError> {
    Ok(r.list("ids", 8, |r| r.u64("id"))?)
}

fn reply_to(w: &mut Writer<'_>, to: &ReplyTo) {
    w.u64(to.slot as u64);
    w.u64(to.conn_id);
    w.u64(to.request_id);
    w.u32(to.tenant.0);
    w.bool(to.operator);
    w.bool(to.torchscript);
}

fn read_reply_to(r: &mut Reader<'_>) -> Result<ReplyTo, LinkError> {
    Ok(ReplyTo {
        // A slot past the address space names no connection; the transport drops its reply.
        slot: usize::try_from(r.u64("slot")?).unwrap_or(usize::MAX),
        conn_id: r.u64("connection")?,
        request_id: r.u64("request id")?,
        tenant: TenantId(r.u32("tenant")?),
        operator: r.bool("operator")?,
        torchscript: r.bool("torchscript")?,
    })
}

fn span(w: &mut Writer<'_>, span: Span) {
    w.u64(span.offset);
    w.u64(span.len);
}

fn read_span(r: &mut Reader<'_>) -> Result<Span, ProtocolError> {
    Ok(Span { offset: r.u64("span offset")?, len: r.u64("span length")? })
}

fn payload(w: &mut Writer<'_>, payload: Option<Payload>, bulk: &mut dyn Bulk) -> Result<(), LinkError> {
    match payload {
        Some(p) => {
            w.u8(1);
            span(w, bulk.place(Arc::new(p))?);
        }
        None => w.u8(0),
    }
    Ok(())
}

fn read_payload(r: &mut Reader<'_>, bulk: &mut dyn Bulk) -> Result<Option<Payload>, LinkError> {
    if !r.bool("has payload")? {
        return Ok(None);
    }
    let span = read_span(r)?;
    if span.len > r.limits().max_payload {
        return Err(malformed(format!("a payload of {} bytes", span.len)));
    }
    Ok(Some(Payload { buf: bulk.take(span)?, reservation: None }))
}

fn inputs(w: &mut Writer<'_>, inputs: CallInputs, bulk: &mut dyn Bulk) -> Result<(), LinkError> {
    w.tensors(&inputs.tensors);
    w.values(&inputs.values);
    payload(w, inputs.payload, bulk)
}

fn read_inputs(r: &mut Reader<'_>, bulk: &mut dyn Bulk) -> Result<CallInputs, LinkError> {
    let tensors = r.tensors()?;
    let values = r.values(tensors.len())?;
    Ok(CallInputs { values, tensors, payload: read_payload(r, bulk)? })
}

fn names(w: &mut Writer<'_>, all: &Option<TenantNames>) {
    match all {
        Some(names) => {
            w.u8(1);
            w.u32(names.len() as u32);
            for (tenant, name) in names {
                w.u32(tenant.0);
                w.str(name);
            }
        }
        None => w.u8(0),
    }
}

fn read_names(r: &mut Reader<'_>) -> Result<Option<TenantNames>, LinkError> {
    if !r.bool("has names")? {
        return Ok(None);
    }
    let names = r.list("tenant names", 6, |r| Ok((TenantId(r.u32("tenant")?), r.string("tenant name")?)))?;
    Ok(Some(names.into_iter().collect()))
}

fn encode_job(w: &mut Writer<'_>, job: Job, bulk: &mut dyn Bulk) -> Result<(), LinkError> {
    match job {
        Job::Claim { fingerprint, public } => {
            w.u8(job::CLAIM);
            w.fingerprint(&fingerprint);
            w.bool(public);
        }
        Job::Load { upload } => {
            w.u8(job::LOAD);
            let Upload { archives, scope, tenant, connection, torchscript } = upload;
            w.fingerprint(&archives.fingerprint());
            w.list(archives.block_lens(), |w, &len| w.u64(len));
            match scope {
                Scope::Private(owner) => {
                    w.u8(0);
                    w.u32(owner.0);
                }
                Scope::Public => w.u8(1),
            }
            w.u32(tenant.0);
            w.u64(connection);
            w.bool(torchscript);
            let chunks = archives.into_chunks();
            w.u32(len_u32(chunks.len())?);
            for chunk in chunks {
                span(w, bulk.place(Arc::new(chunk))?);
            }
        }
        Job::Unregister { fingerprint } => {
            w.u8(job::UNREGISTER);
            w.fingerprint(&fingerprint);
        }
        Job::ListModels { all } => {
            w.u8(job::LIST_MODELS);
            names(w, &all);
        }
        Job::ReadArchives { fingerprint, offset, len } => {
            w.u8(job::READ_ARCHIVES);
            w.fingerprint(&fingerprint);
            w.u64(offset);
            w.u64(len);
        }
        Job::Execute { fingerprint, inputs: call, keep, until } => {
            w.u8(job::EXECUTE);
            w.fingerprint(&fingerprint);
            w.bool(keep);
            w.breakpoint(&until);
            inputs(w, call, bulk)?;
        }
        Job::Keep { tensor, payload: p } => {
            w.u8(job::KEEP);
            w.tensor(&tensor);
            payload(w, p, bulk)?;
        }
        Job::Fetch { handle } => {
            w.u8(job::FETCH);
            w.handle(&handle);
        }
        Job::OpenSession { fingerprint, state, payload: p, reserve } => {
            w.u8(job::OPEN_SESSION);
            w.fingerprint(&fingerprint);
            w.tensors(&state);
            w.u64(reserve);
            payload(w, p, bulk)?;
        }
        Job::Step { session, inputs: call, until } => {
            w.u8(job::STEP);
            w.handle(&session);
            w.breakpoint(&until);
            inputs(w, call, bulk)?;
        }
        Job::Signal { session, signal } => {
            w.u8(job::SIGNAL);
            w.handle(&session);
            w.signal(&signal);
        }
        Job::Move { session } => {
            w.u8(job::MOVE);
            w.handle(&session);
        }
        Job::EndMove { session, moved } => {
            w.u8(job::END_MOVE);
            w.handle(&session);
            match moved {
                Ok((to, handle)) => {
                    w.u8(0);
                    w.str(&to);
                    w.handle(&handle);
                }
                Err((code, message)) => {
                    w.u8(1);
                    w.u16(code.to_wire());
                    w.str(&message);
                }
            }
        }
        Job::Close { session } => {
            w.u8(job::CLOSE);
            w.handle(&session);
        }
        Job::ListSessions { all, after } => {
            w.u8(job::LIST_SESSIONS);
            names(w, &all);
            w.u64(after);
        }
        Job::Resume { parked, tensors, activation, payload: p, until } => {
            w.u8(job::RESUME);
            w.handle(&parked);
            w.tensors(&tensors);
            w.value(&activation);
            w.breakpoint(&until);
            payload(w, p, bulk)?;
        }
        Job::Inspect { parked } => {
            w.u8(job::INSPECT);
            w.handle(&parked);
        }
        Job::Abort { parked } => {
            w.u8(job::ABORT);
            w.handle(&parked);
        }
        Job::Stats => w.u8(job::STATS),
    }
    Ok(())
}

fn decode_job(r: &mut Reader<'_>, bulk: &mut dyn Bulk) -> Result<Job, LinkError> {
    Ok(match r.u8("job")? {
        job::CLAIM => Job::Claim { fingerprint: r.fingerprint()?, public: r.bool("public")? },
        job::LOAD => {
            let fingerprint = r.fingerprint()?;
            let block_lens = r.list("block lengths", 8, |r| r.u64("block length"))?;
            let scope = match r.u8("scope")? {
                0 => Scope::Private(TenantId(r.u32("owner")?)),
                1 => Scope::Public,
                v => return Err(malformed(format!("scope {v} is neither 0 nor 1"))),
            };
            let tenant = TenantId(r.u32("tenant")?);
            let connection = r.u64("connection")?;
            let torchscript = r.bool("torchscript")?;
            let spans = r.list("archive chunks", SPAN_LEN, read_span)?;
            let mut archives = Archives::new(fingerprint, block_lens)?;
            for span in spans {
                let offset = archives.received();
                archives.add(offset, Payload { buf: bulk.take(span)?, reservation: None })?;
            }
            Job::Load { upload: Upload { archives, scope, tenant, connection, torchscript } }
        }
        job::UNREGISTER => Job::Unregister { fingerprint: r.fingerprint()? },
        job::LIST_MODELS => Job::ListModels { all: read_names(r)? },
        job::READ_ARCHIVES => {
            Job::ReadArchives { fingerprint: r.fingerprint()?, offset: r.u64("offset")?, len: r.u64("length")? }
        }
        job::EXECUTE => {
            let fingerprint = r.fingerprint()?;
            let keep = r.bool("keep")?;
            let until = r.breakpoint()?;
            Job::Execute { fingerprint, inputs: read_inputs(r, bulk)?, keep, until }
        }
        job::KEEP => Job::Keep { tensor: r.tensor()?, payload: read_payload(r, bulk)? },
        job::FETCH => Job::Fetch { handle: r.handle()? },
        job::OPEN_SESSION => {
            let fingerprint = r.fingerprint()?;
            let state = r.tensors()?;
            let reserve = r.u64("reserve")?;
            Job::OpenSession { fingerprint, state, reserve, payload: read_payload(r, bulk)? }
        }
        job::STEP => {
            let session = r.handle()?;
            let until = r.breakpoint()?;
            Job::Step { session, until, inputs: read_inputs(r, bulk)? }
        }
        job::SIGNAL => Job::Signal { session: r.handle()?, signal: r.signal()? },
        job::MOVE => Job::Move { session: r.handle()? },
        job::END_MOVE => {
            let session = r.handle()?;
            let moved = match r.u8("move outcome")? {
                0 => Ok((r.string("peer address")?, r.handle()?)),
                1 => Err((ErrorCode::from_wire(r.u16("code")?), r.string("refusal")?)),
                v => return Err(malformed(format!("move outcome {v} is neither 0 nor 1"))),
            };
            Job::EndMove { session, moved }
        }
        job::CLOSE => Job::Close { session: r.handle()? },
        job::LIST_SESSIONS => Job::ListSessions { all: read_names(r)?, after: r.u64("after")? },
        job::RESUME => {
            let parked = r.handle()?;
            let tensors = r.tensors()?;
            let activation = r.value(tensors.len())?;
            let until = r.breakpoint()?;
            Job::Resume { parked, tensors, activation, until, payload: read_payload(r, bulk)? }
        }
        job::INSPECT => Job::Inspect { parked: r.handle()? },
        job::ABORT => Job::Abort { parked: r.handle()? },
        job::STATS => Job::Stats,
        t => return Err(malformed(format!("job {t} is not one the node sends"))),
    })
}

#[cfg(test)]
mod tests {
    use djinn_proto::{Breakpoint, DType, Fingerprint, Handle, Signal, TensorDesc, Value};

    use super::*;

    fn to() -> ReplyTo {
        ReplyTo { slot: 3, conn_id: 77, request_id: 9, tenant: TenantId(5), operator: false, torchscript: true }
    }

    fn bytes(n: usize) -> Option<Payload> {
        let buf = HostBuf::copy_from(&(0..n).map(|i| i as u8).collect::<Vec<u8>>()).expect("memory");
        Some(Payload { buf, reservation: None })
    }

    fn call() -> CallInputs {
        let tensor = TensorDesc::new(DType::F32, vec![2, 3]).expect("a tensor");
        let values = vec![Value::Tensor(0), Value::Dict(vec![(Value::Str("k".into()), Value::Int(-4))])];
        CallInputs { values, tensors: vec![tensor], payload: bytes(24) }
    }

    /// One job of every kind, with what each can carry.
    fn every_job() -> Vec<Job> {
        let f = Fingerprint([7; 32]);
        let h = Handle { id: 12, epoch: 0xfeed };
        let until = Some(Breakpoint { block: 2, send_activation: true });
        let names: TenantNames = [(TenantId(1), "alice".to_owned()), (TenantId(2), "bob".to_owned())].into();
        let mut upload = Upload::new(f, vec![3, 5], (TenantId(5), true), 77).expect("an upload");
        upload.archives.add(0, bytes(6).expect("a chunk")).expect("in order");
        upload.archives.add(6, bytes(2).expect("a chunk")).expect("in order");
        let state = vec![TensorDesc::new(DType::I64, vec![4]).expect("a tensor")];
        vec![
            Job::Claim { fingerprint: f, public: true },
            Job::Load { upload },
            Job::Unregister { fingerprint: f },
            Job::ListModels { all: None },
            Job::ListModels { all: Some(names.clone()) },
            Job::ReadArchives { fingerprint: f, offset: 3, len: 9 },
            Job::Execute { fingerprint: f, inputs: call(), keep: true, until },
            Job::Keep { tensor: TensorDesc::new(DType::U8, vec![5]).expect("a tensor"), payload: bytes(5) },
            Job::Fetch { handle: h },
            Job::OpenSession { fingerprint: f, state, payload: bytes(32), reserve: 1 << 20 },
            Job::Step { session: h, inputs: call(), until: None },
            Job::Signal { session: h, signal: Signal::IoWait { resume_in_ms: Some(40) } },
            Job::Signal { session: h, signal: Signal::Compute },
            Job::Move { session: h },
            Job::EndMove { session: h, moved: Ok(("10.0.0.2:7000".into(), Handle { id: 1, epoch: 2 })) },
            Job::EndMove { session: h, moved: Err((ErrorCode::QuotaExceeded, "full".into())) },
            Job::Close { session: h },
            Job::ListSessions { all: Some(names), after: 40 },
            Job::Resume { parked: h, tensors: vec![], activation: Some(Value::Float(0.5)), payload: None, until },
            Job::Inspect { parked: h },
            Job::Abort { parked: h },
            Job::Stats,
        ]
    }

    fn encoded(message: ToExecutor) -> (Vec<u8>, VecBulk) {
        let (mut out, mut arena) = (Vec::new(), VecBulk::default());
        message.encode(&mut out, &mut arena).expect("encodes");
        (out, arena)
    }

    #[test]
    fn every_job_comes_through_as_it_went_in_with_its_bulk_bytes() {
        let limits = Limits::default();
        let mut messages: Vec<ToExecutor> =
            every_job().into_iter().map(|job| ToExecutor::Run { job, to: to() }).collect();
        messages.extend([
            ToExecutor::FreeKept(vec![1, 2]),
            ToExecutor::FreeParked(vec![]),
            ToExecutor::FreeSessions(vec![9]),
        ]);
        for message in messages {
            let shown = format!("{message:?}");
            let (bytes, mut arena) = encoded(message);
            let decoded = ToExecutor::decode(&bytes, &limits, &mut arena).expect("decodes");
            assert_eq!(format!("{decoded:?}"), shown);
            // The bytes too: encoded again, the same message and the same bulk bytes.
            let (again, again_arena) = encoded(decoded);
            assert_eq!((&again, &again_arena.0), (&bytes, &arena.0), "{shown}");
            // Cut anywhere, it is refused, never half-read.
            for cut in 0..bytes.len() {
                assert!(ToExecutor::decode(&bytes[..cut], &limits, &mut arena).is_err(), "{shown} cut at {cut}");
            }
        }
    }

    #[test]
    fn an_answer_comes_through_with_its_tensors_and_lies_about_them_are_refused() {
        let limits = Limits::default();
        let tensor = TensorDesc::new(DType::F32, vec![2]).expect("a tensor");
        let message =
            djinn_proto::ModelMessage::ExecuteReply { tensors: vec![tensor], output: Value::Tensor(0), kept: vec![] };
        let reply = Reply { message: message.into(), tensors: vec![Arc::new(vec![1u8, 2, 3, 4, 5, 6, 7, 8])] };
        let answer =
            FromExecutor::Answered { to: to(), answer: Answer::Executed(Executed { reply, still_parked: true }) };
        let (mut out, mut arena) = (Vec::new(), VecBulk::default());
        answer.encode(&mut out, &mut arena).expect("encodes");
        let decoded = FromExecutor::decode(&out, &limits, &mut arena).expect("decodes");
        let FromExecutor::Answered { to: back, answer: Answer::Executed(executed) } = decoded else {
            panic!("not the executor's answer: {decoded:?}");
        };
        assert_eq!(back, to());
        assert!(executed.still_parked);
        assert_eq!((*executed.reply.tensors[0]).as_ref(), &[1, 2, 3, 4, 5, 6, 7, 8]);

        // The tensor's bytes said to be 4 long, or to lie past the shared memory.
        let span_at = out.len() - 16;
        let mut short = out.clone();
        short[span_at + 8..].copy_from_slice(&4u64.to_le_bytes());
        assert!(matches!(FromExecutor::decode(&short, &limits, &mut arena), Err(LinkError::Malformed(_))));
        let mut outside = out.clone();
        outside[span_at..span_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(FromExecutor::decode(&outside, &limits, &mut arena), Err(LinkError::Bulk { .. })));
        let ready = FromExecutor::Ready { epoch: 42 };
        let mut out = Vec::new();
        ready.encode(&mut out, &mut arena).expect("encodes");
        assert!(matches!(FromExecutor::decode(&out, &limits, &mut arena), Ok(FromExecutor::Ready { epoch: 42 })));
    }

    proptest::proptest! {
        /// Whatever bytes an executor (or a node) writes, decoding them gives a message or an
        /// error, never a panic, and never takes bulk bytes outside the shared memory.
        #[test]
        fn any_bytes_decode_to_a_message_or_an_error(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            job in 0usize..22,
            flip in proptest::prelude::any::<(usize, u8)>(),
        ) {
            let limits = Limits::default();
            let mut arena = VecBulk(vec![0; 64]);
            let _ = FromExecutor::decode(&bytes, &limits, &mut arena);
            let _ = ToExecutor::decode(&bytes, &limits, &mut arena);
            // A valid job with one byte changed.
            let job = every_job().into_iter().nth(job).expect("a job");
            let (mut valid, mut arena) = encoded(ToExecutor::Run { job, to: to() });
            let at = flip.0 % valid.len();
            valid[at] ^= flip.1;
            let _ = ToExecutor::decode(&valid, &limits, &mut arena);
        }
    }
}
