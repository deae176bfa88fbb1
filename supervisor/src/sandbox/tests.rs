use std::collections::BTreeMap;
use std::io::Read;
use std::process::Stdio;

use super::*;

#[test]
fn an_id_maps_to_itself() {
    let mut buf = [0u8; 32];
    for (id, line) in [(0, "0 0 1"), (7, "7 7 1"), (1000, "1000 1000 1"), (u32::MAX, "4294967295 4294967295 1")] {
        assert_eq!(map_line(id, &mut buf), line.as_bytes());
    }
}

#[test]
fn layers_are_named_in_order() {
    assert_eq!(Layers::NONE.to_string(), "none");
    assert_eq!(Layers::ALL.to_string(), "no-new-privs,netns,no-caps,landlock,seccomp");
    assert_eq!(Layers::of(&[Layer::Seccomp, Layer::NetworkNamespace]).to_string(), "netns,seccomp");
    assert!(Layer::ALL.iter().all(|&l| Layers::ALL.contains(l) && !Layers::NONE.contains(l)));
    assert!(!Layers::BEFORE_EXEC.contains(Layer::Seccomp));
}

/// The test binary again, as the child test `child` below, confined in `layers` (seccomp
/// entered by the child itself, as an executor does), as `user` when given; it runs until its
/// input closes. Its output, and the layers it was in as it ran.
fn confined_child(child: &str, layers: Layers, user: Option<u32>, env: &[(&str, &str)]) -> (String, Layers) {
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command
        .args(["--exact", &format!("sandbox::tests::{child}"), "--include-ignored", "--nocapture"])
        .env("DJINN_SANDBOX_TEST_SECCOMP", if layers.contains(Layer::Seccomp) { "1" } else { "0" })
        .envs(env.iter().copied());
    if let Some(id) = user {
        command.uid(id).gid(id);
    }
    let confined = confine_in(&mut command, layers);
    let mut child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("the child starts");
    let mut entered = confined.entered();
    let mut out = String::new();
    let mut stdout = child.stdout.take().expect("its output");
    // Its first line says it is set (seccomp entered): /proc shows its layers then.
    let mut byte = [0u8; 1];
    while stdout.read(&mut byte).expect("its output") == 1 {
        out.push(byte[0] as char);
        if byte[0] == b'\n' && out.contains("set\n") {
            break;
        }
    }
    let shown = layers_of(child.id());
    if shown.contains(Layer::Seccomp) {
        entered = entered.with(Layer::Seccomp);
    }
    drop(child.stdin.take());
    stdout.read_to_string(&mut out).expect("its output");
    let status = child.wait().expect("the child ends");
    assert!(status.success(), "in {layers}: {out}");
    // What /proc shows of the layers asked for agrees with what the child reported (a user
    // other than root has no capabilities, asked or not).
    for layer in [Layer::NoNewPrivileges, Layer::NetworkNamespace, Layer::NoCapabilities]
        .into_iter()
        .filter(|&l| layers.contains(l))
    {
        assert_eq!(
            shown.contains(layer),
            entered.contains(layer),
            "{layer} in {layers}: shown {shown}, reported {entered}"
        );
    }
    (out, entered)
}

/// A child confined as an executor process is: it reaches the host's listener before, and not
/// after. As this user, and (when this is root) as one without the right to make a network
/// namespace directly, who makes it inside a user namespace.
#[test]
fn a_confined_process_reaches_no_listener_of_the_host() {
    // SAFETY: geteuid cannot fail.
    let users: &[Option<u32>] = if unsafe { libc::geteuid() } == 0 { &[None, Some(65534)] } else { &[None] };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let address = listener.local_addr().expect("its address").to_string();
    assert!(std::net::TcpStream::connect(&address).is_ok(), "reachable unconfined");
    for &user in users {
        let (said, entered) =
            confined_child("child_connects", Layers::of(&[Layer::NetworkNamespace]), user, &[("TO", &address)]);
        assert!(said.contains("connect: refused"), "as {user:?}: no listener of the host's is reachable: {said}");
        assert!(entered.contains(Layer::NetworkNamespace), "as {user:?}: {entered}");
        let (_, entered) = confined_child("child_connects", Layers::ALL, user, &[("TO", &address)]);
        assert_eq!(entered, Layers::ALL, "as {user:?}: every layer entered");
    }
}

