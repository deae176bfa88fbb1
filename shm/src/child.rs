//! Starting a helper process by exec (never a fork that goes on running the parent's code) with
//! chosen descriptors at chosen numbers, and taking those descriptors up on the other side.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

use rustix::io::{FdFlags, fcntl_getfd, fcntl_setfd};

/// Starts `command` with each descriptor of `fds` at the number beside it (the only
/// descriptors it inherits besides the standard three, since every other is opened
/// close-on-exec), and killed by SIGKILL when the thread that started it ends (the kernel's
/// parent-death signal follows the thread, so start children from a thread that lives as long
/// as they should). The numbers must be distinct and above 2.
pub fn spawn_with_fds(command: &mut Command, fds: &[(BorrowedFd<'_>, RawFd)]) -> io::Result<Child> {
    let moves: Vec<(RawFd, RawFd)> = fds.iter().map(|(fd, to)| (fd.as_raw_fd(), *to)).collect();
    for (i, &(_, to)) in moves.iter().enumerate() {
        if to <= 2 || moves[..i].iter().any(|&(_, other)| other == to) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("descriptor number {to} is taken")));
        }
    }
    // Each source is first copied above every target, so that placing one never closes
    // another's source.
    let above = moves.iter().map(|&(_, to)| to).max().unwrap_or(2) + 1;
    let mut copies = vec![-1; moves.len()];
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: it makes raw system calls only (fcntl, dup2, prctl, getppid) and
    // allocates nothing (`moves` and `copies` were made before the fork).
    unsafe {
        command.pre_exec(move || {
            let check = |rc: libc::c_int| if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) };
            for (copy, &(from, _)) in copies.iter_mut().zip(&moves) {
                *copy = libc::fcntl(from, libc::F_DUPFD_CLOEXEC, above);
                check(*copy)?;
            }
            for (&copy, &(_, to)) in copies.iter().zip(&moves) {
                // dup2's copy is not close-on-exec.
                check(libc::dup2(copy, to))?;
            }
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
            // The parent may have gone before the signal was asked for.
            if libc::getppid() != parent {
                return Err(io::Error::other("the parent went before its child started"));
            }
            Ok(())
        })
    };
    command.spawn()
}

/// Takes up the descriptor the parent placed at `fd` ([`spawn_with_fds`]), close-on-exec again
/// so that it goes no further.
///
/// # Safety
/// `fd` must be one the parent passed for this process to own, taken up once, and not used by
/// anything else in this process.
pub unsafe fn inherited(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: the caller's promise.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    // An fd that is not open is an error here, not a descriptor owned by mistake.
    fcntl_getfd(borrowed)?;
    fcntl_setfd(borrowed, FdFlags::CLOEXEC)?;
    // SAFETY: open (checked above), and the caller's to own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
