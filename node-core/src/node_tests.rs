//! The core with no socket: requests handed to it as a transport would (`alloc`, then
//! `handle`), time passed in, and an executor double that records what it is asked.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use djinn_auth::TenantId;
use djinn_memory::MemoryBudget;
use djinn_proto::{
    Breakpoint, BreakpointMessage, DType, DataMessage, ErrorCode, Fingerprint, Frame, Handle, HandleInfo, KeptMessage,
    Message, ModelMessage, Refusal, SessionMessage, SharedBytes, TensorDesc, TensorSource, Value,
};

use crate::{
    Answer, CoreOptions, Executed, Executor, Job, MAX_ARCHIVE_READ, MAX_UPLOADS_PER_TENANT, MIN_CHARGE, MovedSession,
    NodeCore, Peers, PushedTensor, Replier, Reply, ReplyTo, Service,
};

/// An executor that answers nothing itself: it keeps each job (with its payload, so that what
/// the payload is charged stays held until the job is dropped) and answers later, as workers do.
#[derive(Debug, Default)]
struct Recorder {
    jobs: Vec<(Job, ReplyTo)>,
    /// Models the node holds already: claims of them are answered at once.
    held: Vec<Fingerprint>,
    /// The kept tensors the core told it to free, by id.
    freed: Vec<u64>,
    /// The parked requests the core told it to free, by id.
    unparked: Vec<u64>,
    /// The sessions the core told it to free, by id.
    closed: Vec<u64>,
}

/// The epoch of the recorder's handles.
const EPOCH: u64 = 5;

impl Executor for Recorder {
    fn run(&mut self, job: Job, to: ReplyTo, _: &Replier) {
        self.jobs.push((job, to));
    }

    fn epoch(&self) -> u64 {
        EPOCH
    }

    fn free_kept(&mut self, ids: &[u64]) {
        self.freed.extend_from_slice(ids);
    }

    fn free_parked(&mut self, ids: &[u64]) {
        self.unparked.extend_from_slice(ids);
    }

    fn free_sessions(&mut self, ids: &[u64]) {
        self.closed.extend_from_slice(ids);
    }
}

/// Pushes recorded: (tensor, peer, tenant name); and sessions' moves: (state, peer, tenant
/// name), answered by the test.
#[derive(Debug, Default)]
struct PushLog(Mutex<Vec<(TensorDesc, Vec<u8>, String)>>, Mutex<Vec<(MovedSession, String, String, ReplyTo)>>);

impl Peers for PushLog {
    fn push(&self, tensor: PushedTensor, to: String, _: String, _: String, _: ReplyTo, _: &Replier) {
        let PushedTensor { desc, bytes } = tensor;
        self.0.lock().unwrap().push((desc, bytes.as_ref().as_ref().to_vec(), to));
    }

    fn open_session(
        &self,
        session: MovedSession,
        to: String,
        _: String,
        tenant: String,
        reply_to: ReplyTo,
        _: &Replier,
    ) {
        self.1.lock().unwrap().push((session, to, tenant, reply_to));
    }
}

struct Harness {
    core: NodeCore<Recorder>,
    device: MemoryBudget,
    host: MemoryBudget,
    pushes: Arc<PushLog>,
    replier: Replier,
    /// What the core sent through `replier` (answers to requests that waited on a session).
    sent: crossbeam_channel::Receiver<(ReplyTo, Answer)>,
    next_request: u64,
    /// The time the core is told.
    now: Instant,
}

const ALICE: TenantId = TenantId(1);
const TIMEOUT: Duration = Duration::from_secs(30);

fn harness(keep_in_place: bool) -> Harness {
    harness_with(keep_in_place, None)
}

fn harness_with(keep_in_place: bool, auth: Option<Arc<djinn_auth::Authenticator>>) -> Harness {
    let device = MemoryBudget::new(1 << 20);
    let host = MemoryBudget::new(1 << 20);
    let pushes = Arc::new(PushLog::default());
    let options = CoreOptions {
        pool_bytes: 0,
        max_meta: 64 * 1024,
        host_budget: host.clone(),
        upload_timeout: TIMEOUT,
        keep_in_place,
        auth,
        peers: Arc::clone(&pushes) as Arc<dyn Peers>,
        handle_ttl: TIMEOUT,
        parked_ttl: TIMEOUT,
        session_idle_ttl: TIMEOUT,
    };
    let (replier, sent) = Replier::new(Arc::new(|| {}));
    Harness {
        core: NodeCore::new(device.clone(), options, Recorder::default()),
        device,
        host,
        pushes,
        replier,
        sent,
        next_request: 1,
        now: Instant::now(),
    }
}

impl Harness {
    /// Hands `message`, with `payload` as its bytes, to the core as a transport would, on
    /// connection `conn`: its memory first, then the request.
    fn request_on(&mut self, conn: u64, message: Message, payload: &[u8]) -> Result<Option<Reply>, Refusal> {
        let payload = if payload.is_empty() {
            None
        } else {
            let mut p = self.core.alloc(&message, payload.len(), ALICE)?;
            p.buf.as_mut_slice().copy_from_slice(payload);
            Some(p)
        };
        let request_id = self.next_request;
        self.next_request += 1;
        let to = ReplyTo { slot: 0, conn_id: conn, request_id, tenant: ALICE, operator: false, torchscript: false };
        Ok(self.core.handle(Frame { request_id, message, payload }, to, &self.replier, self.now))
    }

