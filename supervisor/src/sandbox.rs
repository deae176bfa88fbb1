//! The layers that confine an executor process. Most are entered in the child between fork and
//! exec (one thread, the node's code, nothing of a tenant's loaded yet) so that the executor
//! cannot leave them out; the system-call filter is entered by the executor itself once its
//! device is initialised ([`restrict_syscalls`]), since loading libtorch and CUDA needs calls
//! the filter refuses. Each is entered where the host allows it; [`Confined::entered`] and
//! [`layers_of`] tell which a process is in, and the node logs a layer the host refused.
//!
//! - **No new privileges**: no set-uid or file capabilities gained through exec.
//! - **Network namespace**: only a loopback interface, down: no socket it makes reaches the
//!   host or anything else. Made directly with the right to (root), else inside a user
//!   namespace of its own that maps its user and group to themselves.
//! - **No capabilities**: an executor of a node run as root is root without root's powers
//!   (the bounding, inheritable and ambient sets emptied before exec, so exec grants none).
//! - **Landlock**: reads and execution anywhere but `/dev`; writes, file creation and device
//!   ioctls only on `/dev/null` and the GPU's device files; no TCP bind or connect; no signal
//!   to, and no abstract socket of, a process outside the sandbox; no ptrace of one.
//! - **Seccomp**: refuses what an executor never does (sockets, exec, fork, ptrace, mounts,
//!   namespaces, io_uring, BPF, kernel modules, signals to other processes). A deny-list, not
//!   an allow-list: an allow-list drawn from CPU runs would end a GPU executor on the first
//!   call no CPU run made, and no GPU host is at hand to draw it from.

use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// One layer of an executor process's confinement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    NoNewPrivileges,
    NetworkNamespace,
    NoCapabilities,
    Landlock,
    Seccomp,
}

impl Layer {
    pub const ALL: [Self; 5] =
        [Self::NoNewPrivileges, Self::NetworkNamespace, Self::NoCapabilities, Self::Landlock, Self::Seccomp];

    /// Its short name, as `djinn status` and the node's counters show it.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoNewPrivileges => "no-new-privs",
            Self::NetworkNamespace => "netns",
            Self::NoCapabilities => "no-caps",
            Self::Landlock => "landlock",
            Self::Seccomp => "seccomp",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layers(u8);

impl Layers {
    pub const NONE: Self = Self(0);
    /// Those entered between fork and exec.
    pub const BEFORE_EXEC: Self = Self(0b1111);
    pub const ALL: Self = Self(0b1_1111);

    pub fn of(layers: &[Layer]) -> Self {
        Self(layers.iter().fold(0, |bits, layer| bits | layer.bit()))
    }

    pub fn contains(self, layer: Layer) -> bool {
        self.0 & layer.bit() != 0
    }

    pub fn with(self, layer: Layer) -> Self {
        Self(self.0 | layer.bit())
    }

    pub fn without(self, layer: Layer) -> Self {
        Self(self.0 & !layer.bit())
    }

    pub fn iter(self) -> impl Iterator<Item = Layer> {
        Layer::ALL.into_iter().filter(move |&layer| self.contains(layer))
    }
}

impl fmt::Display for Layers {
    /// `a,b,c`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        for (i, layer) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(layer.name())?;
        }
        Ok(())
    }
}

/// What one child's confinement reports: the layers it entered before exec, as its own system
/// calls answered (Landlock leaves no mark another process can see).
#[derive(Debug)]
pub struct Confined {
    report: Option<OwnedFd>,
}

impl Confined {
    /// The layers entered before exec; call once the child has been spawned.
    pub fn entered(&self) -> Layers {
        let Some(report) = &self.report else { return Layers::NONE };
        let mut bits = 0u8;
        // SAFETY: reads one byte into `bits` from a descriptor this owns (non-blocking: the
        // child wrote before exec, which `spawn` waited for).
        let read = unsafe { libc::read(report.as_raw_fd(), (&raw mut bits).cast(), 1) };
        if read == 1 { Layers(bits & Layers::BEFORE_EXEC.0) } else { Layers::NONE }
    }
}

/// Makes `command`'s process enter every layer before exec that the host allows.
pub fn confine(command: &mut Command) -> Confined {
    confine_in(command, Layers::BEFORE_EXEC)
}

