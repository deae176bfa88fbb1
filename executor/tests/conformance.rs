//! The real executor passes the conformance suite the core's tests run with an executor double
//! (`djinn_node_core::conformance`): the same requests, through the same core, get the same
//! replies.

use djinn_executor::tch::{CModule, Device, Kind, Tensor};
use djinn_executor::{ExecutorOptions, Policy, SessionOptions, TorchExecutor};
use djinn_memory::MemoryBudget;
use djinn_node_core::conformance;

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

fn executor() -> (TorchExecutor, MemoryBudget) {
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
        auth: None,
    };
    (TorchExecutor::new(budget.clone(), options).expect("the executor starts"), budget)
}

#[test]
fn the_real_executor_passes_the_conformance_suite() {
    conformance::run(executor, &identity_archive());
}