    fn request(&mut self, message: impl Into<Message>, payload: &[u8]) -> Option<Reply> {
        self.request_on(1, message.into(), payload).expect("memory for the payload")
    }

    fn jobs(&self) -> &[(Job, ReplyTo)] {
        &self.core.executor.jobs
    }

    /// Begins a registration: the core asks the executor's claim first, which the recorder
    /// answers as its `held` says. What the core sends.
    fn register_begin(&mut self, begin: ModelMessage) -> Reply {
        assert!(self.request(begin, &[]).is_none(), "a claim is the executor's to answer");
        let (Job::Claim { fingerprint, .. }, to) = self.core.executor.jobs.pop().expect("a claim") else {
            panic!("not a claim");
        };
        let registered = self.core.executor.held.contains(&fingerprint);
        let answer = Reply::message(ModelMessage::RegisterReady { upload: 0, registered });
        self.core.complete(to, answer.into(), &self.replier, self.now).expect("the core's answer")
    }

    /// Answers the executor's oldest job with `reply`, as its worker would: what the core sends.
    fn answer(&mut self, reply: Reply) -> Option<Reply> {
        let (_, to) = self.core.executor.jobs.remove(0);
        self.core.complete(to, reply.into(), &self.replier, self.now)
    }
}

fn error_of(reply: Option<Reply>) -> (ErrorCode, String) {
    match reply.map(|r| r.message) {
        Some(Message::Data(DataMessage::Error { code, message })) => (code, message),
        other => panic!("expected an error, got {other:?}"),
    }
}

fn f32s(n: u64) -> TensorDesc {
    TensorDesc::new(DType::F32, vec![n]).unwrap()
}

#[test]
fn named_tensors_are_the_cores_own_and_charged_to_the_device_budget() {
    let mut h = harness(false);
    let put = DataMessage::Put { name: "x".into(), tensor: f32s(4) };
    let reply = h.request(put, &[7; 16]).unwrap();
    assert_eq!(reply.message, Message::Data(DataMessage::PutAck { replaced: false }));
    assert_eq!(h.device.used(), 16 + MIN_CHARGE + 1, "its bytes, and its bookkeeping with its name");
    let got = h.request(DataMessage::Get { name: "x".into() }, &[]).unwrap();
    assert_eq!(got.tensors[0].as_ref().as_ref(), &[7; 16]);
    drop(got);
    let pushed = h.request(
        KeptMessage::Push { source: TensorSource::Named("x".into()), to: "peer:1".into(), grant: "g".into() },
        &[],
    );
    assert!(pushed.is_none(), "a push is answered when it is done");
    assert_eq!(h.pushes.0.lock().unwrap().as_slice(), &[(f32s(4), vec![7; 16], "peer:1".to_owned())]);
    let missing = KeptMessage::Push { source: TensorSource::Named("y".into()), to: "peer:1".into(), grant: "g".into() };
    assert_eq!(error_of(h.request(missing, &[])).0, ErrorCode::NotFound);
    assert_eq!(
        h.request(DataMessage::Delete { name: "x".into() }, &[]).unwrap().message,
        Message::Data(DataMessage::DeleteAck)
    );
    assert_eq!(h.device.used(), 0);
    assert!(h.jobs().is_empty(), "the executor was asked nothing");
}

/// Begins a registration of one block of `len` bytes; the upload's number.
fn begin(h: &mut Harness, block: &[u8]) -> u64 {
    let fingerprint = Fingerprint::of_blocks(&[block]);
    let begin = ModelMessage::RegisterBegin { fingerprint, blocks: vec![block.len() as u64], public: false };
    match h.register_begin(begin).message {
        Message::Model(ModelMessage::RegisterReady { upload, registered: false }) => upload,
        other => panic!("{other:?}"),
    }
}

fn chunk(upload: u64, offset: u64, bytes: &[u8]) -> Message {
    ModelMessage::RegisterChunk { upload, offset, chunk: TensorDesc::new(DType::U8, vec![bytes.len() as u64]).unwrap() }
        .into()
}