/// As [`confine`], with only the layers of `layers` (tests name which layer refuses what); no
/// new privileges is entered always, as the others need it.
pub fn confine_in(command: &mut Command, layers: Layers) -> Confined {
    let landlock = match layers.contains(Layer::Landlock) {
        true => landlock_ruleset().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot make the executor's Landlock ruleset");
            None
        }),
        false => None,
    };
    let (report, into) = match report_pipe() {
        Ok((read, write)) => (Some(read), Some(write)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot make a pipe for the sandbox's report");
            (None, None)
        }
    };
    // SAFETY: the closure runs in the forked child before exec and makes only system calls
    // (prctl, getuid, getgid, unshare, open, write, close, landlock_restrict_self) with
    // integer arguments or buffers on its stack: no allocation, no lock.
    unsafe {
        command.pre_exec(move || {
            let ruleset = landlock.as_ref().map_or(-1, AsRawFd::as_raw_fd);
            let entered = enter_in_child(layers, ruleset);
            if let Some(into) = &into {
                libc::write(into.as_raw_fd(), (&raw const entered).cast(), 1);
            }
            Ok(())
        });
    }
    Confined { report }
}

/// A pipe for the child's report: (read end, non-blocking; write end), both close-on-exec.
fn report_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 made both descriptors, owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The executor's Landlock ruleset (see the module's text), made in the node where allocation
/// is free, for the child to enter; `None` where the kernel has no Landlock.
fn landlock_ruleset() -> Result<Option<OwnedFd>, landlock::RulesetError> {
    use landlock::{
        ABI, Access, AccessFs, AccessNet, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
    };
    // The newest rights this build knows; an older kernel enforces those it has (best effort).
    let abi = ABI::V7;
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))?
        .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)?
        .scope(Scope::Signal | Scope::AbstractUnixSocket)?
        .create()?;
    // Read and execute beneath each top-level directory but `/dev` (disks, memory, terminals).
    for entry in std::fs::read_dir("/").into_iter().flatten().flatten() {
        if entry.file_name() == "dev" {
            continue;
        }
        if let Ok(fd) = PathFd::new(entry.path()) {
            ruleset = ruleset.add_rule(PathBeneath::new(fd, AccessFs::from_read(abi)))?;
        }
    }
    let devices = std::fs::read_dir("/dev")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("nvidia")));
    let device_rights = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::IoctlDev;
    for path in devices.chain(["/dev/null".into(), "/dev/zero".into(), "/dev/urandom".into()]) {
        if let Ok(fd) = PathFd::new(&path) {
            ruleset = ruleset.add_rule(PathBeneath::new(fd, device_rights))?;
        }
    }
    Ok(ruleset.into())
}

/// Between fork and exec: async-signal-safe calls only. The layers of `wanted` entered.
fn enter_in_child(wanted: Layers, landlock: i32) -> u8 {
    let mut entered = Layers::NONE;
    // SAFETY: system calls with integer arguments and buffers on this stack.
    unsafe {
        // Needed by Landlock and seccomp without privileges, so entered whatever is wanted.
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 {
            entered = entered.with(Layer::NoNewPrivileges);
        }
        if wanted.contains(Layer::NetworkNamespace) && enter_network_namespace() {
            entered = entered.with(Layer::NetworkNamespace);
        }
        // After the namespaces, which need the capabilities.
        if wanted.contains(Layer::NoCapabilities) && drop_capabilities() {
            entered = entered.with(Layer::NoCapabilities);
        }
        if wanted.contains(Layer::Landlock)
            && landlock >= 0
            && libc::syscall(libc::SYS_landlock_restrict_self, landlock, 0) == 0
        {
            entered = entered.with(Layer::Landlock);
        }
    }
    entered.0
}

/// # Safety
/// Between fork and exec.
unsafe fn enter_network_namespace() -> bool {
    // SAFETY: system calls with integer arguments and buffers on this stack.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNET) == 0 {
            return true;
        }
        let (uid, gid) = (libc::getuid(), libc::getgid());
        if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) != 0 {
            return false;
        }
        write_file(c"/proc/self/setgroups", b"deny");
        let mut line = [0u8; 32];
        write_file(c"/proc/self/uid_map", map_line(uid, &mut line));
        write_file(c"/proc/self/gid_map", map_line(gid, &mut line));
        true
    }
}

