//! The connection core driven as a backend drives it, without sockets and with a clock of the
//! test's own: bytes handed to a connection's reader, replies taken from its send queue, time
//! moved on by `set_now` and `check_timeouts`.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use djinn_auth::{Authenticator, Origin, TenantId};
use djinn_proto::{
    DataMessage, ErrorCode, FrameReader, Hello, Limits, MAX_META_BEFORE_HELLO, Message, OutFrame, Payload,
    PayloadAlloc, RecvEvent, Refusal, transports,
};

use super::server::{Conn, Core, MIN_PROGRESS, ServerConfig};
use djinn_node_core::{Admission, Executed, LocalError, Replier, Reply, ReplyTo, Service};

/// Requests the service took and answers later, as a worker thread would.
type Taken = Arc<Mutex<Vec<(ReplyTo, Replier)>>>;

/// Answers `List` at once; takes every other request to answer later through the replier.
/// Tenants' request quotas, where given, are the core's own (`djinn_node_core::Admission`).
#[derive(Default)]
struct Answers {
    taken: Taken,
    disconnected: Vec<u64>,
    admission: Option<Admission>,
    /// Requests whose executed answers it completed; an answer of `Pong` goes on (`None`).
    completed: Vec<u64>,
    /// When it has something to expire next, and the times it was told to.
    expiry: Option<Instant>,
    expired: Vec<Instant>,
}

impl Service for Answers {
    fn alloc(&mut self, _message: &Message, len: usize, _tenant: TenantId) -> Result<Payload, Refusal> {
        Err(Refusal { code: ErrorCode::OverBudget, message: format!("{len} bytes: no payloads here") })
    }

    fn handle(&mut self, frame: djinn_proto::Frame, to: ReplyTo, replier: &Replier, _: Instant) -> Option<Reply> {
        match frame.message {
            Message::Data(DataMessage::List { .. }) => {
                Some(Reply::message(DataMessage::ListReply { entries: Vec::new(), more: false }))
            }
            _ => {
                self.taken.lock().unwrap().push((to, replier.clone()));
                None
            }
        }
    }

    fn stats(&mut self, counters: Vec<(String, u64)>, _: ReplyTo, _: &Replier) -> Option<Reply> {
        Some(Reply::message(DataMessage::StatsReply { counters }))
    }

    fn admit(&mut self, tenant: TenantId, now: Instant) -> Result<(), Refusal> {
        self.admission.as_mut().map_or(Ok(()), |a| a.admit(tenant, now))
    }

    fn started(&mut self, tenant: TenantId) {
        if let Some(a) = &mut self.admission {
            a.started(tenant);
        }
    }

    fn finished(&mut self, tenant: TenantId) {
        if let Some(a) = &mut self.admission {
            a.finished(tenant);
        }
    }

    fn on_disconnect(&mut self, connection: u64) {
        self.disconnected.push(connection);
    }

    fn complete(&mut self, to: ReplyTo, answer: Executed, _: &Replier, _: Instant) -> Option<Reply> {
        self.completed.push(to.request_id);
        (answer.reply.message != Message::Data(DataMessage::Pong)).then_some(answer.reply)
    }

    fn expire(&mut self, now: Instant, _: &Replier) {
        self.expired.push(now);
        self.expiry = None;
    }

    fn next_expiry(&self) -> Option<Instant> {
        self.expiry
    }
}

const ALICE: &str = "alice-secret-0001";

/// Principals: alice, at most one request at a time and two a second; bob, unbounded.
fn authenticator() -> Arc<Authenticator> {
    let doc = r#"{"principals": [
        {"name": "alice", "tokens": ["alice-secret-0001"],
         "quota": {"concurrent_requests": 1, "requests_per_second": 2, "burst": 2}},
        {"name": "bob", "tokens": ["bob-secret-000001"]}
    ]}"#;
    Authenticator::from_json(Origin::Elsewhere("the test".into()), doc.as_bytes()).unwrap()
}

/// A core and the clock it was told, with connections accepted in slots of the test's choosing.
struct Harness {
    core: Core<Answers>,
    taken: Taken,
    now: Instant,
    slots: usize,
}

