//! The conformance suite through a child process: the core's executor double served over the
//! link by a child started by exec (this test binary again, running the ignored
//! `child_serves_the_executor_double`) gets the same replies as in process; and when a child
//! dies (a fault in a kernel, a kill from outside), what it held is answered `ExecutorLost`,
//! typed, and the test process (the node) goes on.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use djinn_auth::TenantId;
use djinn_memory::{HostBuf, MemoryBudget};
use djinn_node_core::conformance::{self, FakeExecutor};
use djinn_node_core::{Answer, CallInputs, Executor, Job, Replier, ReplyTo, Upload};
use djinn_proto::{
    DType, DataMessage, ErrorCode, Fingerprint, Handle, KeptMessage, Message, ModelMessage, Payload, TensorDesc, Value,
};
use djinn_supervisor::{LINK_FD, Launch, LinkSizes, ProcessExecutor, Supervision, TenantExecutors};

const SIZES: LinkSizes = LinkSizes { messages: 1 << 20, bulk: 16 << 20 };
const SUPERVISION: Supervision = Supervision {
    ready_within: Duration::from_secs(60),
    run_deadline: None,
    grace: Supervision::GRACE,
    memory_limit: None,
};
const NEVER_ANSWERS_EPOCH: u64 = 7;

/// This test binary again, running the child test `name`.
fn child(name: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command.args(["--exact", name, "--include-ignored", "--nocapture"]).env("DJINN_SUPERVISOR_TEST_CHILD", "1");
    command
}

fn executor() -> (ProcessExecutor, MemoryBudget) {
    let child = child("child_serves_the_executor_double");
    // The double's handles are of epoch 1.
    (
        ProcessExecutor::start(child, SIZES, 1, SUPERVISION, Vec::new()).expect("the child starts"),
        MemoryBudget::new(1 << 20),
    )
}

#[test]
fn the_conformance_suite_passes_through_an_executor_process() {
    conformance::run(executor, b"any archive: the double runs every model as the identity");
}

/// Request `request_id` of the default tenant, on connection 1.
fn default_request(request_id: u64) -> ReplyTo {
    ReplyTo { slot: 0, conn_id: 1, request_id, tenant: TenantId::DEFAULT, operator: false, torchscript: false }
}

/// How an executor process ends in the tests below.
enum Ending {
    /// A kernel faults: the child writes through a bad pointer when it gets an `Unregister`.
    Fault,
    /// Killed from outside, as the kernel's OOM killer or an operator kills it.
    Kill,
}

/// Three requests held by a child that answers none, then the child ends: each is answered
/// `ExecutorLost` (naming how it ended) once, and so is a request after.
fn requests_held_when_the_child_ends_are_answered_executor_lost(ending: Ending, cause: &[&str]) {
    let child = child("child_serves_an_executor_that_never_answers");
    let mut executor =
        ProcessExecutor::start(child, SIZES, NEVER_ANSWERS_EPOCH, SUPERVISION, Vec::new()).expect("the child starts");
    let (replier, replies) = Replier::new(Arc::new(|| {}));

    for request in 1..=3 {
        executor.run(Job::Stats, default_request(request), &replier);
    }
    assert!(replies.recv_timeout(Duration::from_millis(200)).is_err(), "the child answers nothing");
    let mut held = vec![1, 2, 3];
    match ending {
        Ending::Fault => {
            executor.run(
                Job::Unregister { fingerprint: Fingerprint::of_blocks(&[b"any"]) },
                default_request(4),
                &replier,
            );
            held.push(4);
        }
        Ending::Kill => {
            // The link thread starts the child; it has by the time it holds a request.
            let until = std::time::Instant::now() + Duration::from_secs(30);
            let pid = loop {
                match executor.pid() {
                    Some(pid) => break pid,
                    None if std::time::Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                    None => panic!("the child was not started within 30 s"),
                }
            };
            kill(pid);
        }
    }
    let mut answered = Vec::new();
    for _ in &held {
        let (to, answer) = replies.recv_timeout(Duration::from_secs(30)).expect("an answer after the child ended");
        answered.push(to.request_id);
        assert_lost(answer, cause);
    }
    answered.sort_unstable();
    assert_eq!(answered, held, "each request the child held, once");
    assert!(replies.recv_timeout(Duration::from_millis(100)).is_err(), "nothing answered twice");
    assert!(executor.lost().is_some());
    executor.run(Job::Stats, default_request(9), &replier);
    let (later, answer) = replies.recv_timeout(Duration::from_secs(30)).expect("an answer");
    assert_eq!(later.request_id, 9);
    assert_lost(answer, cause);
}

