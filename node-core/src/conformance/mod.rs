//! What any executor behind the core must answer, as a client sees it through the core: one
//! suite of requests and the replies they must get, run by the core's own tests with an
//! executor double ([`FakeExecutor`]) and by `djinn-executor`'s tests with the real executor.
//! Built for tests only (feature `conformance`).

mod fake;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use djinn_auth::TenantId;
use djinn_memory::MemoryBudget;
use djinn_proto::{
    DType, DataMessage, ErrorCode, Fingerprint, Frame, Handle, HandleInfo, KeptMessage, Message, ModelMessage,
    SessionMessage, TensorDesc, Value,
};

pub use fake::FakeExecutor;

use crate::{
    Answer, CoreOptions, Executor, MovedSession, NodeCore, Peers, PushedTensor, Replier, Reply, ReplyTo, Service,
};

/// How long a reply from the executor's own threads may take in the suite.
const REPLY_WAIT: Duration = Duration::from_secs(30);
/// How long a kept tensor lies unused before the core frees it, in the suite's time.
const HANDLE_TTL: Duration = Duration::from_secs(60);

/// Peers that refuse everything: the suite reaches no other node.
#[derive(Debug)]
pub struct NoPeers;

impl Peers for NoPeers {
    fn push(&self, _: PushedTensor, to: String, _: String, _: String, reply_to: ReplyTo, replier: &Replier) {
        replier.send(reply_to, Reply::error(ErrorCode::Forbidden, format!("{to:?} is not a node of this test")));
    }

    fn open_session(&self, _: MovedSession, to: String, _: String, _: String, reply_to: ReplyTo, replier: &Replier) {
        replier.executed(reply_to, Reply::error(ErrorCode::Forbidden, format!("{to:?} is not a node of this test")));
    }
}

/// A core over the executor under test, asked as a transport asks it, with the replies its
/// executor sends later collected.
struct Client<E> {
    core: NodeCore<E>,
    replier: Replier,
    replies: Receiver<(ReplyTo, Answer)>,
    last_request: u64,
    /// The time the core is told.
    now: Instant,
}

impl<E: Executor> Client<E> {
    fn new(executor: E, budget: MemoryBudget) -> Self {
        let options = CoreOptions {
            pool_bytes: 0,
            max_meta: 1 << 20,
            host_budget: MemoryBudget::new(1 << 30),
            upload_timeout: Duration::from_secs(60),
            keep_in_place: false,
            auth: None,
            peers: Arc::new(NoPeers),
            handle_ttl: HANDLE_TTL,
            parked_ttl: HANDLE_TTL,
            session_idle_ttl: HANDLE_TTL,
        };
        let (replier, replies) = Replier::new(Arc::new(|| {}));
        let now = Instant::now();
        Self { core: NodeCore::new(budget, options, executor), replier, replies, last_request: 0, now }
    }

    /// The node's counter `name`, from the core's stats and its executor's.
    fn stat(&mut self, name: &str) -> u64 {
        let to = self.next_request();
        let reply = self.core.stats(Vec::new(), to, &self.replier);
        let stats = match self.answer(to, reply).message {
            Message::Data(DataMessage::StatsReply { counters }) => counters,
            other => panic!("stats answered {other:?}"),
        };
        stats.into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no stat {name}")).1
    }

    fn next_request(&mut self) -> ReplyTo {
        self.last_request += 1;
        let request_id = self.last_request;
        ReplyTo { slot: 0, conn_id: 1, request_id, tenant: TenantId::DEFAULT, operator: false, torchscript: true }
    }

    /// The answer to the request `to`: `now`, or as the transport has it, from the executor's
    /// threads and completed by the core.
    fn answer(&mut self, to: ReplyTo, now: Option<Reply>) -> Reply {
        if let Some(reply) = now {
            return reply;
        }
        loop {
            let (answered, answer) =
                self.replies.recv_timeout(REPLY_WAIT).expect("a reply from the executor's threads");
            assert_eq!(answered.request_id, to.request_id, "the reply answers the request");
            let reply = match answer {
                Answer::Reply(reply) => Some(reply),
                Answer::Executed(answer) => self.core.complete(answered, answer, &self.replier, self.now),
            };
            if let Some(reply) = reply {
                return reply;
            }
        }
    }

    /// The reply to `message` with `payload` as its bytes: now, or from the executor's threads.
    fn ask(&mut self, message: impl Into<Message>, payload: &[u8]) -> Reply {
        let message = message.into();
        let payload = (!payload.is_empty()).then(|| {
            let mut p = match self.core.alloc(&message, payload.len(), TenantId::DEFAULT) {
                Ok(p) => p,
                Err(refusal) => panic!("no memory for a {}: {refusal:?}", message.kind().name()),
            };
            p.buf.as_mut_slice().copy_from_slice(payload);
            p
        });
        let to = self.next_request();
        let frame = Frame { request_id: to.request_id, message, payload };
        let now = self.core.handle(frame, to, &self.replier, self.now);
        self.answer(to, now)
    }