impl Harness {
    fn new(config: ServerConfig) -> Self {
        let service = Answers { admission: config.auth.clone().map(Admission::new), ..Answers::default() };
        let taken = Arc::clone(&service.taken);
        let now = Instant::now();
        Self { core: Core::new(service, config, "test", Arc::new(|| {}), now), taken, now, slots: 0 }
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        self.core.set_now(self.now);
    }

    fn accept(&mut self) -> Conn {
        self.slots += 1;
        let peer: SocketAddr = "192.0.2.1:4000".parse().unwrap();
        self.core.on_accept(peer, self.slots)
    }

    /// Hands `bytes` to `conn` as reads would, while the core wants to read it, answering
    /// what is complete; returns how many it took.
    fn receive(&mut self, conn: &mut Conn, bytes: &[u8]) -> usize {
        let mut taken = 0;
        while taken < bytes.len() && self.core.wants_read(conn) {
            let target = conn.reader.read_target();
            let into = if target.payload.is_empty() { target.staging } else { target.payload };
            let n = into.len().min(bytes.len() - taken);
            into[..n].copy_from_slice(&bytes[taken..taken + n]);
            self.core.on_bytes_read(conn, n);
            taken += n;
            self.core.process(conn);
        }
        taken
    }

    fn request(&mut self, conn: &mut Conn, request_id: u64, message: &Message) {
        let bytes = encode(request_id, message);
        assert_eq!(self.receive(conn, &bytes), bytes.len(), "the core took the whole request");
    }

    /// Writes out what `conn` has queued, as a socket taking everything would; the replies.
    fn replies(&mut self, conn: &mut Conn) -> Vec<(u64, Message)> {
        let bytes: Vec<u8> = {
            let mut slices = [IoSlice::new(&[]); 64];
            let n = conn.queue.write_slices(&mut slices);
            slices[..n].iter().flat_map(|s| s.iter().copied()).collect()
        };
        self.core.on_bytes_written(conn, bytes.len());
        decode(&bytes)
    }
}

fn encode(request_id: u64, message: &Message) -> Vec<u8> {
    let frame = OutFrame::new(request_id, message, Vec::new()).unwrap();
    frame.slices().flatten().copied().collect()
}

struct NoPayloads;

impl PayloadAlloc for NoPayloads {
    fn alloc(&mut self, _message: &Message, _len: usize) -> Result<Payload, Refusal> {
        panic!("the node's replies here carry no payload")
    }
}

fn decode(bytes: &[u8]) -> Vec<(u64, Message)> {
    let mut reader = FrameReader::new(Limits::default());
    let mut out = Vec::new();
    let mut rest = bytes;
    loop {
        while let Some(event) = reader.next_event(&mut NoPayloads) {
            match event {
                RecvEvent::Frame(frame) => out.push((frame.request_id, frame.message)),
                other => panic!("the node sent something undecodable: {other:?}"),
            }
        }
        if rest.is_empty() {
            return out;
        }
        let target = reader.read_target();
        let n = target.staging.len().min(rest.len());
        target.staging[..n].copy_from_slice(&rest[..n]);
        reader.on_read(n);
        rest = &rest[n..];
    }
}

fn hello(token: &str) -> Message {
    Message::Data(DataMessage::Hello(Hello {
        token: token.into(),
        ..Hello::new(&Limits::default(), transports::TCP, "client")
    }))
}

fn list() -> Message {
    Message::Data(DataMessage::List { after: None, limit: 10 })
}

fn error_code(message: &Message) -> Option<ErrorCode> {
    match message {
        Message::Data(DataMessage::Error { code, .. }) => Some(*code),
        _ => None,
    }
}