fn assert_lost(answer: Answer, cause: &[&str]) {
    let Answer::Executed(executed) = answer else { panic!("not the executor's answer") };
    match executed.reply.message {
        Message::Data(DataMessage::Error { code: ErrorCode::ExecutorLost, message }) => {
            assert!(cause.iter().any(|c| message.contains(c)), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn requests_held_by_an_executor_process_whose_kernel_faults_are_answered_executor_lost() {
    requests_held_when_the_child_ends_are_answered_executor_lost(Ending::Fault, &["SIGSEGV", "signal: 11"]);
}

#[test]
fn requests_held_by_an_executor_process_killed_from_outside_are_answered_executor_lost() {
    requests_held_when_the_child_ends_are_answered_executor_lost(Ending::Kill, &["SIGKILL", "signal: 9"]);
}

/// A child that holds a run past the node's limit on one execution and its grace without a
/// word (an operator that runs on, or an executor that ignores the limit) is killed: the run is
/// answered `DeadlineExceeded`, another request it held `ExecutorLost`. While it holds a job
/// the limit does not bound (a load, here the stats), nothing is killed.
#[test]
fn an_executor_process_whose_run_goes_past_the_deadline_and_grace_is_killed() {
    let supervision = Supervision {
        run_deadline: Some(Duration::from_millis(300)),
        grace: Duration::from_millis(200),
        ..SUPERVISION
    };
    let (replier, replies) = Replier::new(Arc::new(|| {}));

    let start = || {
        let child = child("child_serves_an_executor_that_never_answers");
        ProcessExecutor::start(child, SIZES, NEVER_ANSWERS_EPOCH, supervision, Vec::new()).expect("the child starts")
    };

    let mut unbounded = start();
    unbounded.run(Job::Stats, default_request(1), &replier);
    unbounded.run(identity_call(Fingerprint::of_blocks(&[b"any"])), default_request(2), &replier);
    // Ten times the limit and its grace.
    assert!(replies.recv_timeout(Duration::from_secs(5)).is_err(), "nothing answered");
    assert!(unbounded.lost().is_none(), "a process holding a job the limit does not bound is not killed");
    drop(unbounded);
    while replies.recv_timeout(Duration::from_millis(500)).is_ok() {}

    let mut runs = start();
    runs.run(identity_call(Fingerprint::of_blocks(&[b"any"])), default_request(3), &replier);
    runs.run(identity_call(Fingerprint::of_blocks(&[b"other"])), default_request(4), &replier);
    let mut answers: Vec<(u64, Message)> = (0..2)
        .map(|_| {
            let (to, answer) = replies.recv_timeout(Duration::from_secs(30)).expect("killed, and answered");
            let Answer::Executed(executed) = answer else { panic!("not the executor's answer") };
            (to.request_id, executed.reply.message)
        })
        .collect();
    answers.sort_by_key(|(request, _)| *request);
    match &answers[..] {
        [
            (3, Message::Data(DataMessage::Error { code: ErrorCode::DeadlineExceeded, message: past })),
            (4, Message::Data(DataMessage::Error { code: ErrorCode::ExecutorLost, message: lost })),
        ] => {
            assert!(past.contains("limit of 300ms") && past.contains("killed"), "{past}");
            assert!(lost.contains("killed: a run answered nothing"), "{lost}");
        }
        other => panic!("{other:?}"),
    }
    assert!(runs.lost().is_some_and(|why| why.contains("past the node's limit")), "{:?}", runs.lost());
}

/// A child that holds more memory resident than the node's limit on an executor process is
/// killed, and what it held answered `ExecutorLost` naming its memory; the node's own memory
/// does not grow by what the child took.
#[test]
fn an_executor_process_past_its_memory_limit_is_killed() {
    let supervision = Supervision { memory_limit: Some(128 << 20), ..SUPERVISION };
    let child = child("child_serves_an_executor_that_never_answers");
    let mut executor =
        ProcessExecutor::start(child, SIZES, NEVER_ANSWERS_EPOCH, supervision, Vec::new()).expect("the child starts");
    let (replier, replies) = Replier::new(Arc::new(|| {}));
    let to = default_request(1);
    executor.run(Job::Stats, to, &replier);
    assert!(replies.recv_timeout(Duration::from_millis(500)).is_err(), "held, within its memory");
    assert!(executor.lost().is_none());
    let node_before = resident_kib();
    executor.run(
        Job::Fetch { handle: Handle { id: 1, epoch: NEVER_ANSWERS_EPOCH } },
        ReplyTo { request_id: 2, ..to },
        &replier,
    );
    let mut answered = Vec::new();
    for _ in 0..2 {
        let (to, answer) = replies.recv_timeout(Duration::from_secs(30)).expect("killed, and answered");
        answered.push(to.request_id);
        assert_lost(answer, &["resident, past the node's limit of 134217728"]);
    }
    answered.sort_unstable();
    assert_eq!(answered, [1, 2]);
    assert!(resident_kib() < node_before + (64 << 10), "the node's memory grew by what its child took");
}

/// This process's resident memory, in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// What an ended process held went with it: after its tenant's process is killed, a fetch of a
/// tensor it kept is answered `ExecutorLost` saying so (not the new process's "not found"),
/// while the new process keeps and fetches anew and answers for its own ids.
#[test]
fn what_an_ended_process_held_is_answered_executor_lost() {
    let launch: Launch = Box::new(|_, _, first_id| {
        let mut double = child("child_serves_the_executor_double");
        double.env("DJINN_TEST_FIRST_ID", first_id.to_string());
        double
    });
    let mut router = TenantExecutors::new(launch, SIZES, SUPERVISION, 1, MemoryBudget::new(1 << 20)).unwrap();
    let alice = TenantId(1);
    let keep = || Job::Keep {
        tensor: TensorDesc::new(DType::U8, vec![4]).unwrap(),
        payload: Some(Payload { buf: HostBuf::copy_from(&[1, 2, 3, 4]).unwrap(), reservation: None }),
    };
    let kept = |message: Message| match message {
        Message::Kept(KeptMessage::Kept { kept }) => kept.handle,
        other => panic!("{other:?}"),
    };
    let code = |message: Message| match message {
        Message::Data(DataMessage::Error { code, message }) => (Some(code), message),
        other => (None, format!("{other:?}")),
    };
    let before = kept(ask(&mut router, keep(), alice, 1));
    assert_eq!(code(ask(&mut router, Job::Fetch { handle: before }, alice, 2)).0, None, "fetched");
    kill(wait_for_pid(&router, alice));
    let (lost, why) = code(ask(&mut router, Job::Fetch { handle: before }, alice, 3));
    assert_eq!(lost, Some(ErrorCode::ExecutorLost), "{why}");
    // The router starts her next process with her next request.
    let after = (4..).find_map(|request| match ask(&mut router, keep(), alice, request) {
        Message::Data(DataMessage::Error { code: ErrorCode::ExecutorLost, .. }) => None,
        message => Some(kept(message)),
    });
    let after = after.expect("kept by her new process");
    assert_eq!(code(ask(&mut router, Job::Fetch { handle: after }, alice, 100)).0, None, "fetched");
    let (lost, why) = code(ask(&mut router, Job::Fetch { handle: before }, alice, 101));
    assert_eq!(lost, Some(ErrorCode::ExecutorLost), "{why}");
    assert!(why.contains("went with it"), "{why}");
    let never = Handle { id: after.id + 1000, ..after };
    assert_eq!(
        code(ask(&mut router, Job::Fetch { handle: never }, alice, 102)).0,
        Some(ErrorCode::NotFound),
        "its own"
    );
}

/// The answer to `job`, run by `executor` for `tenant`.
fn ask(executor: &mut impl Executor, job: Job, tenant: TenantId, request_id: u64) -> Message {
    let (replier, replies) = Replier::new(Arc::new(|| {}));
    let to = ReplyTo { slot: 0, conn_id: 1, request_id, tenant, operator: false, torchscript: false };
    executor.run(job, to, &replier);
    let (_, answer) = replies.recv_timeout(Duration::from_secs(60)).expect("an answer");
    match answer {
        Answer::Executed(executed) => executed.reply.message,
        Answer::Reply(reply) => reply.message,
    }
}

fn identity_call(fingerprint: Fingerprint) -> Job {
    let tensor = TensorDesc::new(DType::U8, vec![4]).unwrap();
    let payload = Payload { buf: HostBuf::copy_from(&[1, 2, 3, 4]).unwrap(), reservation: None };
    let inputs = CallInputs { values: vec![Value::Tensor(0)], tensors: vec![tensor], payload: Some(payload) };
    Job::Execute { fingerprint, inputs, keep: false, until: None }
}

fn kill(pid: u32) {
    assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
}

/// Calls until the tenant's new process answers (each answer before it `ExecutorLost`, from
/// the process that was killed): what it answers.
fn first_answer_after_a_kill(router: &mut TenantExecutors, tenant: TenantId, fingerprint: Fingerprint) -> Message {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for request in 100.. {
        assert!(std::time::Instant::now() < deadline, "no new process answered");
        match ask(router, identity_call(fingerprint), tenant, request) {
            Message::Data(DataMessage::Error { code: ErrorCode::ExecutorLost, .. }) => continue,
            other => return other,
        }
    }
    unreachable!()
}

#[test]
fn a_tenants_new_process_has_its_models_until_it_unregisters_them() {
    let launch: Launch = Box::new(|_, _, _| child("child_serves_the_executor_double"));
    // The double's handles are of epoch 1.
    let mut router = TenantExecutors::new(launch, SIZES, SUPERVISION, 1, MemoryBudget::new(1 << 20)).unwrap();
    let (alice, bob) = (TenantId(1), TenantId(2));
    let archive = b"alice's model".to_vec();
    let fingerprint = Fingerprint::of_blocks(&[&archive]);
    let mut upload = Upload::new(fingerprint, vec![archive.len() as u64], (alice, false), 1).unwrap();
    upload.archives.add(0, Payload { buf: HostBuf::copy_from(&archive).unwrap(), reservation: None }).unwrap();
    assert!(matches!(
        ask(&mut router, Job::Load { upload }, alice, 1),
        Message::Model(ModelMessage::Registered { .. })
    ));
    assert!(matches!(
        ask(&mut router, identity_call(fingerprint), alice, 2),
        Message::Model(ModelMessage::ExecuteReply { .. })
    ));
    assert!(
        matches!(
            ask(&mut router, identity_call(fingerprint), bob, 3),
            Message::Data(DataMessage::Error { code: ErrorCode::UnknownModel, .. })
        ),
        "bob's process is his own"
    );
    let (alices, bobs) = (wait_for_pid(&router, alice), wait_for_pid(&router, bob));
    assert_ne!(alices, bobs);

    // The node's counters, asked twice at once: each gathered from both processes, which
    // hold the router's own requests under distinct ids.
    let (replier, replies) = Replier::new(Arc::new(|| {}));
    for request in [10, 11] {
        let to = ReplyTo { slot: 0, conn_id: 2, request_id: request, tenant: bob, operator: true, torchscript: false };
        router.run(Job::Stats, to, &replier);
    }
    for _ in 0..2 {
        let (_, answer) = replies.recv_timeout(Duration::from_secs(60)).expect("the counters");
        let Answer::Executed(executed) = answer else { panic!("not the executor's answer") };
        let Message::Data(DataMessage::StatsReply { counters }) = executed.reply.message else {
            panic!("not counters")
        };
        assert!(counters.contains(&("executor_processes".to_owned(), 2)), "{counters:?}");
    }
    assert_eq!((router.pid_of(alice), router.pid_of(bob)), (Some(alices), Some(bobs)), "both live on");

    kill(alices);
    let answer = first_answer_after_a_kill(&mut router, alice, fingerprint);
    assert!(matches!(answer, Message::Model(ModelMessage::ExecuteReply { .. })), "loaded again: {answer:?}");
    assert_ne!(router.pid_of(alice), Some(alices));
    assert_eq!(router.pid_of(bob), Some(bobs), "bob's process lives on");

    // Unregistered, the model is not loaded in her next process.
    let gone = ask(&mut router, Job::Unregister { fingerprint }, alice, 4);
    assert!(matches!(gone, Message::Model(ModelMessage::UnregisterAck)), "{gone:?}");
    kill(wait_for_pid(&router, alice));
    let answer = first_answer_after_a_kill(&mut router, alice, fingerprint);
    assert!(matches!(answer, Message::Data(DataMessage::Error { code: ErrorCode::UnknownModel, .. })), "{answer:?}");
}

fn load(router: &mut TenantExecutors, archive: &[u8], tenant: TenantId, request_id: u64) -> Message {
    let fingerprint = Fingerprint::of_blocks(&[archive]);
    let mut upload = Upload::new(fingerprint, vec![archive.len() as u64], (tenant, false), 1).unwrap();
    upload.archives.add(0, Payload { buf: HostBuf::copy_from(archive).unwrap(), reservation: None }).unwrap();
    ask(router, Job::Load { upload }, tenant, request_id)
}

#[test]
fn the_copies_of_a_tenants_archives_are_charged_to_it_until_it_unregisters_them() {
    let launch: Launch = Box::new(|_, _, _| child("child_serves_the_executor_double"));
    let alice = TenantId(1);
    let host = MemoryBudget::with_quotas(1 << 20, Arc::new(move |tenant| (tenant == alice).then_some(20)));
    let mut router = TenantExecutors::new(launch, SIZES, SUPERVISION, 1, host.clone()).unwrap();
    let (first, second) = (b"alice's model".as_slice(), b"another model".as_slice());
    assert!(matches!(load(&mut router, first, alice, 1), Message::Model(ModelMessage::Registered { .. })));
    assert_eq!(host.used_by(alice), first.len() as u64);
    let refused = load(&mut router, second, alice, 2);
    assert!(
        matches!(&refused, Message::Data(DataMessage::Error { code: ErrorCode::QuotaExceeded, message })
            if message.contains("copy of each model's archives")),
        "{refused:?}"
    );
    let fingerprint = Fingerprint::of_blocks(&[first]);
    assert!(matches!(ask(&mut router, Job::Unregister { fingerprint }, alice, 3), Message::Model(_)));
    assert_eq!(host.used_by(alice), 0, "released with the model");
    assert!(matches!(load(&mut router, second, alice, 4), Message::Model(ModelMessage::Registered { .. })));
    assert_eq!((host.used_by(alice), host.used()), (second.len() as u64, second.len() as u64));
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .flatten()
        .filter(|task| std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .count()
}

/// A router whose every process takes jobs, answers none, and faults on an `Unregister`.
fn never_answering_router() -> TenantExecutors {
    let launch: Launch = Box::new(|_, _, _| child("child_serves_an_executor_that_never_answers"));
    TenantExecutors::new(launch, SIZES, SUPERVISION, NEVER_ANSWERS_EPOCH, MemoryBudget::new(1 << 20)).unwrap()
}

#[test]
fn many_gatherings_waiting_on_a_process_hold_one_thread_and_are_each_answered_when_it_ends() {
    let mut router = never_answering_router();
    let tenant = TenantId(1);
    let (replier, replies) = Replier::new(Arc::new(|| {}));
    let to = |request_id| ReplyTo { slot: 0, conn_id: 1, request_id, tenant, operator: true, torchscript: false };
    // Her process starts, and holds this for ever.
    router.run(identity_call(Fingerprint::of_blocks(&[b"any"])), ReplyTo { operator: false, ..to(0) }, &replier);
    let pid = wait_for_pid(&router, tenant);
    for request in 1..=200 {
        router.run(Job::Stats, to(request), &replier);
    }
    assert!(replies.recv_timeout(Duration::from_millis(200)).is_err(), "none answered while the process lives");
    // One gathering thread per router (other tests' routers may be alive meanwhile).
    assert!(threads_named("executor-gather") < 8, "{} gathering threads", threads_named("executor-gather"));
    kill(pid);
    let mut answered = Vec::new();
    for _ in 0..=200 {
        let (to, answer) = replies.recv_timeout(Duration::from_secs(30)).expect("an answer after the process ended");
        answered.push(to.request_id);
        let Answer::Executed(executed) = answer else { panic!("not the executor's answer") };
        if to.request_id == 0 {
            continue;
        }
        // Its answer (ExecutorLost) is no counters; the router's own count it.
        let Message::Data(DataMessage::StatsReply { counters }) = executed.reply.message else {
            panic!("not counters")
        };
        assert!(counters.contains(&("executor_processes".to_owned(), 1)), "{counters:?}");
    }
    answered.sort_unstable();
    assert_eq!(answered, (0..=200).collect::<Vec<_>>(), "each once");
}

#[test]
fn a_tenant_whose_processes_keep_crashing_waits_longer_for_each_next_one() {
    use djinn_supervisor::restarts::FREE_RESTARTS;
    let mut router = never_answering_router();
    let tenant = TenantId(1);
    let mut request = 0;
    // Each process faults on its first job.
    let mut crash = |router: &mut TenantExecutors| {
        request += 1;
        match ask(router, Job::Unregister { fingerprint: Fingerprint::of_blocks(&[b"any"]) }, tenant, request) {
            Message::Data(DataMessage::Error { code: ErrorCode::ExecutorLost, message }) => message,
            other => panic!("{other:?}"),
        }
    };
    for _ in 0..=FREE_RESTARTS {
        let lost = crash(&mut router);
        assert!(lost.contains("SIGSEGV") || lost.contains("signal: 11"), "{lost}");
    }
    let deferred = crash(&mut router);
    assert!(deferred.contains("ended 4 times") && deferred.contains("next starts in 1.0 s"), "{deferred}");
    assert_eq!(router.pid_of(tenant), None, "no process started meanwhile");
    std::thread::sleep(Duration::from_millis(1100));
    let lost = crash(&mut router);
    assert!(lost.contains("SIGSEGV") || lost.contains("signal: 11"), "started again after the wait: {lost}");
    let deferred = crash(&mut router);
    assert!(deferred.contains("ended 5 times") && deferred.contains("next starts in 2.0 s"), "{deferred}");

    let counters = match ask(&mut router, Job::Stats, TenantId(2), 100) {
        Message::Data(DataMessage::StatsReply { counters }) => counters,
        other => panic!("{other:?}"),
    };
    for counter in [("executor_processes_started", 5), ("executor_process_starts_deferred", 2)] {
        assert!(counters.contains(&(counter.0.to_owned(), counter.1)), "{counter:?} in {counters:?}");
    }
}

/// The pid of the tenant's process, once the router's link thread has started it.
fn wait_for_pid(router: &TenantExecutors, tenant: TenantId) -> u32 {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match router.pid_of(tenant) {
            Some(pid) => return pid,
            None if std::time::Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            None => panic!("the tenant's process was not started within 30 s"),
        }
    }
}

/// The link's descriptor, in a child started by one of the tests above.
fn inherited_link() -> std::os::fd::OwnedFd {
    assert!(std::env::var_os("DJINN_SUPERVISOR_TEST_CHILD").is_some(), "started by a parent test");
    // SAFETY: the parent placed the link's region there for this process to own, and nothing
    // else here uses it.
    unsafe { djinn_shm::inherited(LINK_FD) }.expect("the link's descriptor")
}

#[test]
#[ignore = "the child process of the tests above"]
fn child_serves_the_executor_double() {
    // Its ids from the range its router gave it, where a router started it.
    let first_id = std::env::var("DJINN_TEST_FIRST_ID").ok().and_then(|id| id.parse().ok()).unwrap_or(1);
    let served = djinn_supervisor::serve(inherited_link(), FakeExecutor::numbered_from(first_id));
    panic!("the link broke: {served:?}");
}

/// An executor that takes every job and answers none (what the node sees of kernels that run
/// until their process ends), and faults on an `Unregister`, as a kernel does on a bad address.
#[derive(Debug, Default)]
struct NeverAnswers(Vec<ReplyTo>);

impl Executor for NeverAnswers {
    fn run(&mut self, job: Job, to: ReplyTo, _: &Replier) {
        match job {
            // SAFETY: none: this is the fault under test, a write to an unmapped page.
            Job::Unregister { .. } => unsafe { std::ptr::without_provenance_mut::<u8>(8).write_volatile(1) },
            // Memory no executor bound sees, as a library's `malloc` inside a kernel: 256 MiB,
            // touched, held.
            Job::Fetch { .. } => std::mem::forget(vec![1u8; 256 << 20]),
            _ => {}
        }
        self.0.push(to);
    }
    fn epoch(&self) -> u64 {
        NEVER_ANSWERS_EPOCH
    }
    fn free_kept(&mut self, _: &[u64]) {}
    fn free_parked(&mut self, _: &[u64]) {}
    fn free_sessions(&mut self, _: &[u64]) {}
}

#[test]
#[ignore = "the child process of the tests above"]
fn child_serves_an_executor_that_never_answers() {
    let served = djinn_supervisor::serve(inherited_link(), NeverAnswers::default());
    panic!("the link broke: {served:?}");
}
