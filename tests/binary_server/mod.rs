//! The real `shelfserve` binary as a child process: started on free ports with the default
//! model, its log drained and echoed, its lane addresses read from the log, `/health` awaited;
//! killed when dropped. Also the Python interpreter the client tests use.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::e2e_http::Target;

/// Bound on starting a server; nothing is measured against it.
const PATIENCE: Duration = Duration::from_secs(300);

/// `$SHELFSERVE_PYTHON` or `python3`.
pub fn python() -> String {
    std::env::var("SHELFSERVE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether `python()` can import every module in `modules`.
pub fn python_has(modules: &[&str]) -> bool {
    let code = format!("import {}", modules.join(", "));
    Command::new(python()).args(["-c", &code]).output().map(|o| o.status.success()).unwrap_or(false)
}

/// A running `shelfserve serve`, killed when dropped.
pub struct Server {
    child: Child,
    lanes: Vec<(String, SocketAddr)>,
}

impl Server {
    pub fn start(model: &Path, served_name: &str, extra: &[&str], label: &'static str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--device", "cpu", "--host", "127.0.0.1", "--lane-port", "voice=0,agent=0"])
            .args(["--served-model-name", served_name])
            .args(extra)
            .env("SHELFSERVE_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the shelfserve binary");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        // Drain the log for the whole life of the server (a full pipe would block it), echoing
        // it and reporting each lane's address as it binds.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let line = strip_ansi(&line);
                eprintln!("[{label}] {line}");
                if let Some(lane) = parse_lane(&line) {
                    let _ = tx.send(lane);
                }
            }
        });
        let mut server = Server { child, lanes: Vec::new() };
        let deadline = Instant::now() + PATIENCE;
        while server.lanes.len() < 2 {
            if let Some(status) = server.child.try_wait().expect("poll the server") {
                panic!("{label}: shelfserve exited with {status} before listening");
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(lane) => server.lanes.push(lane),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    assert!(Instant::now() < deadline, "{label}: no listening address within {PATIENCE:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{label}: the server's log ended"),
            }
        }
        // /health turns 200 once the model is loaded (503 before).
        let target = Target::new(server.addr("voice"), PATIENCE);
        loop {
            if let Some(status) = server.child.try_wait().expect("poll the server") {
                panic!("{label}: shelfserve exited with {status} while loading");
            }
            match target.get("/health") {
                Ok(r) if r.status == 200 => break,
                Ok(r) => assert!(r.status == 503, "{label}: /health answered {}: {}", r.status, r.text()),
                Err(e) => panic!("{label}: /health: {e}"),
            }
            assert!(Instant::now() < deadline, "{label}: not ready within {PATIENCE:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn addr(&self, lane: &str) -> SocketAddr {
        self.lanes.iter().find(|(l, _)| l == lane).map(|(_, a)| *a).unwrap_or_else(|| panic!("no lane {lane}"))
    }

    pub fn url(&self, lane: &str) -> String {
        format!("http://{}/v1", self.addr(lane))
    }

    /// An HTTP target on `lane`.
    pub fn target(&self, lane: &str) -> Target {
        Target::new(self.addr(lane), PATIENCE)
    }

    /// Send `sig` to the server process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child's pid.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0, "kill({sig})");
    }

    /// Its exit status, once it exits (failing if that takes longer than `within`).
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the server") {
                return status;
            }
            assert!(Instant::now() < deadline, "the server did not exit within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `… serving the OpenAI API on http://127.0.0.1:PORT/v1 lane=NAME` → (NAME, address).
fn parse_lane(line: &str) -> Option<(String, SocketAddr)> {
    let rest = line.split("serving the OpenAI API on http://").nth(1)?;
    let addr: SocketAddr = rest.split('/').next()?.parse().ok()?;
    let lane = line.split("lane=").nth(1)?.split_whitespace().next()?.trim_matches('"').to_owned();
    Some((lane, addr))
}
