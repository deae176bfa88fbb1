//! A real `djinn node` process on 127.0.0.1, driven by real clients and by raw sockets that
//! send what a well-behaved client never would. Every test runs against both TCP backends.

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use djinn_client::{ClientError, DType, ErrorCode};
use djinn_proto::{
    DataKind, DataMessage, FrameHeader, HEADER_LEN, Hello, Kind, Limits, Message, PROTOCOL_VERSION, TensorDesc,
    encode_head, transports,
};
use support::{BACKENDS, Node, pattern, read_reply, reset_on_close};

#[test]
fn a_gibibyte_tensor_goes_in_and_comes_back_byte_exact() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--device-memory-budget", "3GiB"]);
        let mut client = node.client();
        let data = pattern(1 << 30, 1);
        assert!(!client.put("big", DType::F32, &[1 << 28], &data).unwrap());
        let back = client.get("big").unwrap();
        assert_eq!(back.desc, TensorDesc::new(DType::F32, vec![1 << 28]).unwrap());
        assert!(back.bytes() == &data[..], "{backend}: bytes differ");
        drop(back);
        // Its bytes, and a page and its name of bookkeeping.
        assert_eq!(node.stat(&mut client, "budget_used_bytes"), (1 << 30) + 4096 + 3);
        client.delete("big").unwrap();
        assert_eq!(node.stat(&mut client, "budget_used_bytes"), 0, "{backend}");
    }
}