#[test]
fn a_connection_is_served_after_a_good_hello_only_and_closed_after_a_bad_one() {
    let mut h = Harness::new(ServerConfig { auth: Some(authenticator()), ..ServerConfig::default() });
    let mut conn = h.accept();
    // Before a hello: pings are answered, anything else is refused.
    h.request(&mut conn, 1, &Message::Data(DataMessage::Ping));
    h.request(&mut conn, 2, &list());
    let replies = h.replies(&mut conn);
    assert!(matches!(replies[0], (1, Message::Data(DataMessage::Pong))));
    assert_eq!((replies[1].0, error_code(&replies[1].1)), (2, Some(ErrorCode::Unauthenticated)));
    // A good hello: served, as alice.
    h.request(&mut conn, 3, &hello(ALICE));
    h.request(&mut conn, 4, &list());
    let replies = h.replies(&mut conn);
    assert!(matches!(replies[0], (3, Message::Data(DataMessage::HelloAck(_)))));
    assert!(matches!(replies[1], (4, Message::Data(DataMessage::ListReply { .. }))));
    // A bad hello afterwards: refused, and the connection closes once that is sent.
    h.request(&mut conn, 5, &hello("not-a-token-at-all"));
    assert!(conn.closing && !h.core.wants_read(&conn));
    assert_eq!(error_code(&h.replies(&mut conn)[0].1), Some(ErrorCode::Unauthenticated));
    assert!(conn.is_done());
    assert_eq!(h.core.counters.auth_failures, 1);
    h.core.on_close(&conn);
    assert_eq!(h.core.service.disconnected.len(), 1);
}

#[test]
fn before_its_hello_a_connection_may_send_only_a_small_frame_head() {
    let mut h = Harness::new(ServerConfig { auth: Some(authenticator()), ..ServerConfig::default() });
    let big = hello(&"t".repeat(MAX_META_BEFORE_HELLO as usize));
    let mut conn = h.accept();
    // Refused at its header: the core reads no further.
    let bytes = encode(1, &big);
    assert!(h.receive(&mut conn, &bytes) < bytes.len());
    assert_eq!(error_code(&h.replies(&mut conn)[0].1), Some(ErrorCode::MetaTooLarge));
    assert!(conn.closing);
    // After a good hello the node's own limit holds: the same frame is read, and its token
    // judged (and refused).
    let mut conn = h.accept();
    h.request(&mut conn, 1, &hello(ALICE));
    h.request(&mut conn, 2, &big);
    let replies = h.replies(&mut conn);
    assert!(matches!(replies[0].1, Message::Data(DataMessage::HelloAck(_))), "{replies:?}");
    assert_eq!(error_code(&replies[1].1), Some(ErrorCode::Unauthenticated));
}

#[test]
fn a_connection_without_a_good_hello_in_time_is_closed() {
    let hello_timeout = Duration::from_secs(5);
    let mut h = Harness::new(ServerConfig { auth: Some(authenticator()), hello_timeout, ..ServerConfig::default() });
    let mut silent = h.accept();
    let mut greeted = h.accept();
    h.request(&mut greeted, 1, &hello(ALICE));
    h.advance(hello_timeout - Duration::from_millis(1));
    assert!(!h.core.check_timeouts(&mut silent, h.now));
    h.advance(Duration::from_millis(1));
    assert!(h.core.check_timeouts(&mut silent, h.now) && silent.is_dropped());
    assert!(!h.core.check_timeouts(&mut greeted, h.now));
    assert_eq!(h.core.counters.hello_timeouts, 1);
}

#[test]
fn a_tenants_request_quotas_hold_with_the_time_passed_in() {
    let mut h = Harness::new(ServerConfig { auth: Some(authenticator()), ..ServerConfig::default() });
    let mut conn = h.accept();
    h.request(&mut conn, 1, &hello(ALICE));
    h.replies(&mut conn);
    // One request at a time: the second is refused while the first is worked on.
    h.request(&mut conn, 2, &Message::Data(DataMessage::Get { name: "a".into() }));
    h.request(&mut conn, 3, &Message::Data(DataMessage::Get { name: "b".into() }));
    assert_eq!(error_code(&h.replies(&mut conn)[0].1), Some(ErrorCode::QuotaExceeded));
    let (to, replier) = h.taken.lock().unwrap().pop().unwrap();
    replier.send(to, Reply::message(DataMessage::DeleteAck));
    let (slot, to, reply) = h.core.next_deferred().unwrap();
    assert_eq!(slot, 1);
    h.core.deliver(&mut conn, to, reply);
    assert!(matches!(h.replies(&mut conn)[..], [(2, Message::Data(DataMessage::DeleteAck))]));
    // Two a second, in a burst of two: request 2 took one (3, refused, took none), 4 takes the
    // other; then none is left until half a second has passed on the core's clock (a token
    // and a little: the bucket counts in floating point).
    h.request(&mut conn, 4, &list());
    assert!(matches!(h.replies(&mut conn)[..], [(4, Message::Data(DataMessage::ListReply { .. }))]));
    h.request(&mut conn, 5, &list());
    assert_eq!(error_code(&h.replies(&mut conn)[0].1), Some(ErrorCode::QuotaExceeded));
    h.advance(Duration::from_millis(499));
    h.request(&mut conn, 6, &list());
    assert_eq!(error_code(&h.replies(&mut conn)[0].1), Some(ErrorCode::QuotaExceeded));
    h.advance(Duration::from_millis(2));
    h.request(&mut conn, 7, &list());
    assert!(matches!(h.replies(&mut conn)[..], [(7, Message::Data(DataMessage::ListReply { .. }))]));
    assert_eq!(h.core.counters.quota_refusals, 3);
}

