//! A node whose tenants' models run in executor processes of their own (`--executor-processes`):
//! each tenant's first request starts its process; when one is killed while two tenants call in
//! loops, the node lives, the other tenant sees no failed request, and the hit tenant gets only
//! typed errors and is served again by a new process, its models loaded there without a
//! re-upload.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use djinn_client::{Client, ClientOptions, DType, ErrorCode, Fingerprint, TensorRef, Value};
use djinn_supervisor::sandbox::{Layer, Layers, layers_of};
use support::{Node, f32_bytes, register};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";

fn token_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tokens.json");
    let json = serde_json::json!({ "principals": [
        { "name": "alice", "tokens": [ALICE], "rights": ["torchscript"] },
        { "name": "bob", "tokens": [BOB], "rights": ["torchscript"] },
    ]});
    std::fs::write(&path, json.to_string()).expect("write the token file");
    path
}

fn connect(node: &Node, token: &str) -> Client {
    let options =
        ClientOptions { token: token.to_owned(), timeout: Some(Duration::from_secs(60)), ..Default::default() };
    Client::connect_with(node.addr, options).expect("connect")
}

/// The node's executor processes: pid and command line of each child that runs `executor`.
fn executor_processes(node: &Node) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent pid is the second field after the command's closing parenthesis.
        let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
        if parent != Some(node.pid()) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(" executor ") {
            found.push((pid, cmdline));
        }
    }
    found
}

fn call(client: &mut Client, model: &Fingerprint, x: &[u8]) -> Result<Vec<u8>, djinn_client::ClientError> {
    let input = [TensorRef { dtype: DType::F32, shape: &[4, 256], bytes: x }];
    let output = client.execute(model, &[Value::Tensor(0)], &input)?;
    Ok(output.tensor_bytes(0).to_vec())
}

#[test]
fn a_tenants_executor_process_killed_costs_only_that_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start("mio", &["--executor-processes", "--auth-file", token_file(dir.path()).to_str().unwrap()]);
    let mut alice = connect(&node, ALICE);
    let mut bob = connect(&node, BOB);
    let blocks = ["mlp.block0", "mlp.block1", "mlp.block2"];
    let alices = register(&mut alice, &blocks);
    let bobs = register(&mut bob, &blocks);
    let x = f32_bytes(4 * 256, 3);
    let expected = call(&mut alice, &alices, &x).expect("alice is served");
    assert_eq!(call(&mut bob, &bobs, &x).expect("bob is served"), expected, "the same model, the same answer");

    // Alice's process started first: its handles' ids start at 1, bob's past alice's range.
    let processes = executor_processes(&node);
    assert_eq!(processes.len(), 2, "one process per tenant: {processes:?}");
    let (alices_pid, _) = processes.iter().find(|(_, cmd)| cmd.contains("--first-id=1 ")).expect("alice's process");
    // Each confined in every layer /proc shows (all but Landlock, which the node's counters
    // show as the process reported it): no new privileges, a network of its own, no
    // capabilities, its system-call filter.
    for (pid, _) in &processes {
        let shown = layers_of(*pid);
        assert_eq!(shown, Layers::ALL.without(Layer::Landlock), "process {pid}: {shown}");
    }
    let stats: std::collections::HashMap<String, u64> = alice.stats().unwrap().into_iter().collect();
    for layer in Layer::ALL {
        let counter = format!("executor_sandbox_{}", layer.name().replace('-', "_"));
        assert_eq!(stats.get(&counter), Some(&2), "both processes in {layer}: {stats:?}");
    }
    let bytes = f32_bytes(4, 9);
    let tensor = TensorRef { dtype: DType::F32, shape: &[4], bytes: &bytes };
    let (alices_kept, bobs_kept) = (alice.keep(tensor).unwrap().handle, bob.keep(tensor).unwrap().handle);
    assert!(alices_kept.id < 1 << 40 && bobs_kept.id > 1 << 40, "{alices_kept} {bobs_kept}");
    let kept = |client: &mut Client| {
        let stats = client.stats().unwrap();
        stats.iter().find(|(n, _)| n == "executor_kept_tensors").map(|(_, v)| *v)
    };
    assert_eq!(kept(&mut alice), Some(2), "both processes' kept tensors, summed");
    // Released, each is freed in the process that holds it (found by its id's range).
    assert_eq!(alice.release(&[alices_kept]).unwrap(), 1);
    assert_eq!(bob.release(&[bobs_kept]).unwrap(), 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    while kept(&mut alice) != Some(0) {
        assert!(Instant::now() < deadline, "the kept tensors were not freed where they were held");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Bob calls in a loop while alice's process is killed.
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let bobs_loop = {
        let (stop, served, expected, x) = (Arc::clone(&stop), Arc::clone(&served), expected.clone(), x.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let answer = call(&mut bob, &bobs, &x).expect("bob sees no failed request");
                assert_eq!(answer, expected);
                served.fetch_add(1, Ordering::SeqCst);
            }
            bob
        })
    };
    let killed = std::process::Command::new("kill").args(["-KILL", &alices_pid.to_string()]).status().unwrap();
    assert!(killed.success());

    // Alice gets typed errors only (what her process held when it went), then she is served by
    // a new process that loaded her model again: she uploads nothing.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut codes = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "alice not served again: {codes:?}");
        match call(&mut alice, &alices, &x) {
            Ok(answer) if codes.is_empty() => assert_eq!(answer, expected, "answered before the kill took"),
            Ok(answer) => {
                assert_eq!(answer, expected);
                break;
            }
            Err(e) => {
                let code = e.remote_code().unwrap_or_else(|| panic!("an untyped failure: {e}"));
                assert_eq!(code, ErrorCode::ExecutorLost, "{e}");
                codes.push(code);
            }
        }
    }
    let before = served.load(Ordering::SeqCst);
    while served.load(Ordering::SeqCst) < before + 5 {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let mut bob = bobs_loop.join().expect("bob's loop saw no failure");

    // Her model is hers in the new process as it was: listed, and gone once she unregisters it.
    assert_eq!(alice.list_models().expect("her models").len(), 1);
    // The node lives; it counts the restart; a new process serves alice.
    let stats = bob.stats().expect("the node answers");
    let stat = |name: &str| stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    assert_eq!(stat("executor_processes"), Some(2), "{stats:?}");
    assert_eq!(stat("executor_process_restarts"), Some(1), "{stats:?}");
    let now = executor_processes(&node);
    assert_eq!(now.len(), 2);
    assert!(now.iter().all(|(pid, _)| pid != alices_pid), "alice's process is a new one");
}