#[test]
fn sixty_four_clients_of_a_thousand_requests_each_all_get_their_own_answers() {
    for backend in BACKENDS {
        let node = Arc::new(Node::start(backend, &[]));
        let workers: Vec<_> = (0..64u64)
            .map(|id| {
                let node = Arc::clone(&node);
                thread::spawn(move || {
                    let mut client = node.client();
                    let name = format!("t{id}");
                    for i in 0..500u64 {
                        let len = 8 + ((id * 131 + i * 17) % 4096) as usize;
                        let data = pattern(len, id * 1000 + i);
                        client.put(&name, DType::U8, &[len as u64], &data).unwrap();
                        let back = client.get(&name).unwrap();
                        assert_eq!(back.bytes(), &data[..], "client {id} request {i}");
                    }
                    client.delete(&name).unwrap();
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a client failed");
        }
        let mut client = node.client();
        assert_eq!(node.stat(&mut client, "frames_in"), 64 * (1 + 1000 + 1) + 1 + 1);
        assert_eq!(node.stat(&mut client, "budget_used_bytes"), 0);
        assert!(client.list().unwrap().is_empty());
    }
}

#[test]
fn requests_pipelined_on_one_connection_are_answered_by_request_id() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        node.client().put("p", DType::I64, &[4], &pattern(32, 3)).unwrap();
        let mut stream = TcpStream::connect(node.addr).unwrap();
        let mut wire = Vec::new();
        let mut head = Vec::new();
        for id in 100..300u64 {
            let message = if id % 2 == 0 {
                Message::Data(DataMessage::Ping)
            } else {
                Message::Data(DataMessage::Get { name: "p".into() })
            };
            encode_head(&mut head, id, &message).unwrap();
            wire.extend_from_slice(&head);
        }
        stream.write_all(&wire).unwrap();
        for id in 100..300u64 {
            let (header, message, payload) = read_reply(&mut stream);
            assert_eq!(header.request_id.get(), id);
            if id % 2 == 0 {
                assert_eq!(message, Message::Data(DataMessage::Pong));
            } else {
                assert!(matches!(message, Message::Data(DataMessage::GetReply { .. })));
                assert_eq!(payload, pattern(32, 3));
            }
        }
    }
}

/// Sends `bytes` on a fresh connection, half-closes it, and returns the error reply.
fn error_for(node: &Node, bytes: &[u8]) -> (u64, ErrorCode, String) {
    let mut stream = TcpStream::connect(node.addr).unwrap();
    stream.write_all(bytes).unwrap();
    stream.shutdown(Shutdown::Write).unwrap();
    let (header, message, _) = read_reply(&mut stream);
    let Message::Data(DataMessage::Error { code, message }) = message else {
        panic!("expected an error, got {message:?}")
    };
    (header.request_id.get(), code, message)
}

fn put_frame(id: u64, name: &str, tensor: TensorDesc, payload: &[u8]) -> Vec<u8> {
    let mut wire = Vec::new();
    encode_head(&mut wire, id, &Message::Data(DataMessage::Put { name: name.into(), tensor })).unwrap();
    wire.extend_from_slice(payload);
    wire
}

/// One round of every kind of bad input; returns what the node answered, in order.
fn bad_input_round(node: &Node) -> Vec<ErrorCode> {
    let mut codes = Vec::new();
    let header = |kind: Kind, meta: u32, payload: u64| {
        zerocopy::IntoBytes::as_bytes(&FrameHeader::new(kind, 7, meta, payload)).to_vec()
    };

    // Malformed header: wrong magic.
    let mut bad = header(Kind::Data(DataKind::Ping), 0, 0);
    bad[..4].copy_from_slice(b"HTTP");
    codes.push(error_for(node, &bad).1);

    // Truncated frame: a 1 MiB put that stops half way, then the client half-closes.
    let tensor = TensorDesc::new(DType::U8, vec![1 << 20]).unwrap();
    let frame = put_frame(8, "cut", tensor, &pattern(1 << 20, 5));
    let (_, code, message) = error_for(node, &frame[..frame.len() / 2]);
    assert!(message.contains("payload"), "{message}");
    codes.push(code);

    // Length over the limit (the node runs with --max-payload 64MiB): refused from the header.
    codes.push(error_for(node, &header(Kind::Data(DataKind::Put), 20, (64 << 20) + 1)).1);

    // Unknown kind, with a body the node must skip: the connection stays usable.
    let mut stream = TcpStream::connect(node.addr).unwrap();
    let mut unknown = header(Kind::Data(DataKind::Ping), 4, 100);
    unknown[6..8].copy_from_slice(&0x0177u16.to_le_bytes());
    unknown.extend([0u8; 104]);
    let mut ping = Vec::new();
    encode_head(&mut ping, 9, &Message::Data(DataMessage::Ping)).unwrap();
    unknown.extend(&ping);
    stream.write_all(&unknown).unwrap();
    let (h, reply, _) = read_reply(&mut stream);
    assert_eq!(h.request_id.get(), 7);
    let Message::Data(DataMessage::Error { code, .. }) = reply else { panic!("{reply:?}") };
    codes.push(code);
    assert_eq!(read_reply(&mut stream).1, Message::Data(DataMessage::Pong));

    // Descriptor whose byte length disagrees with dtype × shape: refused, connection usable.
    let lying = TensorDesc { byte_len: 12, ..TensorDesc::new(DType::F32, vec![2, 2]).unwrap() };
    stream.write_all(&put_frame(10, "lie", lying, &[0u8; 12])).unwrap();
    let (h, reply, _) = read_reply(&mut stream);
    assert_eq!(h.request_id.get(), 10);
    let Message::Data(DataMessage::Error { code, .. }) = reply else { panic!("{reply:?}") };
    codes.push(code);
    stream.write_all(&ping).unwrap();
    assert_eq!(read_reply(&mut stream).1, Message::Data(DataMessage::Pong));

    // A client that vanishes mid-frame (reset, no half-close): the node just drops it.
    let mut vanishing = TcpStream::connect(node.addr).unwrap();
    let tensor = TensorDesc::new(DType::U8, vec![8 << 20]).unwrap();
    let frame = put_frame(11, "gone", tensor, &pattern(8 << 20, 6));
    vanishing.write_all(&frame[..3 << 20]).unwrap();
    reset_on_close(&vanishing);
    drop(vanishing);

    codes
}

#[test]
fn bad_input_gets_typed_errors_and_leaks_nothing() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--max-payload", "64MiB"]);
        let mut observer = node.client();
        observer.put("keep", DType::U8, &[3], &[1, 2, 3]).unwrap();
        let baseline = node.stat(&mut observer, "budget_used_bytes");
        let expected = [
            ErrorCode::BadMagic,
            ErrorCode::Truncated,
            ErrorCode::FrameTooLarge,
            ErrorCode::UnknownKind,
            ErrorCode::BadDescriptor,
        ];
        let mut rss_after_first = 0;
        for round in 0..10 {
            assert_eq!(bad_input_round(&node), expected, "{backend}, round {round}");
            // The node still serves others, and every byte it took is back.
            assert_eq!(observer.get("keep").unwrap().bytes(), &[1, 2, 3]);
            node.wait_for_stat(&mut observer, "connections_open", 1);
            assert_eq!(node.stat(&mut observer, "budget_used_bytes"), baseline, "{backend}, round {round}");
            if round == 0 {
                rss_after_first = node.rss();
            }
        }
        let rss = node.rss();
        assert!(
            rss <= rss_after_first + (16 << 20),
            "{backend}: RSS grew from {rss_after_first} to {rss} bytes over 10 rounds"
        );
    }
}