#[test]
fn a_connection_with_replies_over_its_bounds_is_not_read_until_they_drain() {
    let config = ServerConfig { max_queued_frames: 4, ..ServerConfig::default() };
    let mut h = Harness::new(config);
    let mut conn = h.accept();
    let requests: Vec<u8> = (1..=10).flat_map(|id| encode(id, &list())).collect();
    // All ten arrive in one read; four are answered, the rest wait in the reader.
    let took = h.receive(&mut conn, &requests);
    assert_eq!(took, requests.len());
    assert_eq!(conn.queue.queued_frames(), 4);
    assert!(!h.core.wants_read(&conn));
    assert_eq!(h.replies(&mut conn).len(), 4);
    h.core.process(&mut conn);
    assert_eq!(h.replies(&mut conn).len(), 4);
    h.core.process(&mut conn);
    let last = h.replies(&mut conn);
    assert_eq!(last.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [9, 10]);
    assert!(h.core.wants_read(&conn));
}

#[test]
fn replies_over_the_global_bound_pause_only_connections_with_replies_waiting() {
    let reply_len = encode(1, &Message::Data(DataMessage::ListReply { entries: Vec::new(), more: false })).len() as u64;
    let config = ServerConfig { max_queued_total: 3 * reply_len, ..ServerConfig::default() };
    let mut h = Harness::new(config);
    let (mut a, mut b, mut c) = (h.accept(), h.accept(), h.accept());
    h.request(&mut a, 1, &list());
    h.request(&mut a, 2, &list());
    h.request(&mut b, 1, &list());
    assert!(h.core.reads_paused());
    assert!(!h.core.wants_read(&a) && !h.core.wants_read(&b));
    // A client that reads its replies is still served.
    assert!(h.core.wants_read(&c));
    h.request(&mut c, 1, &list());
    assert_eq!(h.replies(&mut c).len(), 1);
    assert_eq!(h.replies(&mut a).len(), 2);
    assert!(!h.core.reads_paused() && h.core.wants_read(&b));
}

#[test]
fn a_connection_trickling_a_frame_or_not_reading_its_replies_is_closed_as_stalled() {
    let stall_timeout = Duration::from_secs(10);
    let mut h = Harness::new(ServerConfig { stall_timeout, ..ServerConfig::default() });
    // Half a frame head, then nothing.
    let mut trickling = h.accept();
    h.receive(&mut trickling, &encode(1, &list())[..8]);
    // Replies queued that the peer does not read.
    let mut deaf = h.accept();
    h.request(&mut deaf, 1, &list());
    // Between frames, nothing owed: idle, not stalled.
    let mut quiet = h.accept();
    h.request(&mut quiet, 1, &list());
    h.replies(&mut quiet);
    // A frame in progress that moves enough each window.
    let mut steady = h.accept();
    h.advance(stall_timeout - Duration::from_millis(1));
    for conn in [&mut trickling, &mut deaf, &mut quiet, &mut steady] {
        assert!(!h.core.check_timeouts(conn, h.now), "not before the window ends");
    }
    let big = encode(2, &Message::Data(DataMessage::Get { name: "y".repeat(MIN_PROGRESS as usize) }));
    h.receive(&mut steady, &big[..MIN_PROGRESS as usize]);
    h.advance(Duration::from_millis(1));
    assert!(h.core.check_timeouts(&mut trickling, h.now) && trickling.is_dropped());
    assert!(h.core.check_timeouts(&mut deaf, h.now) && deaf.is_dropped());
    assert!(!h.core.check_timeouts(&mut quiet, h.now));
    assert!(!h.core.check_timeouts(&mut steady, h.now));
    assert_eq!(h.core.counters.stalled_connections, 2);
    // The next window: the steady one went quiet in the middle of its frame.
    h.advance(stall_timeout);
    assert!(h.core.check_timeouts(&mut steady, h.now));
    assert_eq!(h.core.counters.stalled_connections, 3);
}