#[test]
#[ignore = "the child process of the test above"]
fn child_connects() {
    child_set();
    let address = std::env::var("TO").expect("started by the test above");
    match std::net::TcpStream::connect(&address) {
        Ok(_) => println!("connect: connected"),
        Err(e) => println!("connect: refused ({e})"),
    }
    std::io::stdin().read_to_end(&mut Vec::new()).expect("its input");
}

/// Enters the seccomp filter when the parent asks, then says it is set.
fn child_set() {
    if std::env::var("DJINN_SANDBOX_TEST_SECCOMP").as_deref() == Ok("1") {
        restrict_syscalls().expect("the filter installs");
    }
    println!("set");
}

/// What a compromised executor would try first, each tried by a child in no layer, in each
/// layer alone and in all: every attempt succeeds in none and fails in all, and each is
/// refused by the layers named here.
#[test]
fn each_escape_is_refused_and_the_test_names_the_layers_that_refuse_it() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let address = listener.local_addr().expect("its address").to_string();
    let dir = std::env::temp_dir().join(format!("djinn-sandbox-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory to write in");
    let dir_name = dir.to_string_lossy().into_owned();
    let attempts = |layers: Layers| -> BTreeMap<String, bool> {
        let (said, entered) = confined_child("child_escapes", layers, None, &[("TO", &address), ("DIR", &dir_name)]);
        assert_eq!(
            entered,
            layers.with(Layer::NoNewPrivileges),
            "entered what was asked (and no new privileges, always)"
        );
        let results: BTreeMap<String, bool> = said
            .lines()
            .filter_map(|line| line.split_once(": "))
            .filter(|(_, result)| result.starts_with("done") || result.starts_with("refused"))
            .map(|(what, result)| (what.to_owned(), result.starts_with("refused")))
            .collect();
        assert_eq!(results.len(), 5, "every attempt reported: {said}");
        results
    };
    let unconfined = attempts(Layers::NONE);
    assert!(unconfined.values().all(|refused| !refused), "nothing refused outside the sandbox: {unconfined:?}");
    let confined = attempts(Layers::ALL);
    assert!(confined.values().all(|&refused| refused), "everything refused inside: {confined:?}");
    let mut refused_by: BTreeMap<String, Vec<Layer>> = BTreeMap::new();
    for layer in [Layer::NetworkNamespace, Layer::NoCapabilities, Layer::Landlock, Layer::Seccomp] {
        for (what, refused) in attempts(Layers::of(&[layer])) {
            let layers = refused_by.entry(what).or_default();
            if refused {
                layers.push(layer);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("refused by: {refused_by:?}");
    use Layer::*;
    let expected: BTreeMap<String, Vec<Layer>> = [
        ("open a socket", vec![Seccomp]),
        ("connect to the host", vec![NetworkNamespace, Landlock, Seccomp]),
        ("write a file", vec![Landlock]),
        ("exec a program", vec![Seccomp]),
        ("signal the node", vec![Landlock, Seccomp]),
    ]
    .into_iter()
    .map(|(what, layers)| (what.to_owned(), layers))
    .collect();
    assert_eq!(refused_by, expected);
}

#[test]
#[ignore = "the child process of the test above"]
fn child_escapes() {
    child_set();
    let say = |what: &str, result: std::io::Result<()>| match result {
        Ok(()) => println!("{what}: done"),
        Err(e) => println!("{what}: refused ({e})"),
    };
    // SAFETY: socket and close with integer arguments.
    say("open a socket", unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        if fd < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            libc::close(fd);
            Ok(())
        }
    });
    let to = std::env::var("TO").expect("started by the test above");
    say("connect to the host", std::net::TcpStream::connect(&to).map(drop));
    let dir = std::env::var("DIR").expect("started by the test above");
    let file = std::path::Path::new(&dir).join(format!("escaped-{}", std::process::id()));
    say("write a file", std::fs::write(&file, b"out"));
    say("exec a program", Command::new("/bin/true").status().map(drop));
    // SAFETY: getppid and kill (signal 0: only whether it may be signalled) cannot harm.
    say("signal the node", unsafe {
        match libc::kill(libc::getppid(), 0) {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    });
    std::io::stdin().read_to_end(&mut Vec::new()).expect("its input");
}
