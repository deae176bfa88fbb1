//! The real executor passes the conformance suite the core's tests run with an executor double
//! (`djinn_node_core::conformance`): the same requests, through the same core, get the same
//! replies.

use djinn_executor::tch::{CModule, Device, Kind, Tensor};
use djinn_executor::{ExecutorOptions, HandleSpace, Policy, SessionOptions, TorchExecutor};
use djinn_memory::MemoryBudget;
use djinn_node_core::conformance;
use djinn_supervisor::{LinkSizes, ProcessExecutor, Supervision};
use std::time::Duration;

/// A TorchScript module whose forward returns its one input, as the archive a client uploads.
fn identity_archive() -> Vec<u8> {
    let example = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let module = CModule::create_by_tracing("Identity", "forward", &[example], &mut |xs| vec![xs[0].shallow_clone()])
        .expect("traced");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("identity.pt");
    module.save(&path).unwrap();
    std::fs::read(path).unwrap()
}

/// The epoch of the handles the child's executor makes.
const CHILD_EPOCH: u64 = 0x5eed;
const SUPERVISION: Supervision = Supervision {
    ready_within: Duration::from_secs(120),
    run_deadline: None,
    grace: Supervision::GRACE,
    memory_limit: None,
};

fn executor() -> (TorchExecutor, MemoryBudget) {
    executor_of(HandleSpace::fresh())
}

fn executor_of(handles: HandleSpace) -> (TorchExecutor, MemoryBudget) {
    let budget = MemoryBudget::new(1 << 30);
    let options = ExecutorOptions {
        device: Device::Cpu,
        workers: 2,
        intra_op_threads: 1,
        host_budget: MemoryBudget::new(1 << 30),
        sessions: SessionOptions { policy: Policy::Lru, budget: 1 << 28, host_pool: 1 << 28 },
        execute_deadline: None,
        max_run_memory: None,
        flops_per_second: None,
        quotas: None,
        handles,
    };
    (TorchExecutor::new(budget.clone(), options).expect("the executor starts"), budget)
}

#[test]
fn the_real_executor_passes_the_conformance_suite() {
    conformance::run(executor, &identity_archive());
}

/// The same executor in a process of its own (this test binary again, running the ignored
/// `child_serves_the_real_executor`), its jobs and answers crossing the shared-memory link.
#[test]
fn the_real_executor_passes_the_conformance_suite_in_a_process_of_its_own() {
    let make = || {
        let mut child = std::process::Command::new(std::env::current_exe().expect("this test binary"));
        child
            .args(["--exact", "child_serves_the_real_executor", "--include-ignored", "--nocapture"])
            .env("DJINN_EXECUTOR_TEST_CHILD", "1");
        let sizes = LinkSizes { messages: 1 << 20, bulk: 16 << 20 };
        let executor =
            ProcessExecutor::start(child, sizes, CHILD_EPOCH, SUPERVISION, Vec::new()).expect("the child starts");
        (executor, MemoryBudget::new(1 << 30))
    };
    conformance::run(make, &identity_archive());
}

#[test]
#[ignore = "the child process of the_real_executor_passes_the_conformance_suite_in_a_process_of_its_own"]
fn child_serves_the_real_executor() {
    assert!(std::env::var_os("DJINN_EXECUTOR_TEST_CHILD").is_some(), "started by the parent test");
    // SAFETY: the parent placed the link's region there for this process to own, and nothing
    // else here uses it.
    let fd = unsafe { djinn_shm::inherited(djinn_supervisor::LINK_FD) }.expect("the link's descriptor");
    let served = djinn_supervisor::serve(fd, executor_of(HandleSpace { epoch: CHILD_EPOCH, first_id: 1 }).0);
    panic!("the link broke: {served:?}");
}