#[test]
fn a_deferred_reply_reaches_its_connection_and_never_the_next_one_in_its_slot() {
    let mut h = Harness::new(ServerConfig::default());
    let mut conn = h.accept();
    h.request(&mut conn, 7, &Message::Data(DataMessage::Get { name: "a".into() }));
    assert!(h.core.awaiting_replies());
    // The peer half-closes: the connection stays until the reply is sent.
    h.core.on_eof(&mut conn);
    assert!(!conn.is_done());
    let (to, replier) = h.taken.lock().unwrap().pop().unwrap();
    assert_eq!(to.request_id, 7);
    replier.send(to, Reply::message(DataMessage::DeleteAck));
    let (_, to, reply) = h.core.next_deferred().unwrap();
    h.core.deliver(&mut conn, to, reply);
    assert!(matches!(h.replies(&mut conn)[..], [(7, Message::Data(DataMessage::DeleteAck))]));
    assert!(conn.is_done() && !h.core.awaiting_replies());
    h.core.on_close(&conn);

    // A reply for a connection that closed is dropped, not given to its slot's next tenant.
    let mut first = h.accept();
    h.request(&mut first, 1, &Message::Data(DataMessage::Get { name: "b".into() }));
    h.core.on_close(&first);
    h.slots -= 1;
    let mut second = h.accept();
    let (to, replier) = h.taken.lock().unwrap().pop().unwrap();
    replier.send(to, Reply::message(DataMessage::DeleteAck));
    let (slot, to, reply) = h.core.next_deferred().unwrap();
    assert_eq!(slot, h.slots, "the same slot");
    h.core.deliver(&mut second, to, reply);
    assert!(second.queue.is_empty());
}

#[test]
fn the_loop_polls_on_while_work_is_recent_checks_deadlines_on_schedule_and_resumes_paused_reads() {
    let reply_len = encode(1, &Message::Data(DataMessage::ListReply { entries: Vec::new(), more: false })).len() as u64;
    let spin = Duration::from_micros(50);
    let stall_timeout = Duration::from_secs(4);
    let config = ServerConfig { spin, stall_timeout, max_queued_total: reply_len, ..ServerConfig::default() };
    let mut h = Harness::new(config);
    let every = stall_timeout / 4;
    let start = h.now;
    // Deadlines: checked on the first turn, then once per quarter of the shortest timeout.
    assert!(h.core.begin_turn(start).check_deadlines);
    assert!(!h.core.begin_turn(start + every - Duration::from_millis(1)).check_deadlines);
    assert!(h.core.begin_turn(start + every).check_deadlines);
    assert_eq!(h.core.next_deadline_check(), start + 2 * every);
    // Spinning: on for `spin` after the last work, then off; a reply owed keeps it on.
    let t = start + every;
    h.core.worked();
    assert!(h.core.keep_polling(t + spin - Duration::from_micros(1)));
    assert!(!h.core.keep_polling(t + spin));
    let mut conn = h.accept();
    h.request(&mut conn, 1, &Message::Data(DataMessage::Get { name: "a".into() }));
    assert!(h.core.keep_polling(t + Duration::from_secs(1)));
    // Reads paused by the global bound are resumed on the first turn after the replies drain.
    let mut other = h.accept();
    h.request(&mut other, 1, &list());
    assert!(h.core.reads_paused());
    assert!(!h.core.begin_turn(t).resume_reads);
    h.replies(&mut other);
    assert_eq!(h.core.begin_turn(t), super::server::Turn { resume_reads: true, check_deadlines: false });
    assert!(!h.core.begin_turn(t).resume_reads, "once");
}