#[test]
fn a_hello_from_another_protocol_version_is_refused_naming_both() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        let future = PROTOCOL_VERSION + 1;
        let hello = Hello { protocol_version: future, ..Hello::new(&Limits::default(), transports::TCP, "future") };
        let mut wire = Vec::new();
        encode_head(&mut wire, 1, &Message::Data(DataMessage::Hello(hello))).unwrap();
        let (_, code, message) = error_for(&node, &wire);
        assert_eq!(code, ErrorCode::VersionMismatch);
        let both =
            message.contains(&format!("version {future}")) && message.contains(&format!("version {PROTOCOL_VERSION}"));
        assert!(both, "{message}");
        // The same in the frame header: fatal for the stream, still named.
        let mut wire = zerocopy::IntoBytes::as_bytes(&FrameHeader::new(Kind::Data(DataKind::Ping), 1, 0, 0)).to_vec();
        let other = PROTOCOL_VERSION + 1;
        wire[4..6].copy_from_slice(&other.to_le_bytes());
        let (_, code, message) = error_for(&node, &wire);
        assert_eq!(code, ErrorCode::VersionMismatch);
        assert!(message.contains(&format!("version {other}")), "{message}");
    }
}

#[test]
fn a_put_over_the_budget_is_refused_before_its_payload_is_taken() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--device-memory-budget", "1MiB"]);
        let mut client = node.client();
        let err = client.put("big", DType::U8, &[2 << 20], &pattern(2 << 20, 1)).unwrap_err();
        assert_eq!(err.remote_code(), Some(ErrorCode::OverBudget), "{err}");
        // The connection stays in step and the budget untouched.
        client.put("small", DType::U8, &[1000], &pattern(1000, 2)).unwrap();
        assert_eq!(node.stat(&mut client, "budget_used_bytes"), 1000 + 4096 + "small".len() as u64);
        assert_eq!(node.stat(&mut client, "pool_misses"), 0, "nothing allocated for the refused put");
    }
}

#[test]
fn a_batch_of_gets_comes_back_in_order() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        support::many_gets_come_back_in_order(&mut node.client());
    }
}

#[test]
fn unknown_names_are_not_found() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        let mut client = node.client();
        let err = client.get("nope").unwrap_err();
        assert!(
            matches!(&err, ClientError::Remote { code: ErrorCode::NotFound, message, .. } if message.contains("nope"))
        );
        assert_eq!(client.delete("nope").unwrap_err().remote_code(), Some(ErrorCode::NotFound));
        client.ping().unwrap();
    }
}

#[test]
fn listing_pages_through_every_name_in_order() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        let mut client = node.client();
        let mut names: Vec<String> = (0..2500).map(|i| format!("n{i:05}")).collect();
        for name in &names {
            client.put(name, DType::Bool, &[], &[1]).unwrap();
        }
        names.sort();
        let listed: Vec<String> = client.list().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(listed, names);
    }
}

#[test]
fn a_client_that_never_reads_cannot_make_the_node_buffer_without_bound() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--max-queued", "8MiB"]);
        let mut client = node.client();
        client.put("blob", DType::U8, &[4 << 20], &pattern(4 << 20, 9)).unwrap();
        let rss_before = node.rss();
        // Ask for the 4 MiB blob 200 times (800 MiB of replies) and read none of them.
        let mut greedy = TcpStream::connect(node.addr).unwrap();
        greedy.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
        let mut head = Vec::new();
        encode_head(&mut head, 1, &Message::Data(DataMessage::Get { name: "blob".into() })).unwrap();
        for _ in 0..200 {
            if greedy.write_all(&head).is_err() {
                break; // the node stopped reading us: back-pressure reached our socket
            }
        }
        thread::sleep(Duration::from_millis(300));
        // The node read only what its reply bound allows, and still serves others.
        let frames_in = node.stat(&mut client, "frames_in");
        assert!(frames_in < 2 + 50, "{backend}: the node took {frames_in} frames from a client that reads nothing");
        assert_eq!(client.get("blob").unwrap().bytes().len(), 4 << 20);
        let rss = node.rss();
        assert!(rss < rss_before + (32 << 20), "{backend}: RSS went from {rss_before} to {rss}");
        // Replies are shared with the store, not copied; reading them all back still works.
        greedy.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let (header, message, payload) = read_reply(&mut greedy);
        assert_eq!(header.request_id.get(), 1);
        assert!(matches!(message, Message::Data(DataMessage::GetReply { .. })));
        assert_eq!(payload.len(), 4 << 20);
    }
}