/// Empties the bounding, ambient and inheritable sets: exec then grants no capability, even to
/// root. Whether exec will grant none.
///
/// # Safety
/// Between fork and exec.
unsafe fn drop_capabilities() -> bool {
    // The kernel's capabilities are numbered 0..=CAP_LAST_CAP (40 today); dropping an unknown
    // one fails with EINVAL, and past the last that ends the loop.
    const BEYOND_ANY: libc::c_ulong = 64;
    // SAFETY: prctl and capset with integer arguments and structures on this stack.
    unsafe {
        libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
        for cap in 0..BEYOND_ANY {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0
                && libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) < 0
            {
                break;
            }
        }
        // The inheritable set, through capget/capset (version 3: two 32-bit words each).
        let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
        let mut data = [CapData::default(); 2];
        if libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) == 0 {
            data[0].inheritable = 0;
            data[1].inheritable = 0;
            libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr());
        }
        // With no new privileges, exec grants a user other than root nothing either.
        libc::geteuid() != 0 || (0..BEYOND_ANY).all(|cap| libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) != 1)
    }
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
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

/// Installs the executor's system-call filter on every thread of this process (threads made
/// after inherit it). Called by the executor once its device is initialised, before it takes a
/// job. Refused calls fail with EPERM; `clone3` fails with ENOSYS, so that threads are made
/// with `clone`, whose flags the filter can read (a `clone` without `CLONE_THREAD`, a fork, is
/// refused).
pub fn restrict_syscalls() -> Result<(), seccompiler::Error> {
    use seccompiler::{
        BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    };
    let arch = std::env::consts::ARCH.try_into()?;
    // SAFETY: getpid cannot fail.
    let me = u64::from(unsafe { libc::getpid() }.cast_unsigned());
    let unless_to_me = |arg| -> Result<Vec<SeccompRule>, seccompiler::Error> {
        Ok(vec![SeccompRule::new(vec![SeccompCondition::new(arg, Len::Dword, SeccompCmpOp::Ne, me)?])?])
    };
    let mut refused: std::collections::BTreeMap<i64, Vec<SeccompRule>> =
        NEVER_CALLED.iter().map(|&call| (call, Vec::new())).collect();
    refused.insert(libc::SYS_kill, unless_to_me(0)?);
    refused.insert(libc::SYS_tgkill, unless_to_me(0)?);
    refused.insert(libc::SYS_rt_sigqueueinfo, unless_to_me(0)?);
    refused.insert(libc::SYS_rt_tgsigqueueinfo, unless_to_me(0)?);
    let thread = libc::CLONE_THREAD as u64;
    refused.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![SeccompCondition::new(0, Len::Qword, SeccompCmpOp::MaskedEq(thread), 0)?])?],
    );
    let deny = SeccompFilter::new(refused, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)?;
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    for filter in [clone3, deny] {
        seccompiler::apply_filter_all_threads(&BpfProgram::try_from(filter)?)?;
    }
    Ok(())
}

/// Calls an executor never makes, refused whatever their arguments.
const NEVER_CALLED: &[i64] = &[
    // No network: the link is shared memory the node made.
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    // No program but its own, no process of its own.
    libc::SYS_execve,
    libc::SYS_execveat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_fork,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_vfork,
    // No reach into other processes.
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_process_madvise,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_getfd,
    libc::SYS_pidfd_send_signal,
    libc::SYS_tkill,
    // No way around the other layers: namespaces, mounts, handles past paths, io_uring (its
    // operations are not system calls this filter sees).
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    // The kernel's wider surfaces.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
];

/// The layers the running process `pid` shows in /proc (to this process): no new privileges,
/// its network namespace, no capabilities, its seccomp filter. Landlock shows nowhere.
pub fn layers_of(pid: u32) -> Layers {
    let network = |of: &str| std::fs::read_link(format!("/proc/{of}/ns/net")).ok();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| status.lines().find_map(|line| line.strip_prefix(name)).map(str::trim);
    let mut layers = Layers::NONE;
    if field("NoNewPrivs:") == Some("1") {
        layers = layers.with(Layer::NoNewPrivileges);
    }
    let (its, ours) = (network(&pid.to_string()), network("self"));
    if its.is_some() && its != ours {
        layers = layers.with(Layer::NetworkNamespace);
    }
    let none = |set| field(set).is_some_and(|hex| hex.chars().all(|c| c == '0'));
    if none("CapEff:") && none("CapPrm:") {
        layers = layers.with(Layer::NoCapabilities);
    }
    // 2: a filter (SECCOMP_MODE_FILTER).
    if field("Seccomp:") == Some("2") {
        layers = layers.with(Layer::Seccomp);
    }
    layers
}

#[cfg(test)]
mod tests;