#[test]
fn a_registration_arrives_in_chunks_and_reaches_the_executor_whole() {
    let mut h = harness(false);
    let block = [3u8; 100];
    let upload = begin(&mut h, &block);
    let bookkeeping = h.host.used();
    assert!(bookkeeping >= MIN_CHARGE, "the block lengths are charged while the upload lasts");
    for (i, part) in block.chunks(40).enumerate() {
        let reply = h.request_on(1, chunk(upload, i as u64 * 40, part), part).unwrap().unwrap();
        assert!(matches!(reply.message, Message::Model(ModelMessage::RegisterProgress { total: 100, .. })));
    }
    assert_eq!(h.host.used(), bookkeeping + 100 + 3 * MIN_CHARGE, "each chunk's bytes and a page each");
    assert!(h.request(ModelMessage::RegisterCommit { upload }, &[]).is_none(), "loading is the executor's");
    match h.jobs() {
        [(Job::Load { upload }, _)] => {
            assert_eq!(upload.archives.received(), 100);
            upload.archives.verify().expect("every byte, in order");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.core.executor.jobs.drain(..).count(), 1);
    assert_eq!(h.host.used(), 0, "the archives' charge goes with them; the bookkeeping's with the upload");
}

#[test]
fn a_registration_is_its_connections_and_goes_when_it_closes_or_falls_quiet() {
    let mut h = harness(false);
    let upload = begin(&mut h, &[1; 8]);
    let elsewhere = h.request_on(2, chunk(upload, 0, &[1; 8]), &[1; 8]).unwrap();
    assert_eq!(error_of(elsewhere).0, ErrorCode::NotFound, "another connection cannot add to it");
    assert_eq!(
        error_of(h.request_on(2, ModelMessage::RegisterCommit { upload }.into(), &[]).unwrap()).0,
        ErrorCode::NotFound
    );
    h.core.on_disconnect(1);
    assert_eq!(h.host.used(), 0, "its bookkeeping went with it");
    assert_eq!(error_of(h.request(ModelMessage::RegisterCommit { upload }, &[])).0, ErrorCode::NotFound);

    let upload = begin(&mut h, &[1; 8]);
    h.core.expire(h.now + TIMEOUT / 2, &h.replier);
    assert!(h.host.used() > 0, "not quiet long enough yet");
    h.core.expire(h.now + TIMEOUT, &h.replier);
    assert_eq!(h.host.used(), 0);
    assert_eq!(error_of(h.request(ModelMessage::RegisterCommit { upload }, &[])).0, ErrorCode::NotFound);
    assert!(h.jobs().is_empty());
}

#[test]
fn a_claim_answered_after_its_connection_closed_opens_no_upload() {
    let mut h = harness(false);
    let fingerprint = Fingerprint::of_blocks(&[[1u8; 8]]);
    let begin = ModelMessage::RegisterBegin { fingerprint, blocks: vec![8], public: false };
    assert!(h.request(begin, &[]).is_none());
    h.core.on_disconnect(1);
    let answer = Reply::message(ModelMessage::RegisterReady { upload: 0, registered: false });
    assert!(h.answer(answer).is_some(), "answered, to no one");
    assert_eq!((h.core.uploads.len(), h.host.used()), (0, 0));
}

#[test]
fn a_model_the_node_holds_is_claimed_and_registrations_in_progress_are_bounded() {
    let mut h = harness(false);
    let block = [9u8; 4];
    h.core.executor.held.push(Fingerprint::of_blocks(&[&block]));
    let begin_held =
        ModelMessage::RegisterBegin { fingerprint: Fingerprint::of_blocks(&[&block]), blocks: vec![4], public: false };
    let reply = h.register_begin(begin_held);
    assert_eq!(reply.message, Message::Model(ModelMessage::RegisterReady { upload: 0, registered: true }));
    for i in 0..MAX_UPLOADS_PER_TENANT {
        begin(&mut h, &[100 + i as u8; 4]);
    }
    let over = ModelMessage::RegisterBegin {
        fingerprint: Fingerprint::of_blocks(&[[0xff; 4]]),
        blocks: vec![4],
        public: false,
    };
    assert_eq!(error_of(Some(h.register_begin(over))).0, ErrorCode::QuotaExceeded);
}

#[test]
fn an_execution_reaches_the_executor_typed_with_its_inputs_as_they_came() {
    let mut h = harness(false);
    let fingerprint = Fingerprint::of_blocks(&[[0u8; 1]]);
    let execute = ModelMessage::Execute {
        fingerprint,
        tensors: vec![f32s(2), f32s(1)],
        inputs: vec![Value::Tensor(1), Value::Int(5), Value::Tensor(0)],
        keep: true,
        until: None,
    };
    let bytes: Vec<u8> = (0..12).collect();
    assert!(h.request(execute, &bytes).is_none());
    assert_eq!(h.host.used(), 12, "inputs are charged to the host budget while the job holds them");
    match h.jobs() {
        [(Job::Execute { fingerprint: f, inputs, keep: true, until: None }, to)] => {
            assert_eq!(*f, fingerprint);
            assert_eq!(inputs.values, vec![Value::Tensor(1), Value::Int(5), Value::Tensor(0)]);
            assert_eq!(inputs.tensors, vec![f32s(2), f32s(1)]);
            assert_eq!(inputs.payload.as_ref().unwrap().buf.as_slice(), &bytes[..]);
            assert_eq!(to.tenant, ALICE);
        }
        other => panic!("{other:?}"),
    }
    h.core.executor.jobs.clear();
    assert_eq!(h.host.used(), 0);
}

#[test]
fn a_tensor_to_keep_is_charged_where_it_will_live() {
    for (in_place, device, host) in [(true, 8, 0), (false, 0, 8)] {
        let mut h = harness(in_place);
        assert!(h.request(KeptMessage::Keep { tensor: f32s(2) }, &[1; 8]).is_none());
        assert_eq!((h.device.used(), h.host.used()), (device, host), "kept in place: {in_place}");
        assert!(matches!(h.jobs(), [(Job::Keep { .. }, _)]));
    }
}

#[test]
fn requests_refused_by_the_core_never_reach_the_executor() {
    let mut h = harness(false);
    let fingerprint = Fingerprint::of_blocks(&[[0u8; 1]]);
    let (code, message) =
        error_of(h.request(ModelMessage::ReadArchives { fingerprint, offset: 0, len: MAX_ARCHIVE_READ + 1 }, &[]));
    assert_eq!(code, ErrorCode::ExecutionFailed);
    assert!(message.contains("at most"), "{message}");
    let handle = Handle { id: 1, epoch: 1 };
    let forward = KeptMessage::Forward { handle, to: "h".repeat(300), kept: HandleInfo { handle, tensor: f32s(1) } };
    assert!(error_of(h.request(forward, &[])).1.contains("at most 256"));
    let (code, _) = error_of(h.request(DataMessage::PutAck { replaced: false }, &[]));
    assert_eq!(code, ErrorCode::Unexpected, "a reply's kind is no request");
    let refused = h.request_on(1, Message::Data(DataMessage::Ping), &[0; 4]).unwrap_err();
    assert!(refused.message.contains("carries no payload"), "{}", refused.message);
    let reply_kind = KeptMessage::Kept { kept: HandleInfo { handle, tensor: f32s(1) } };
    assert!(h.request_on(1, reply_kind.into(), &[0; 4]).is_err(), "no memory for a reply's kind");
    assert!(h.jobs().is_empty());
    assert_eq!((h.device.used(), h.host.used()), (0, 0));
}

#[test]
fn the_cores_counters_come_after_the_transports_and_before_the_executors() {
    let mut h = harness(false);
    let to = ReplyTo { slot: 0, conn_id: 1, request_id: 1, tenant: ALICE, operator: false, torchscript: false };
    let transport = vec![("frames_in".to_owned(), 3)];
    assert!(h.core.stats(transport, to, &h.replier).is_none(), "the executor's counters come later");
    assert!(matches!(h.jobs(), [(Job::Stats, _)]));
    let executor = vec![("executions".to_owned(), 2)];
    let reply = h.answer(Reply::message(DataMessage::StatsReply { counters: executor })).expect("the stats");
    let Message::Data(DataMessage::StatsReply { counters }) = reply.message else { panic!("{:?}", reply.message) };
    let names: Vec<&str> = counters.iter().map(|(k, _)| k.as_str()).collect();
    let at = |name: &str| names.iter().position(|n| *n == name).unwrap_or_else(|| panic!("{name} in {names:?}"));
    assert_eq!((at("frames_in"), at("executions")), (0, names.len() - 1));
    for name in ["store_tensors", "uploads", "host_budget_used_bytes", "handles"] {
        assert!((1..names.len() - 1).contains(&at(name)), "{name} in {names:?}");
    }
}

#[test]
fn the_executor_double_passes_the_conformance_suite() {
    // Any bytes are a model to the double; the real executor's run is in djinn-executor's tests.
    let identity = b"the identity of its one input";
    crate::conformance::run(|| (crate::conformance::FakeExecutor::default(), MemoryBudget::new(1 << 20)), identity);
}

fn kept(id: u64, n: u64) -> HandleInfo {
    HandleInfo { handle: Handle { id, epoch: EPOCH }, tensor: f32s(n) }
}

#[test]
fn what_the_executor_keeps_is_recorded_charged_and_freed_by_the_core() {
    let mut h = harness(false);
    assert!(h.request(KeptMessage::Keep { tensor: f32s(4) }, &[1; 16]).is_none());
    let answer = Reply::message(KeptMessage::Kept { kept: kept(1, 4) });
    assert_eq!(h.answer(answer).unwrap().message, Message::Kept(KeptMessage::Kept { kept: kept(1, 4) }));
    assert_eq!(h.device.used(), 16 + MIN_CHARGE, "a copy is charged its bytes and a page");
    // An execution's outputs kept, over the budget: refused, and freed where they are held.
    let execute = |input: Handle| ModelMessage::Execute {
        fingerprint: Fingerprint::of_blocks(&[[0u8; 1]]),
        tensors: Vec::new(),
        inputs: vec![Value::Handle(input)],
        keep: true,
        until: None,
    };
    assert!(h.request(execute(kept(1, 4).handle), &[]).is_none(), "its input is the tenant's");
    let outputs = vec![kept(2, 1), kept(3, 1 << 18)];
    let message = ModelMessage::ExecuteReply { tensors: Vec::new(), output: Value::None, kept: outputs };
    assert_eq!(error_of(h.answer(Reply::message(message))).0, ErrorCode::OverBudget);
    assert_eq!(h.core.executor.freed, [2, 3]);
    assert_eq!(h.device.used(), 16 + MIN_CHARGE, "nothing of the refused answer is held");
    // Handles are checked before a job reaches the executor.
    let stale = Handle { id: 1, epoch: 4 };
    assert_eq!(error_of(h.request(execute(stale), &[])).0, ErrorCode::StaleHandle);
    assert_eq!(error_of(h.request(execute(kept(9, 1).handle), &[])).0, ErrorCode::NotFound);
    assert!(h.jobs().is_empty());
    // Unused past the idle time limit: its record goes and the executor frees it.
    assert!(h.core.next_expiry().is_some_and(|at| at <= h.now + TIMEOUT / 4), "swept four times per limit");
    h.core.expire(h.now + TIMEOUT, &h.replier);
    assert_eq!(h.core.executor.freed, [2, 3, 1]);
    assert_eq!((h.device.used(), h.core.next_expiry()), (0, None), "nothing left to expire");
}

#[test]
fn a_tensor_kept_over_its_payload_is_charged_once() {
    let mut h = harness(true);
    assert!(h.request(KeptMessage::Keep { tensor: f32s(4) }, &[1; 16]).is_none());
    let payload_charge = h.device.used();
    // The executor holds the payload under the tensor it keeps.
    let (job, to) = h.core.executor.jobs.remove(0);
    let answer = Reply::message(KeptMessage::Kept { kept: kept(1, 4) });
    assert!(h.core.complete(to, answer.into(), &h.replier, h.now).is_some());
    assert_eq!(h.device.used(), payload_charge + MIN_CHARGE, "the payload carries its bytes' charge");
    drop(job);
    assert_eq!(h.device.used(), MIN_CHARGE, "until the executor frees it");
}

#[test]
fn a_kept_tensor_is_read_by_the_executor_and_pushed_by_the_core() {
    let mut h = harness(false);
    assert!(h.request(KeptMessage::Keep { tensor: f32s(1) }, &[1; 4]).is_none());
    h.answer(Reply::message(KeptMessage::Kept { kept: kept(1, 1) })).unwrap();
    let push =
        KeptMessage::Push { source: TensorSource::Handle(kept(1, 1).handle), to: "peer:1".into(), grant: "g".into() };
    assert!(h.request(push, &[]).is_none());
    assert!(matches!(h.jobs(), [(Job::Fetch { handle }, _)] if *handle == kept(1, 1).handle), "read first");
    let read = Reply {
        message: DataMessage::GetReply { tensor: f32s(1) }.into(),
        tensors: vec![Arc::new(vec![9u8; 4]) as djinn_proto::SharedBytes],
    };
    assert!(h.answer(read).is_none(), "the push is answered when it is done");
    assert_eq!(h.pushes.0.lock().unwrap().as_slice(), &[(f32s(1), vec![9; 4], "peer:1".to_owned())]);
    // Forwarded there, it is freed here and requests naming it are told where it went.
    let there = HandleInfo { handle: Handle { id: 7, epoch: 1 }, tensor: f32s(1) };
    let forward = KeptMessage::Forward { handle: kept(1, 1).handle, to: "peer:1".into(), kept: there.clone() };
    assert_eq!(h.request(forward, &[]).unwrap().message, Message::Kept(KeptMessage::Forwarded));
    assert_eq!((h.core.executor.freed.as_slice(), h.device.used()), (&[1][..], 0));
    let moved = h.request(KeptMessage::Fetch { handle: kept(1, 1).handle }, &[]).unwrap();
    assert_eq!(moved.message, Message::Kept(KeptMessage::Moved { to: "peer:1".into(), kept: there }));
}

/// The executor's answer to a move: the session's state as the `Open` for the peer.
fn session_open(fingerprint: Fingerprint) -> Reply {
    let open = SessionMessage::Open { fingerprint, state: vec![f32s(2)], reserve: 64 };
    Reply { message: open.into(), tensors: vec![Arc::new(vec![1u8; 8]) as SharedBytes] }
}

/// Opens session `id` of a model, as the executor answers: what the core then knows of it.
fn open_session(h: &mut Harness, id: u64) -> Handle {
    let open = SessionMessage::Open { fingerprint: Fingerprint::of_blocks(&[b"m"]), state: vec![], reserve: 0 };
    assert!(h.request(open, &[]).is_none());
    let session = Handle { epoch: EPOCH, id };
    let opened = h.answer(Reply::message(SessionMessage::Opened { session })).expect("the answer goes");
    assert_eq!(opened.message, Message::Session(SessionMessage::Opened { session }));
    session
}

fn step(session: Handle) -> SessionMessage {
    SessionMessage::Step { session, tensors: vec![], inputs: vec![], until: None }
}

fn stepped() -> Reply {
    Reply::message(ModelMessage::ExecuteReply { tensors: vec![], output: Value::None, kept: vec![] })
}

/// The requests the core answered through its replier, in order, with the answers.
fn sent(h: &Harness) -> Vec<(u64, Message)> {
    h.sent
        .try_iter()
        .map(|(to, answer)| match answer {
            Answer::Reply(reply) => (to.request_id, reply.message),
            Answer::Executed(e) => panic!("the core sent an executor's answer: {e:?}"),
        })
        .collect()
}

#[test]
fn a_sessions_requests_reach_the_executor_one_at_a_time_and_a_parked_step_holds_the_rest() {
    let mut h = harness(false);
    let session = open_session(&mut h, 3);
    let other =
        ReplyTo { slot: 0, conn_id: 2, request_id: 1, tenant: TenantId(2), operator: false, torchscript: false };
    let refused =
        h.core.handle(Frame { request_id: 1, message: step(session).into(), payload: None }, other, &h.replier, h.now);
    assert_eq!(error_of(refused).0, ErrorCode::NotFound, "another tenant's session is unknown to it");
    let stale = Handle { epoch: EPOCH + 1, id: 3 };
    assert_eq!(error_of(h.request(step(stale), &[])).0, ErrorCode::StaleHandle);

    // The first step goes; the second waits for it, and a signal is acknowledged at once.
    assert!(h.request(step(session), &[]).is_none());
    assert!(h.request(step(session), &[]).is_none());
    let signal = SessionMessage::Signal { session, signal: djinn_proto::Signal::Compute };
    let acked = h.request(signal, &[]).expect("a signal is acknowledged when it comes");
    assert_eq!(acked.message, Message::Session(SessionMessage::Signaled));
    assert!(matches!(h.jobs(), [(Job::Step { .. }, _)]), "{:?}", h.jobs());

    // The first parks: the second waits on until the parked step ends.
    let parked = Handle { epoch: EPOCH, id: 4 };
    let paused = BreakpointMessage::Paused { parked, block: 0, tensors: vec![], activation: None };
    assert!(h.answer(Reply::message(paused)).is_some());
    assert!(h.jobs().is_empty());
    let resume = BreakpointMessage::Resume { parked, tensors: vec![], activation: None, until: None };
    assert!(h.request(resume, &[]).is_none());
    assert!(matches!(h.jobs(), [(Job::Resume { .. }, _)]));
    assert!(h.answer(stepped()).is_some());
    assert!(matches!(h.jobs(), [(Job::Step { .. }, _)]), "the step ended: the next goes");
    assert!(h.answer(stepped()).is_some());
    // The signal runs in its turn; its answer goes to no one.
    assert!(matches!(h.jobs(), [(Job::Signal { .. }, _)]));
    assert!(h.answer(Reply::message(SessionMessage::Signaled)).is_none());

    // A close refuses what came after it once it is done.
    assert!(h.request(SessionMessage::Close { session }, &[]).is_none());
    assert!(h.request(step(session), &[]).is_none());
    let queued = h.next_request - 1;
    let closed = h.answer(Reply::message(SessionMessage::Closed)).expect("the close is answered");
    assert_eq!(closed.message, Message::Session(SessionMessage::Closed));
    assert!(h.jobs().is_empty(), "what waited reached no executor");
    assert!(
        matches!(sent(&h).as_slice(), [(id, Message::Data(DataMessage::Error { code: ErrorCode::NotFound, .. }))] if *id == queued)
    );
    assert_eq!(error_of(h.request(step(session), &[])).0, ErrorCode::NotFound);
}

#[test]
fn a_sessions_parked_step_that_lapses_is_aborted_in_its_turn_and_idle_sessions_are_freed() {
    let mut h = harness(false);
    let session = open_session(&mut h, 3);
    let idle = open_session(&mut h, 8);
    let until = Some(Breakpoint { block: 0, send_activation: false });
    let parks = SessionMessage::Step { session, tensors: vec![], inputs: vec![], until };
    assert!(h.request(parks, &[]).is_none());
    let parked = Handle { epoch: EPOCH, id: 4 };
    let paused = BreakpointMessage::Paused { parked, block: 0, tensors: vec![], activation: None };
    assert!(h.answer(Reply::message(paused)).is_some());
    assert!(h.request(step(session), &[]).is_none());
    assert!(h.jobs().is_empty(), "the step waits for the parked one");

    h.core.expire(h.now + TIMEOUT + TIMEOUT / 4, &h.replier);
    assert!(h.core.executor.unparked.is_empty(), "a session's step is not freed out of its turn");
    assert!(matches!(h.jobs(), [(Job::Abort { parked: p }, _)] if *p == parked));
    assert_eq!(h.core.executor.closed, vec![8], "the idle session is freed, the parked one is not");
    assert!(h.answer(Reply::message(BreakpointMessage::Aborted)).is_none(), "the core's abort answers no one");
    assert!(matches!(h.jobs(), [(Job::Step { .. }, _)]), "the step that waited goes");
    assert_eq!(error_of(h.request(step(idle), &[])).0, ErrorCode::NotFound);
}

#[test]
fn a_session_moves_through_the_core_and_the_executor_ends_the_move_as_the_peer_answered() {
    let mut h = harness(false);
    let fingerprint = Fingerprint::of_blocks(&[b"m"]);
    let session = open_session(&mut h, 3);
    let moves = |to: &str| SessionMessage::Move { session, to: to.into(), grant: "g".into() };

    // Opened there: the executor is told where the session went.
    assert!(h.request(moves("peer:1"), &[]).is_none());
    assert!(matches!(h.jobs(), [(Job::Move { session: s }, _)] if *s == session));
    assert!(h.answer(session_open(fingerprint)).is_none(), "the state goes to the peer, not the client");
    let (moved, peer, _, to) = h.pushes.1.lock().unwrap().pop().expect("the session opened on the peer");
    assert_eq!(
        (peer.as_str(), moved.fingerprint, moved.state, moved.reserve),
        ("peer:1", fingerprint, vec![f32s(2)], 64)
    );
    assert_eq!(moved.bytes[0].as_ref().as_ref(), &[1u8; 8]);
    let there = Handle { epoch: 9, id: 1 };
    let opened = Reply::message(SessionMessage::Opened { session: there });
    assert!(h.core.complete(to, opened.into(), &h.replier, h.now).is_none(), "the executor answers the move");
    let (Job::EndMove { session: s, moved }, _) = &h.jobs()[0] else { panic!("not the move's end") };
    assert_eq!((*s, moved.clone()), (session, Ok(("peer:1".to_owned(), there))));
    // What came meanwhile waits, a signal too, and is told where the session went.
    assert!(h.request(step(session), &[]).is_none());
    assert!(h.request(SessionMessage::Signal { session, signal: djinn_proto::Signal::Compute }, &[]).is_none());
    let went = Message::Session(SessionMessage::Moved { to: "peer:1".into(), session: there });
    assert_eq!(h.answer(Reply::message(went.clone())).map(|r| r.message), Some(went.clone()));
    assert_eq!(sent(&h).into_iter().map(|(_, m)| m).collect::<Vec<_>>(), [went.clone(), went.clone()]);
    assert_eq!(h.request(step(session), &[]).map(|r| r.message), Some(went), "and so is what comes later");
    assert!(h.jobs().is_empty());

    // Refused there: the executor is told why, for the client, and the session goes on.
    let session = open_session(&mut h, 5);
    let moves = |to: &str| SessionMessage::Move { session, to: to.into(), grant: "g".into() };
    assert!(h.request(moves("peer:2"), &[]).is_none());
    assert!(h.answer(session_open(fingerprint)).is_none());
    let (_, _, _, to) = h.pushes.1.lock().unwrap().pop().expect("the session sent to the peer");
    let refused = Reply::error(ErrorCode::Forbidden, "no grant");
    assert!(h.core.complete(to, refused.into(), &h.replier, h.now).is_none());
    let (Job::EndMove { moved, .. }, _) = &h.jobs()[0] else { panic!("not the move's end") };
    assert_eq!(moved.clone(), Err((ErrorCode::Forbidden, "no grant".to_owned())));
    assert!(h.request(step(session), &[]).is_none());
    assert_eq!(error_of(h.answer(Reply::error(ErrorCode::Forbidden, "no grant"))).0, ErrorCode::Forbidden);
    assert!(matches!(h.jobs(), [(Job::Step { .. }, _)]), "the step that waited goes");
    assert!(h.answer(stepped()).is_some());

    // The executor could not ready it: its refusal is the answer, and nothing reaches a peer.
    assert!(h.request(moves("peer:3"), &[]).is_none());
    let busy = h.answer(Reply::error(ErrorCode::Busy, "it is moving already"));
    assert_eq!(error_of(busy).0, ErrorCode::Busy);
    assert!(h.pushes.1.lock().unwrap().is_empty());
}

#[test]
fn a_request_numbered_as_one_still_under_way_is_refused_and_takes_nothing_over() {
    let mut h = harness(false);
    let session = open_session(&mut h, 3);
    let to = ReplyTo { slot: 0, conn_id: 1, request_id: 70, tenant: ALICE, operator: false, torchscript: false };
    let frame = |message: Message| Frame { request_id: 70, message, payload: None };
    let moving = SessionMessage::Move { session, to: "peer:1".into(), grant: "g".into() };
    assert!(h.core.handle(frame(moving.into()), to, &h.replier, h.now).is_none());
    let again = h.core.handle(frame(SessionMessage::List { after: 0 }.into()), to, &h.replier, h.now);
    assert_eq!(error_of(again).0, ErrorCode::Unexpected);
    assert_eq!(h.jobs().len(), 1, "the second request reached no executor");
    // The first still completes as a move, and once it is answered the number is free again.
    assert!(h.answer(session_open(Fingerprint::of_blocks(&[b"m"]))).is_none());
    assert_eq!(h.pushes.1.lock().unwrap().len(), 1);
    let on_another = ReplyTo { conn_id: 2, ..to };
    assert!(h.core.handle(frame(SessionMessage::List { after: 0 }.into()), on_another, &h.replier, h.now).is_none());
}

#[test]
fn an_operators_lists_name_every_tenant_and_a_tenants_name_none() {
    let tokens = tempfile::NamedTempFile::new().unwrap();
    let document = r#"{"principals": [{"name": "alice", "tokens": ["alice-secret-0001"]},
                                      {"name": "bob", "tokens": ["bob-secret-000001"]}]}"#;
    std::fs::write(tokens.path(), document).unwrap();
    let auth = djinn_auth::Authenticator::load(tokens.path()).unwrap();
    let (alice, bob) =
        (auth.verify("alice-secret-0001").unwrap().tenant, auth.verify("bob-secret-000001").unwrap().tenant);
    let mut h = harness_with(false, Some(auth));
    let ask = |h: &mut Harness, message: Message, operator: bool| {
        let request_id = h.next_request;
        h.next_request += 1;
        let to = ReplyTo { slot: 0, conn_id: 1, request_id, tenant: alice, operator, torchscript: false };
        assert!(h.core.handle(Frame { request_id, message, payload: None }, to, &h.replier, h.now).is_none());
    };
    ask(&mut h, ModelMessage::ListModels.into(), true);
    ask(&mut h, SessionMessage::List { after: 0 }.into(), true);
    ask(&mut h, ModelMessage::ListModels.into(), false);
    ask(&mut h, SessionMessage::List { after: 0 }.into(), false);
    let named = |names: &crate::TenantNames| (names.get(&alice).cloned(), names.get(&bob).cloned());
    let both = (Some("alice".to_owned()), Some("bob".to_owned()));
    match h.jobs() {
        [
            (Job::ListModels { all: Some(models) }, _),
            (Job::ListSessions { all: Some(sessions), after: 0 }, _),
            (Job::ListModels { all: None }, _),
            (Job::ListSessions { all: None, after: 0 }, _),
        ] => assert_eq!((named(models), named(sessions)), (both.clone(), both)),
        jobs => panic!("{jobs:?}"),
    }
}