#[test]
fn many_clients_that_never_read_cannot_pass_the_global_reply_bound() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--max-queued", "16MiB", "--max-queued-total", "24MiB"]);
        let mut client = node.client();
        client.put("blob", DType::U8, &[4 << 20], &pattern(4 << 20, 5)).unwrap();
        let mut get = Vec::new();
        encode_head(&mut get, 1, &Message::Data(DataMessage::Get { name: "blob".into() })).unwrap();
        // Eight clients each ask for 64 × 4 MiB and read nothing: each alone stays within its
        // 16 MiB, together they would queue 128 MiB.
        let deaf: Vec<TcpStream> = (0..8)
            .map(|_| {
                let mut s = TcpStream::connect(node.addr).unwrap();
                s.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
                for _ in 0..64 {
                    if s.write_all(&get).is_err() {
                        break;
                    }
                }
                s
            })
            .collect();
        thread::sleep(Duration::from_millis(500));
        // A client that reads its replies is still served, and the queues together stay
        // within the bound and one reply per connection.
        let queued = node.stat(&mut client, "queued_reply_bytes");
        assert!(queued <= (24 << 20) + 9 * (4 << 20), "{backend}: {queued} bytes of replies queued");
        assert_eq!(client.get("blob").unwrap().bytes().len(), 4 << 20, "{backend}");
        drop(deaf);
        node.wait_for_stat(&mut client, "queued_reply_bytes", 0);
    }
}

#[test]
fn clients_that_stall_are_closed_and_the_node_keeps_serving() {
    for backend in BACKENDS {
        let node = Node::start(backend, &["--stall-timeout", "0.4", "--max-queued", "8MiB"]);
        let mut client = node.client();
        client.put("blob", DType::U8, &[4 << 20], &pattern(4 << 20, 3)).unwrap();
        client.put("small", DType::U8, &[4096], &pattern(4096, 4)).unwrap();
        let mut get = Vec::new();
        encode_head(&mut get, 1, &Message::Data(DataMessage::Get { name: "blob".into() })).unwrap();

        // Half a header, then nothing.
        let mut silent = TcpStream::connect(node.addr).unwrap();
        silent.write_all(&get[..HEADER_LEN / 2]).unwrap();
        // A frame trickled a byte at a time.
        let mut trickle = TcpStream::connect(node.addr).unwrap();
        trickle.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
        // Replies asked for and never read.
        let mut deaf = TcpStream::connect(node.addr).unwrap();
        deaf.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
        for _ in 0..64 {
            if deaf.write_all(&get).is_err() {
                break;
            }
        }
        let trickler = thread::spawn(move || {
            for &byte in get.iter().cycle().take(60) {
                if trickle.write_all(&[byte]).is_err() {
                    return true;
                }
                thread::sleep(Duration::from_millis(50));
            }
            // Closed by the node: the next read sees the end.
            trickle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            matches!(trickle.read(&mut [0u8; 64]), Ok(0) | Err(_))
        });
        node.wait_for_stat_at_least(&mut client, "stalled_connections", 3);
        assert!(trickler.join().unwrap(), "{backend}: the trickling connection is closed");
        silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(silent.read(&mut [0u8; 64]), Ok(0) | Err(_)), "{backend}: the silent connection is closed");
        // An idle connection is not a stalled one: a fresh one (a bare socket, which does not
        // reconnect), served, idle for 2.5 stall timeouts, is served again. (Not the count: on
        // a loaded 2-core machine, with this binary's other tests beside it, the client's own
        // 4 MiB put can pause past the 0.4 s timeout mid-frame, be counted, and reconnect.)
        let mut small = Vec::new();
        encode_head(&mut small, 2, &Message::Data(DataMessage::Get { name: "small".into() })).unwrap();
        let mut idle = TcpStream::connect(node.addr).unwrap();
        idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let served = |idle: &mut TcpStream| -> bool {
            if idle.write_all(&small).is_err() {
                return false;
            }
            let mut got = 0;
            let mut buf = [0u8; 8192];
            while got < 4096 {
                match idle.read(&mut buf) {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => got += n,
                }
            }
            true
        };
        assert!(served(&mut idle), "{backend}: a fresh connection is served");
        thread::sleep(Duration::from_millis(1000));
        assert!(served(&mut idle), "{backend}: an idle connection was closed as stalled");
        assert!(node.stat(&mut client, "stalled_connections") >= 3, "{backend}");
        assert_eq!(client.get("small").unwrap().bytes(), &pattern(4096, 4)[..], "{backend}");
        drop(deaf);
        node.wait_for_stat(&mut client, "connections_open", 2);
    }
}