    /// Registers a model of one block, `archive`: what the node says of it.
    fn register(&mut self, archive: &[u8]) -> Message {
        let fingerprint = Fingerprint::of_blocks(&[archive]);
        let begin = ModelMessage::RegisterBegin { fingerprint, blocks: vec![archive.len() as u64], public: false };
        let upload = match self.ask(begin, &[]).message {
            Message::Model(ModelMessage::RegisterReady { upload, registered: false }) => upload,
            other => panic!("{other:?}"),
        };
        let chunk = TensorDesc::new(DType::U8, vec![archive.len() as u64]).unwrap();
        let progress = self.ask(ModelMessage::RegisterChunk { upload, offset: 0, chunk }, archive);
        assert!(matches!(progress.message, Message::Model(ModelMessage::RegisterProgress { .. })), "{progress:?}");
        self.ask(ModelMessage::RegisterCommit { upload }, &[]).message
    }
}

fn error_code(reply: &Reply) -> Option<ErrorCode> {
    match &reply.message {
        Message::Data(DataMessage::Error { code, .. }) => Some(*code),
        _ => None,
    }
}

fn f32s(values: &[f32]) -> (TensorDesc, Vec<u8>) {
    let desc = TensorDesc::new(DType::F32, vec![values.len() as u64]).unwrap();
    (desc, values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn bytes(reply: &Reply, i: usize) -> Vec<u8> {
    reply.tensors[i].as_ref().as_ref().to_vec()
}

/// Runs the suite on executors `make` gives (a fresh one per part), whose device memory is the
/// budget given beside each. `identity` is the archive of a model whose one block returns its
/// one input, in a form the executor loads.
pub fn run<E: Executor>(make: impl Fn() -> (E, MemoryBudget), identity: &[u8]) {
    let (executor, budget) = make();
    models_are_registered_run_and_unregistered(&mut Client::new(executor, budget), identity);
    let (executor, budget) = make();
    tensors_are_kept_fetched_listed_and_released(&mut Client::new(executor, budget));
    let (executor, budget) = make();
    outputs_are_kept_until_released_or_expired(&mut Client::new(executor, budget), identity);
    let (executor, budget) = make();
    what_the_node_does_not_hold_is_refused_typed(&mut Client::new(executor, budget));
}

fn models_are_registered_run_and_unregistered<E: Executor>(c: &mut Client<E>, identity: &[u8]) {
    let fingerprint = Fingerprint::of_blocks(&[identity]);
    match c.register(identity) {
        Message::Model(ModelMessage::Registered { model }) => assert_eq!(model.fingerprint, fingerprint),
        other => panic!("{other:?}"),
    }
    match c.ask(ModelMessage::ListModels, &[]).message {
        Message::Model(ModelMessage::ModelList { models }) => {
            assert_eq!(models.iter().map(|m| m.fingerprint).collect::<Vec<_>>(), [fingerprint]);
        }
        other => panic!("{other:?}"),
    }
    let (desc, input) = f32s(&[1.0, -2.0, 3.5, 0.0]);
    let execute = ModelMessage::Execute {
        fingerprint,
        tensors: vec![desc.clone()],
        inputs: vec![Value::Tensor(0)],
        keep: false,
        until: None,
    };
    let reply = c.ask(execute, &input);
    match &reply.message {
        Message::Model(ModelMessage::ExecuteReply { tensors, output: Value::Tensor(0), kept }) => {
            assert_eq!(tensors, &[desc]);
            assert!(kept.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(bytes(&reply, 0), input, "the identity's output is its input");
    drop(reply);
    let unregistered = c.ask(ModelMessage::Unregister { fingerprint }, &[]);
    assert_eq!(unregistered.message, Message::Model(ModelMessage::UnregisterAck));
    let (desc, input) = f32s(&[1.0]);
    let again = ModelMessage::Execute {
        fingerprint,
        tensors: vec![desc],
        inputs: vec![Value::Tensor(0)],
        keep: false,
        until: None,
    };
    assert_eq!(error_code(&c.ask(again, &input)), Some(ErrorCode::UnknownModel));
}

fn tensors_are_kept_fetched_listed_and_released<E: Executor>(c: &mut Client<E>) {
    let (desc, data) = f32s(&[0.5, 1.5]);
    let kept = match c.ask(KeptMessage::Keep { tensor: desc.clone() }, &data).message {
        Message::Kept(KeptMessage::Kept { kept }) => kept,
        other => panic!("{other:?}"),
    };
    assert_eq!(kept.tensor, desc);
    let fetched = c.ask(KeptMessage::Fetch { handle: kept.handle }, &[]);
    assert_eq!(fetched.message, Message::Data(DataMessage::GetReply { tensor: desc }));
    assert_eq!(bytes(&fetched, 0), data);
    match c.ask(KeptMessage::List { after: 0 }, &[]).message {
        Message::Kept(KeptMessage::KeptList { tensors, more: false }) => {
            assert_eq!(tensors.iter().map(|e| &e.kept).collect::<Vec<&HandleInfo>>(), [&kept]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stat("executor_kept_tensors"), 1);
    let released = c.ask(KeptMessage::Release { handles: vec![kept.handle, kept.handle] }, &[]);
    assert_eq!(released.message, Message::Kept(KeptMessage::Released { released: 1 }), "once");
    assert_eq!(error_code(&c.ask(KeptMessage::Fetch { handle: kept.handle }, &[])), Some(ErrorCode::NotFound));
    assert_eq!((c.stat("handles"), c.stat("executor_kept_tensors")), (0, 0), "freed where it was held");
}

fn outputs_are_kept_until_released_or_expired<E: Executor>(c: &mut Client<E>, identity: &[u8]) {
    let fingerprint = Fingerprint::of_blocks(&[identity]);
    assert!(matches!(c.register(identity), Message::Model(ModelMessage::Registered { .. })));
    let (desc, input) = f32s(&[4.0, 5.0]);
    let mut execute_kept = || {
        let execute = ModelMessage::Execute {
            fingerprint,
            tensors: vec![desc.clone()],
            inputs: vec![Value::Tensor(0)],
            keep: true,
            until: None,
        };
        match c.ask(execute, &input).message {
            Message::Model(ModelMessage::ExecuteReply { tensors, output: Value::Handle(handle), kept }) => {
                assert!(tensors.is_empty(), "nothing is sent");
                assert_eq!(kept.iter().map(|k| k.handle).collect::<Vec<_>>(), [handle]);
                handle
            }
            other => panic!("{other:?}"),
        }
    };
    let first = execute_kept();
    let second = execute_kept();
    assert_eq!(c.stat("handles"), 2, "the core records what the executor kept");
    assert_eq!(bytes(&c.ask(KeptMessage::Fetch { handle: first }, &[]), 0), input);
    // A kept output is an input of the next call by its handle.
    let again = ModelMessage::Execute {
        fingerprint,
        tensors: Vec::new(),
        inputs: vec![Value::Handle(second)],
        keep: false,
        until: None,
    };
    let reply = c.ask(again, &[]);
    assert!(matches!(reply.message, Message::Model(ModelMessage::ExecuteReply { .. })), "{reply:?}");
    assert_eq!(bytes(&reply, 0), input);
    let stale = Handle { epoch: first.epoch.wrapping_add(1), ..first };
    assert_eq!(error_code(&c.ask(KeptMessage::Fetch { handle: stale }, &[])), Some(ErrorCode::StaleHandle));

    // The first was used last: past the idle time limit after the second's use, only it stays.
    c.now += HANDLE_TTL / 2;
    assert_eq!(bytes(&c.ask(KeptMessage::Fetch { handle: first }, &[]), 0), input);
    c.now += HANDLE_TTL / 2 + HANDLE_TTL / 4;
    c.core.expire(c.now, &c.replier);
    assert_eq!((c.stat("handles"), c.stat("handles_expired"), c.stat("executor_kept_tensors")), (1, 1, 1));
    let gone = c.ask(KeptMessage::Fetch { handle: second }, &[]);
    assert_eq!(error_code(&gone), Some(ErrorCode::NotFound));
    let released = c.ask(KeptMessage::Release { handles: vec![first, second] }, &[]);
    assert_eq!(released.message, Message::Kept(KeptMessage::Released { released: 1 }));
    assert_eq!((c.stat("handles"), c.stat("executor_kept_tensors")), (0, 0));
}

fn what_the_node_does_not_hold_is_refused_typed<E: Executor>(c: &mut Client<E>) {
    let unknown = Fingerprint::of_blocks(&[b"held nowhere"]);
    let (desc, input) = f32s(&[1.0]);
    let execute = ModelMessage::Execute {
        fingerprint: unknown,
        tensors: vec![desc],
        inputs: vec![Value::Tensor(0)],
        keep: false,
        until: None,
    };
    assert_eq!(error_code(&c.ask(execute, &input)), Some(ErrorCode::UnknownModel));
    let open = SessionMessage::Open { fingerprint: unknown, state: Vec::new(), reserve: 0 };
    assert_eq!(error_code(&c.ask(open, &[])), Some(ErrorCode::UnknownModel));
    assert_eq!(
        error_code(&c.ask(ModelMessage::Unregister { fingerprint: unknown }, &[])),
        Some(ErrorCode::UnknownModel)
    );
    let read = ModelMessage::ReadArchives { fingerprint: unknown, offset: 0, len: 0 };
    assert_eq!(error_code(&c.ask(read, &[])), Some(ErrorCode::UnknownModel));
    assert_eq!(
        c.ask(ModelMessage::ListModels, &[]).message,
        Message::Model(ModelMessage::ModelList { models: Vec::new() })
    );
    let sessions = c.ask(SessionMessage::List { after: 0 }, &[]).message;
    assert_eq!(sessions, Message::Session(SessionMessage::SessionList { sessions: Vec::new(), more: false }));
}