#[test]
fn parked_requests_are_checked_by_the_core_before_the_executor_and_freed_when_they_lapse() {
    let mut h = harness(false);
    let fingerprint = Fingerprint::of_blocks(&[b"m"]);
    let until = Some(Breakpoint { block: 0, send_activation: false });
    let execute = ModelMessage::Execute { fingerprint, tensors: vec![], inputs: vec![], keep: false, until };
    let paused = |id| {
        let parked = Handle { epoch: EPOCH, id };
        (parked, Reply::message(BreakpointMessage::Paused { parked, block: 0, tensors: vec![], activation: None }))
    };
    let bob = |h: &mut Harness, message: BreakpointMessage| {
        let request_id = h.next_request;
        h.next_request += 1;
        let to = ReplyTo { slot: 0, conn_id: 2, request_id, tenant: TenantId(2), operator: false, torchscript: false };
        h.core.handle(Frame { request_id, message: message.into(), payload: None }, to, &h.replier, h.now)
    };
    let jobs = |h: &Harness| h.jobs().len();

    // An execution parks: its answer is recorded as the tenant's.
    assert!(h.request(execute.clone(), &[]).is_none());
    let (parked, answer) = paused(4);
    assert!(h.answer(answer).is_some());
    // Another tenant's inspection, resume or abort of it reaches no executor.
    for message in [
        BreakpointMessage::Inspect { parked },
        BreakpointMessage::Resume { parked, tensors: vec![], activation: None, until: None },
        BreakpointMessage::Abort { parked },
    ] {
        assert_eq!(error_of(bob(&mut h, message)).0, ErrorCode::NotFound);
    }
    assert_eq!(jobs(&h), 0);
    // The tenant's own inspection is answered by a `Paused` that parks nothing new.
    assert!(h.request(BreakpointMessage::Inspect { parked }, &[]).is_none());
    assert!(h.answer(paused(4).1).is_some());

    // A resume ends the handle at once: a second one, or an abort, is told so.
    let resume = BreakpointMessage::Resume { parked, tensors: vec![], activation: None, until: None };
    assert!(h.request(resume.clone(), &[]).is_none());
    let (code, message) = error_of(h.request(BreakpointMessage::Abort { parked }, &[]));
    assert!(code == ErrorCode::NotFound && message.contains("already resumed"), "{message}");
    // Refused by the executor and parked still: it may be resumed again.
    let (_, to) = h.core.executor.jobs.remove(0);
    let refused = Executed { reply: Reply::error(ErrorCode::BadBreakpoint, "no match"), still_parked: true };
    assert_eq!(error_of(h.core.complete(to, refused, &h.replier, h.now)).0, ErrorCode::BadBreakpoint);
    assert!(h.request(resume.clone(), &[]).is_none());
    assert!(matches!(h.jobs(), [(Job::Resume { .. }, _)]));
    assert!(
        h.answer(Reply::message(ModelMessage::ExecuteReply { tensors: vec![], output: Value::None, kept: vec![] }))
            .is_some()
    );
    assert_eq!(error_of(h.request(resume, &[])).0, ErrorCode::NotFound);

    // One left parked lapses a time limit later: the executor is told to free it.
    assert!(h.request(execute, &[]).is_none());
    let (lapsing, answer) = paused(5);
    assert!(h.answer(answer).is_some());
    let due = h.core.next_expiry().expect("a sweep due for what is parked");
    assert!(due <= h.now + TIMEOUT / 4, "swept four times per limit");
    h.core.expire(h.now + TIMEOUT / 2, &h.replier);
    assert!(h.core.executor.unparked.is_empty(), "not yet");
    h.core.expire(h.now + TIMEOUT + TIMEOUT / 4, &h.replier);
    assert_eq!(h.core.executor.unparked, vec![5]);
    let (_, message) = error_of(h.request(BreakpointMessage::Abort { parked: lapsing }, &[]));
    assert!(message.contains("released after its time limit"), "{message}");
}
