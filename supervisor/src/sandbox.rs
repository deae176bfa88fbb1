//! The layers that confine an executor process, entered in the child between fork and exec
//! (one thread, the node's code, nothing of a tenant's loaded yet) so that the executor cannot
//! leave them out. Each is entered where the host allows it; [`layers_of`] tells which a
//! running process is in, and the node logs a layer the host refused.
//!
//! Entered so far: no new privileges (no set-uid or file capabilities gained through exec), and
//! a network namespace of its own (only a loopback interface, down: no socket it makes reaches
//! the host or anything else), made directly with the right to (root), else inside a user
//! namespace of its own that maps its user and group to themselves. Still to come (issue 52):
//! a seccomp filter and Landlock.

use std::fmt;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// One layer of an executor process's confinement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    NoNewPrivileges,
    NetworkNamespace,
}

impl Layer {
    pub const ALL: [Self; 2] = [Self::NoNewPrivileges, Self::NetworkNamespace];
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoNewPrivileges => "no new privileges",
            Self::NetworkNamespace => "network namespace",
        })
    }
}

/// Makes `command`'s process enter every layer the host allows before it execs.
pub fn confine(command: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and makes only system calls
    // (prctl, getuid, getgid, unshare, open, write, close) on its stack: no allocation, no lock.
    unsafe {
        command.pre_exec(|| {
            enter_in_child();
            Ok(())
        });
    }
}

/// Between fork and exec: async-signal-safe calls only.
fn enter_in_child() {
    // SAFETY: system calls with integer arguments and buffers on this stack.
    unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        if libc::unshare(libc::CLONE_NEWNET) == 0 {
            return;
        }
        let (uid, gid) = (libc::getuid(), libc::getgid());
        if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) != 0 {
            return;
        }
        write_file(c"/proc/self/setgroups", b"deny");
        let mut line = [0u8; 32];
        write_file(c"/proc/self/uid_map", map_line(uid, &mut line));
        write_file(c"/proc/self/gid_map", map_line(gid, &mut line));
    }
}

/// "ID ID 1": the id mapped to itself, written into `buf` without allocating.
fn map_line(id: u32, buf: &mut [u8; 32]) -> &[u8] {
    let mut digits = [0u8; 10];
    let (mut n, mut len) = (id, 0);
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut at = 0;
    for _ in 0..2 {
        for i in (0..len).rev() {
            buf[at] = digits[i];
            at += 1;
        }
        buf[at] = b' ';
        at += 1;
    }
    buf[at] = b'1';
    &buf[..=at]
}

/// # Safety
/// Between fork and exec: open, write and close only.
unsafe fn write_file(path: &std::ffi::CStr, bytes: &[u8]) {
    // SAFETY: a NUL-terminated path; a buffer of `bytes.len()` bytes.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, bytes.as_ptr().cast(), bytes.len());
            libc::close(fd);
        }
    }
}

/// Whether the running process `pid` is in each layer (as /proc shows it to this process).
pub fn layers_of(pid: u32) -> Vec<(Layer, bool)> {
    let network = |of: &str| std::fs::read_link(format!("/proc/{of}/ns/net")).ok();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    Layer::ALL
        .into_iter()
        .map(|layer| {
            let entered = match layer {
                Layer::NoNewPrivileges => status.lines().any(|line| line.split_whitespace().eq(["NoNewPrivs:", "1"])),
                Layer::NetworkNamespace => {
                    let (its, ours) = (network(&pid.to_string()), network("self"));
                    its.is_some() && its != ours
                }
            };
            (layer, entered)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_maps_to_itself() {
        let mut buf = [0u8; 32];
        for (id, line) in [(0, "0 0 1"), (7, "7 7 1"), (1000, "1000 1000 1"), (u32::MAX, "4294967295 4294967295 1")] {
            assert_eq!(map_line(id, &mut buf), line.as_bytes());
        }
    }

    /// A child (the test binary again) confined as an executor process is: it reaches the
    /// host's listener before, and not after. As this user, and (when this is root) as one
    /// without the right to make a network namespace directly, who makes it inside a user
    /// namespace.
    #[test]
    fn a_confined_process_reaches_no_listener_of_the_host() {
        // SAFETY: geteuid cannot fail.
        let users: &[Option<u32>] = if unsafe { libc::geteuid() } == 0 { &[None, Some(65534)] } else { &[None] };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let address = listener.local_addr().expect("its address").to_string();
        assert!(std::net::TcpStream::connect(&address).is_ok(), "reachable unconfined");
        for &user in users {
            let mut command = Command::new(std::env::current_exe().expect("this test binary"));
            command
                .args(["--exact", "sandbox::tests::child_connects", "--include-ignored", "--nocapture"])
                .env("DJINN_SANDBOX_TEST_CHILD", &address);
            if let Some(id) = user {
                command.uid(id).gid(id);
            }
            confine(&mut command);
            let mut child = command
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("the child starts");
            // It runs until its input closes.
            let layers = layers_of(child.id());
            drop(child.stdin.take());
            let out = child.wait_with_output().expect("the child ends");
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "as {user:?}: {said}");
            assert!(said.contains("connect: refused"), "as {user:?}: no listener of the host's is reachable: {said}");
            assert!(layers.iter().all(|(_, entered)| *entered), "as {user:?}: {layers:?}");
        }
    }

    #[test]
    #[ignore = "the child process of the test above"]
    fn child_connects() {
        let address = std::env::var("DJINN_SANDBOX_TEST_CHILD").expect("started by the test above");
        match std::net::TcpStream::connect(&address) {
            Ok(_) => println!("connect: connected"),
            Err(e) => println!("connect: refused ({e})"),
        }
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new()).expect("its input");
    }
}