/// Runs `ask` on a thread of its own (it waits for its answer as the node's membership agent
/// would), turning the core until the request is in; the request's answer.
fn ask_in_process<T: Send + 'static>(
    h: &mut Harness,
    ask: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let asking = std::thread::spawn(ask);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !h.core.serve_local() {
        assert!(Instant::now() < deadline, "the request never reached the poller");
        std::thread::yield_now();
    }
    asking
}

#[test]
fn the_nodes_own_requests_are_served_in_process_as_the_node_or_as_a_tenant() {
    let mut h = Harness::new(ServerConfig { auth: Some(authenticator()), ..ServerConfig::default() });
    let local = h.core.local_node();
    let wait = Duration::from_secs(10);
    // As the node itself: the data plane's own kinds, answered now.
    let node = local.clone();
    let stats = ask_in_process(&mut h, move || node.request("", DataMessage::Stats, wait)).join().unwrap().unwrap();
    assert!(matches!(stats.message, Message::Data(DataMessage::StatsReply { .. })));
    // As alice, by name: the service sees her request, answers it later, and the answer goes
    // straight back to the asker, not to any connection.
    let node = local.clone();
    let asking = ask_in_process(&mut h, move || node.request("alice", DataMessage::Get { name: "a".into() }, wait));
    let (to, replier) = h.taken.lock().unwrap().pop().unwrap();
    assert!(!to.operator, "acting for a tenant, the node sees what the tenant sees");
    assert_ne!(to.tenant, TenantId::DEFAULT);
    // Alice's connections hold one request at a time; the node's own requests for her are not
    // hers to count.
    let node = local.clone();
    let second = ask_in_process(&mut h, move || node.request("alice", list(), wait)).join().unwrap();
    assert!(second.is_ok(), "{second:?}");
    assert!(h.core.awaiting_replies());
    replier.send(to, Reply::message(DataMessage::DeleteAck));
    assert!(h.core.next_deferred().is_none(), "no connection gets it");
    assert!(!h.core.awaiting_replies());
    assert!(matches!(asking.join().unwrap().unwrap().message, Message::Data(DataMessage::DeleteAck)));
    // An unknown tenant is refused, typed.
    let node = local.clone();
    let refused = ask_in_process(&mut h, move || node.request("mallory", list(), wait)).join().unwrap();
    assert!(matches!(refused, Err(LocalError::Refused { code: ErrorCode::Unauthenticated, .. })), "{refused:?}");
    assert_eq!(h.core.counters.frames_in, 0, "nothing went through a connection");
    drop(h);
    assert!(matches!(local.request("", list(), wait), Err(LocalError::Stopped)), "a stopped poller answers nothing");
}

#[test]
fn an_executed_answer_is_completed_by_the_service_and_may_go_on() {
    let mut h = Harness::new(ServerConfig::default());
    let mut conn = h.accept();
    h.request(&mut conn, 3, &Message::Data(DataMessage::Get { name: "a".into() }));
    let (to, replier) = h.taken.lock().unwrap().pop().unwrap();
    // The service says the request goes on: still in flight, nothing delivered.
    replier.executed(to, Reply::message(DataMessage::Pong));
    assert!(h.core.next_deferred().is_none());
    assert!(h.core.awaiting_replies(), "the request is still in flight");
    replier.executed(to, Reply::message(DataMessage::DeleteAck));
    let (_, to, reply) = h.core.next_deferred().unwrap();
    assert_eq!(h.core.service.completed, [3, 3]);
    h.core.deliver(&mut conn, to, reply);
    assert!(matches!(h.replies(&mut conn)[..], [(3, Message::Data(DataMessage::DeleteAck))]));
    assert!(!h.core.awaiting_replies());
}

#[test]
fn the_services_expiry_runs_when_due_connections_or_not() {
    let mut h = Harness::new(ServerConfig::default());
    let due = h.now + Duration::from_millis(30);
    h.core.service.expiry = Some(due);
    assert_eq!(h.core.next_expiry(), Some(due), "a blocking wait ends then");
    h.core.begin_turn(due - Duration::from_millis(1));
    assert!(h.core.service.expired.is_empty(), "not yet");
    h.core.begin_turn(due);
    assert_eq!(h.core.service.expired, [due]);
    assert_eq!(h.core.next_expiry(), None);
}
