//! The conformance suite through a child process: the core's executor double served over the
//! link by a child started by exec (this test binary again, running the ignored
//! `child_serves_the_executor_double`) gets the same replies as in process; and when a child
//! dies (a fault in a kernel, a kill from outside), what it held is answered `ExecutorLost`,
//! typed, and the test process (the node) goes on.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use djinn_auth::TenantId;
use djinn_memory::MemoryBudget;
use djinn_node_core::conformance::{self, FakeExecutor};
use djinn_node_core::{Answer, Executor, Job, Replier, ReplyTo};
use djinn_proto::{DataMessage, ErrorCode, Handle, Message};
use djinn_supervisor::{LINK_FD, LinkSizes, ProcessExecutor};

const SIZES: LinkSizes = LinkSizes { messages: 1 << 20, bulk: 16 << 20 };
const READY_WITHIN: Duration = Duration::from_secs(60);
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
    (ProcessExecutor::start(child, SIZES, 1, READY_WITHIN).expect("the child starts"), MemoryBudget::new(1 << 20))
}

#[test]
fn the_conformance_suite_passes_through_an_executor_process() {
    conformance::run(executor, b"any archive: the double runs every model as the identity");
}

/// How an executor process ends in the tests below.
enum Ending {
    /// A kernel faults: the child writes through a bad pointer when it gets an `Abort`.
    Fault,
    /// Killed from outside, as the kernel's OOM killer or an operator kills it.
    Kill,
}

/// Three requests held by a child that answers none, then the child ends: each is answered
/// `ExecutorLost` (naming how it ended) once, and so is a request after.
fn requests_held_when_the_child_ends_are_answered_executor_lost(ending: Ending, cause: &[&str]) {
    let child = child("child_serves_an_executor_that_never_answers");
    let mut executor =
        ProcessExecutor::start(child, SIZES, NEVER_ANSWERS_EPOCH, READY_WITHIN).expect("the child starts");
    let (replier, replies) = Replier::new(Arc::new(|| {}));
    let to = |request_id| ReplyTo {
        slot: 0,
        conn_id: 1,
        request_id,
        tenant: TenantId::DEFAULT,
        operator: false,
        torchscript: false,
    };
    for request in 1..=3 {
        executor.run(Job::Stats, to(request), &replier);
    }
    assert!(replies.recv_timeout(Duration::from_millis(200)).is_err(), "the child answers nothing");
    let mut held = vec![1, 2, 3];
    match ending {
        Ending::Fault => {
            executor.run(Job::Abort { parked: Handle { id: 1, epoch: 7 } }, to(4), &replier);
            held.push(4);
        }
        Ending::Kill => {
            let killed = Command::new("kill").args(["-KILL", &executor.pid().to_string()]).status().expect("kill");
            assert!(killed.success());
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
    executor.run(Job::Stats, to(9), &replier);
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
    let served = djinn_supervisor::serve(inherited_link(), FakeExecutor::default());
    panic!("the link broke: {served:?}");
}

/// An executor that takes every job and answers none (what the node sees of kernels that run
/// until their process ends), and faults on an `Abort`, as a kernel does on a bad address.
#[derive(Debug, Default)]
struct NeverAnswers(Vec<ReplyTo>);

impl Executor for NeverAnswers {
    fn run(&mut self, job: Job, to: ReplyTo, _: &Replier) {
        if let Job::Abort { .. } = job {
            // SAFETY: none: this is the fault under test, a write to an unmapped page.
            unsafe { std::ptr::without_provenance_mut::<u8>(8).write_volatile(1) };
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
