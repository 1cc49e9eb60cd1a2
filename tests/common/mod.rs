//! Shared helpers for integration tests: start the real `netblk` binary, find the
//! addresses it listens on, run real clients, and clean up even when a test fails.
#![allow(dead_code)]

pub mod raw;
pub mod workload;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running `netblk serve`, killed on drop.
pub struct Server {
    child: Option<Child>,
    /// Every address it reported, in order (`127.0.0.1:PORT` or `unix:PATH`).
    pub listeners: Vec<String>,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `netblk serve ARGS`; adds `--listen 127.0.0.1:0` unless ARGS has `--listen`
    /// or `--config`. Waits for every listener to be reported.
    pub fn start(args: &[&str]) -> Server {
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let mut expected = args.iter().filter(|a| *a == "--listen").count();
        if expected == 0 && !args.iter().any(|a| a == "--config") {
            args.insert(0, "127.0.0.1:0".into());
            args.insert(0, "--listen".into());
            expected = 1;
        }
        Server::start_expecting(&args, expected.max(1))
    }

    /// Starts `netblk serve ARGS` and waits for `expected` listener lines.
    pub fn start_expecting(args: &[String], expected: usize) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let stderr_path = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("stderr log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_netblk"))
            .arg("serve")
            .args(args)
            .env("NETBLK_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start netblk");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut listeners = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while listeners.len() < expected {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix("listening on ") {
                        listeners.push(addr.to_string());
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait().ok();
                    let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                    panic!("netblk did not report {expected} listeners (exit {status:?}); stderr:\n{log}");
                }
            }
        }
        Server {
            child: Some(child),
            listeners,
            stderr_path,
            _dir: dir,
        }
    }

    /// The first TCP listener, as `127.0.0.1:PORT`.
    pub fn tcp(&self) -> &str {
        self.listeners
            .iter()
            .find(|l| !l.starts_with("unix:"))
            .expect("a TCP listener")
    }

    /// `nbd://HOST:PORT/NAME` for the first TCP listener.
    pub fn uri_for(&self, export: &str) -> String {
        format!("nbd://{}/{}", self.tcp(), export)
    }

    /// `nbd://HOST:PORT` (the default export).
    pub fn uri(&self) -> String {
        format!("nbd://{}", self.tcp())
    }

    /// Process id, for signals.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Everything the server logged so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends a signal by name (`TERM`, `INT`, `KILL`) to the server.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{name} failed");
    }

    /// Waits up to `timeout` for the server to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits for a clean exit.
    pub fn stop(mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait_exit(Duration::from_secs(30))
            .expect("netblk exits after SIGTERM")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether a client program is installed. Under CI (`CI` set) a missing client is a
/// failure rather than a skip, so a green run always means the client really ran.
pub fn have(program: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("{program} is not installed; scripts/test.sh installs it");
        }
        eprintln!("skipping: {program} is not installed (scripts/test.sh installs it)");
    }
    found
}

/// Starts `netblk serve ARGS` for a test that drives `tool`; `None` (skip) when the tool
/// is missing outside CI, as [`have`] decides.
pub fn server_for(tool: &str, args: &[&str]) -> Option<Server> {
    have(tool).then(|| Server::start(args))
}

/// Runs a command, failing the test with its output unless it succeeds.
pub fn run(cmd: &mut Command) -> Output {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        output.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs a command and returns its stdout as text.
pub fn run_stdout(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(cmd).stdout).into_owned()
}

/// Runs a Python snippet with the system interpreter (which has `import nbd`).
pub fn python(script: &str, args: &[&str]) -> String {
    run_stdout(
        Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .args(args),
    )
}

/// Writes `len` bytes of deterministic pseudo-random data to `path`.
pub fn pattern_file(path: &Path, len: usize, seed: u64) {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut data = vec![0u8; len];
    for chunk in data.chunks_mut(8) {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let bytes = state.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    std::fs::write(path, data).expect("write pattern file");
}

/// Reads all of a file.
pub fn read_all(path: &Path) -> Vec<u8> {
    let mut data = Vec::new();
    std::fs::File::open(path)
        .expect("open")
        .read_to_end(&mut data)
        .expect("read");
    data
}

/// What a `--metrics` endpoint at `addr` answers `GET /metrics` with, its HTTP head
/// included; panics if the answer does not come within 5 s.
pub fn scrape_metrics(addr: &str) -> String {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .expect("the metrics within 5 s");
    text
}