#[test]
fn sigterm_stops_the_node_cleanly() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        let mut client = node.client();
        client.put("x", DType::U8, &[1], &[1]).unwrap();
        let addr = node.addr;
        assert!(node.terminate().success(), "{backend}");
        let mut buf = [0u8; HEADER_LEN];
        let mut stream = TcpStream::connect(addr);
        if let Ok(s) = &mut stream {
            assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
        }
    }
}

/// A node raises its open-files limit to what `--max-connections` needs; where the hard limit
/// is lower, it lowers the flag to fit, says so, and serves.
#[test]
fn the_connection_limit_fits_the_open_files_limit() {
    let node = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n 400 && exec {} node --listen 127.0.0.1:0 --max-connections 4096 --log warn",
            env!("CARGO_BIN_EXE_djinn")
        ))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut node = support::Killed(node);
    let mut stdout = std::io::BufReader::new(node.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    let addr = line.strip_prefix("djinn node listening on ").expect("the node starts").trim().to_owned();
    djinn_client::Client::connect(addr.as_str()).unwrap().put("x", DType::U8, &[1], &[1]).unwrap();
    node.0.kill().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut node.0.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("--max-connections lowered to 144"), "{stderr}");
}

/// A node runs on whatever libtorch the loader finds first (a bundle on a host's own torch). One
/// of another release than the build's is refused at start, naming both. The libtorch here is
/// the build's own, seen through hard links beside a `version.py` of another release: a real
/// second torch is not installed where the tests run.
#[test]
fn a_node_refuses_a_libtorch_of_another_release() {
    let _ = djinn_executor::tch::Tensor::from(1i64);
    let real = djinn_executor::libtorch::loaded().expect("this test links libtorch").lib_dir;
    let real_site = real.parent().and_then(|t| t.parent()).expect("torch/lib in site-packages");
    // Hard links (same file system as the build) keep the libraries' paths under the fake
    // torch; their rpaths ($ORIGIN/../../nvidia) find the real CUDA libraries through a link.
    let site = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let lib = site.path().join("torch/lib");
    std::fs::create_dir_all(&lib).unwrap();
    for entry in std::fs::read_dir(&real).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::hard_link(&path, lib.join(path.file_name().unwrap())).unwrap();
        }
    }
    if real_site.join("nvidia").exists() {
        std::os::unix::fs::symlink(real_site.join("nvidia"), site.path().join("nvidia")).unwrap();
    }
    std::fs::write(site.path().join("torch/version.py"), "__version__ = '2.9.1+cu128'\n").unwrap();
    let out = std::process::Command::new(support::djinn_binary())
        .args(["node", "--listen", "127.0.0.1:0"])
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started: {stderr}");
    let built_for = djinn_executor::libtorch::BUILT_FOR;
    assert!(stderr.contains(&format!("built for torch {built_for}")) && stderr.contains("2.9.1+cu128"), "{stderr}");
    assert!(stderr.contains(&lib.display().to_string()), "the refusal names where it was loaded from: {stderr}");
}

/// Out of file descriptors, the poller (either backend) waits, backing off, rather than
/// spinning on its listener; it serves its open connections throughout, and new ones once
/// descriptors are free.
#[test]
fn out_of_descriptors_the_poller_backs_off_and_recovers() {
    for backend in BACKENDS {
        let node = Node::start(backend, &[]);
        let mut client = node.client();
        let pid = node.pid() as u32;
        support::limit_open_files(pid, support::open_files(pid) + 2);
        let held: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(node.addr).unwrap()).collect();
        // Out of descriptors: an accept failed, and the listener waits.
        node.wait_for_stat_at_least(&mut client, "accept_backoffs", 1);
        let (before, tries_before) = (support::cpu_time(pid), node.stat(&mut client, "accept_backoffs"));
        thread::sleep(Duration::from_secs(1));
        let used = support::cpu_time(pid) - before;
        let tries = node.stat(&mut client, "accept_backoffs") - tries_before;
        // Waits of 10 ms doubling up to a second: a handful of tries in a second, where a
        // spinning poller makes thousands (fewer, not more, on a loaded machine).
        assert!(tries <= 12, "{backend}: {tries} accepts tried in a second out of descriptors");
        assert!(used < Duration::from_millis(250), "{backend}: {used:?} of CPU in a second out of descriptors");
        client.ping().expect("an open connection is served throughout");
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match djinn_client::Client::connect(node.addr).and_then(|mut c| c.ping()) {
                Ok(_) => break,
                Err(e) => assert!(std::time::Instant::now() < deadline, "{backend}: no new connection served: {e}"),
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}
