//! Machinery of the bad-input battery (`tests/tests/hardening.rs`, issue 9).
//!
//! Every case of a surface runs in a *supervised child process* (the test binary itself,
//! re-run on one `#[test]` with an environment variable naming the surface and the first
//! case), under an address-space limit, so that what the battery hunts for cannot take
//! the whole test run (or the machine) down with it:
//!
//! - a panic is caught in the child (`catch_unwind`, a quiet panic hook records its
//!   message and location) and reported as a failure of that case;
//! - an abort or a signal (an allocation refused by the limit, a stack overflow, a
//!   segfault) kills the child: the parent records the case that was running as a failure
//!   (with the child's exit status and the tail of its stderr) and starts a new child at
//!   the next case;
//! - a hang: no result within the per-case timeout; the parent kills the child, records
//!   the case and goes on.
//!
//! The child writes one line per case start and one per verdict on stdout, prefixed with
//! [`MARK`]; the parent reads them and keeps the verdicts, then [`Summary`] groups them
//! (pass categories, failure classes with repro descriptions) for the test's output.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tessera_dsl::KernelError;

/// The prefix of protocol lines.
pub const MARK: &str = "@@HARDENING";
/// The environment variable that turns a test-binary run into a battery child:
/// `<surface>:<first case>`.
pub const CHILD_ENV: &str = "TESSERA_HARDENING_CHILD";
/// The environment variable that marks a child running one isolated test.
pub const ISOLATED_ENV: &str = "TESSERA_HARDENING_ISOLATED";
/// Address-space limit of every child (KiB): large enough for the test binary and small
/// cases, small enough that a runaway allocation fails instead of filling the machine.
pub const CHILD_MEMORY_KIB: u64 = 3 << 20;

/// The outcome of one case.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// As it should be: `category` (`ok`, `clean-error`, `rejected-valid`, ...) and a detail
    /// (e.g. the error's rule) for the counts.
    Pass(String, String),
    /// Not as it should be: the failure class and what happened.
    Fail(String, String),
}

impl Verdict {
    pub fn pass(category: &str, detail: impl Into<String>) -> Verdict {
        Verdict::Pass(category.to_string(), detail.into())
    }

    pub fn fail(class: &str, detail: impl Into<String>) -> Verdict {
        Verdict::Fail(class.to_string(), detail.into())
    }

    pub fn is_fail(&self) -> bool {
        matches!(self, Verdict::Fail(..))
    }
}

/// Whether `e` is a clear error: it names the kernel/op, the subject (operand,
/// instruction...), a rule id, and says what happened. `Err(why not)` otherwise.
pub fn clear_error(e: &KernelError) -> Result<(), String> {
    let mut missing = Vec::new();
    if e.kernel.trim().is_empty() {
        missing.push("kernel/op name");
    }
    if e.subject.trim().is_empty() {
        missing.push("subject (operand)");
    }
    if e.rule.trim().is_empty() {
        missing.push("rule id");
    }
    if e.message.trim().is_empty() {
        missing.push("message");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("error lacks {}: {e}", missing.join(", ")))
    }
}

/// Rules whose help says the error is a bug of Tessera itself: a user input must never
/// reach them.
pub fn is_internal(e: &KernelError) -> bool {
    matches!(e.rule, "plan-consistency" | "malformed-ir" | "op-schema" | "op-alias" | "op-plan" | "no-reference") || e.help.contains("report this as a Tessera bug") || e.help.contains("library bug")
}

// ---- panics -------------------------------------------------------------------------------------

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Replaces the panic hook (once per process) by one that records the message and
/// location for [`catch`] instead of printing them; panics outside [`catch`] (a failing
/// assertion of a test) still print.
pub fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = if let Some(s) = info.payload().downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = info.payload().downcast_ref::<String>() {
                s.clone()
            } else {
                "<non-string panic payload>".to_string()
            };
            let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
            let catching = CATCHING.with(|c| *c.borrow());
            if catching > 0 {
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("panicked{at}: {msg}")));
            } else {
                default(info);
            }
        }));
    });
}

thread_local! {
    /// How many [`catch`]es are running on this thread (they nest).
    static CATCHING: RefCell<usize> = const { RefCell::new(0) };
}

/// Runs `f`, turning a panic into `Err(message and location)`.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    quiet_panics();
    CATCHING.with(|c| *c.borrow_mut() += 1);
    LAST_PANIC.with(|p| *p.borrow_mut() = None);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| *c.borrow_mut() -= 1);
    r.map_err(|_| LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| "panicked (no message)".to_string()))
}

// ---- the child side -----------------------------------------------------------------------------

/// In a battery child for `surface`: the first case to run.
pub fn child_start(surface: &str) -> Option<usize> {
    let v = std::env::var(CHILD_ENV).ok()?;
    let (s, start) = v.split_once(':')?;
    (s == surface).then(|| start.parse().ok()).flatten()
}

/// Whether this process is a battery child of any surface (its other tests do nothing).
pub fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some() || std::env::var_os(ISOLATED_ENV).is_some()
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n").replace('\r', "")
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(o) => out.push(o),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The child's loop: runs cases `start..total` with `run`, each under [`catch`], writing
/// the protocol lines.
pub fn child_loop(start: usize, total: usize, run: impl Fn(usize) -> Verdict) {
    quiet_panics();
    let stdout = std::io::stdout();
    for i in start..total {
        {
            let mut o = stdout.lock();
            let _ = writeln!(o, "{MARK} S {i}");
            let _ = o.flush();
        }
        let verdict = match catch(|| run(i)) {
            Ok(v) => v,
            Err(p) => Verdict::fail("panic", p),
        };
        let (tag, cat, detail) = match &verdict {
            Verdict::Pass(c, d) => ("P", c.as_str(), d.as_str()),
            Verdict::Fail(c, d) => ("F", c.as_str(), d.as_str()),
        };
        let mut o = stdout.lock();
        let _ = writeln!(o, "{MARK} D {i} {tag} {} {}", escape(cat).replace(' ', "_"), escape(detail));
        let _ = o.flush();
    }
    let mut o = stdout.lock();
    let _ = writeln!(o, "{MARK} END");
    let _ = o.flush();
}

// ---- the parent side ----------------------------------------------------------------------------

/// A command that runs `program args` under the child memory limit (`ulimit -v`).
pub fn limited(program: &std::path::Path, args: &[String], kib: u64) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c").arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\"")).arg(program).args(args);
    c
}

/// A signal or exit code in words.
pub fn status_text(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s} ({})", signal_name(s)),
        _ => "unknown status".into(),
    }
}

pub fn signal_name(s: i32) -> &'static str {
    match s {
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        7 => "SIGBUS",
        8 => "SIGFPE",
        4 => "SIGILL",
        _ => "signal",
    }
}

fn tail(s: &str, n: usize) -> String {
    let s = s.trim();
    let start = s.char_indices().rev().nth(n).map_or(0, |(i, _)| i);
    s[start..].to_string()
}

/// Runs cases `0..total` of `surface` in supervised children of the test binary (each
/// started on test `test_name`), restarting after a crash or a hang. Returns one verdict
/// per case.
pub fn supervise(test_name: &str, surface: &str, total: usize, timeout: Duration) -> Vec<Verdict> {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut verdicts: Vec<Option<Verdict>> = vec![None; total];
    let mut next = 0;
    let mut restarts = 0;
    while next < total {
        let args: Vec<String> = [test_name, "--exact", "--nocapture", "--test-threads=1"].iter().map(|s| s.to_string()).collect();
        let mut child = limited(&exe, &args, CHILD_MEMORY_KIB)
            .env(CHILD_ENV, format!("{surface}:{next}"))
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn a battery child");
        let (tx, rx) = mpsc::channel::<String>();
        let out = child.stdout.take().expect("child stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if line.starts_with(MARK) && tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut err_pipe = child.stderr.take().expect("child stderr");
        let err_thread = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err_pipe.read_to_string(&mut s);
            s
        });
        let mut current: Option<usize> = None;
        let mut deadline = Instant::now() + timeout * 4; // start-up
        let mut ended = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let rest = line[MARK.len()..].trim_start();
                    if let Some(i) = rest.strip_prefix("S ") {
                        current = i.trim().parse().ok();
                        deadline = Instant::now() + timeout;
                    } else if let Some(d) = rest.strip_prefix("D ") {
                        let mut parts = d.splitn(4, ' ');
                        let i: usize = parts.next().and_then(|s| s.parse().ok()).unwrap_or(usize::MAX);
                        let tag = parts.next().unwrap_or("F");
                        let cat = unescape(parts.next().unwrap_or("?"));
                        let detail = unescape(parts.next().unwrap_or(""));
                        if i < total {
                            verdicts[i] = Some(if tag == "P" { Verdict::Pass(cat, detail) } else { Verdict::Fail(cat, detail) });
                            next = i + 1;
                        }
                        current = None;
                    } else if rest.starts_with("END") {
                        ended = true;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let at = current.unwrap_or(next);
                    if at < total {
                        verdicts[at] = Some(Verdict::fail("hang", format!("no result after {:.0} s (child killed)", timeout.as_secs_f64())));
                    }
                    next = at + 1;
                    break;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait().expect("wait for the child");
                    let stderr = err_thread.join().unwrap_or_default();
                    if !ended {
                        let at = current.unwrap_or(next);
                        if at < total {
                            let class = if status.success() { "child-exit" } else { "abort" };
                            verdicts[at] = Some(Verdict::fail(class, format!("the process died: {}; stderr: {}", status_text(&status), tail(&stderr, 600))));
                        }
                        next = at + 1;
                    }
                    break;
                }
            }
        }
        if ended {
            let _ = child.wait();
            break;
        }
        restarts += 1;
        assert!(restarts < total + 10, "too many child restarts");
    }
    verdicts.into_iter().enumerate().map(|(i, v)| v.unwrap_or_else(|| Verdict::fail("lost", format!("case {i} has no verdict")))).collect()
}

/// Runs `body` as the named test in a supervised child (so that an abort, a signal or
/// a hang is a test failure rather than the end of the test run), or directly when this
/// process is that child. `test_name` is the libtest name (`module::test`).
pub fn isolated(test_name: &str, timeout: Duration, body: impl FnOnce()) {
    if std::env::var_os(ISOLATED_ENV).is_some() {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let args: Vec<String> = [test_name, "--exact", "--nocapture", "--test-threads=1"].iter().map(|s| s.to_string()).collect();
    let mut child = limited(&exe, &args, CHILD_MEMORY_KIB)
        .env(ISOLATED_ENV, "1")
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn an isolated test");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("poll the child") {
            break Some(s);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (t_out.join().unwrap_or_default(), t_err.join().unwrap_or_default());
    let stdout: String = stdout.lines().filter(|l| !l.starts_with("running ") && !l.starts_with("test result") && !l.trim().is_empty()).collect::<Vec<_>>().join("\n");
    match status {
        None => panic!("HANG: `{test_name}` gave no result within {:.0} s (killed)\n{stdout}\n{}", timeout.as_secs_f64(), tail(&stderr, 1500)),
        Some(s) if s.success() => {
            print!("{}", stdout.lines().filter(|l| !l.starts_with("test ")).collect::<Vec<_>>().join("\n"));
        }
        Some(s) => {
            let how = if s.code() == Some(101) { "FAILED (assertion or panic)".to_string() } else { format!("CRASHED: {}", status_text(&s)) };
            panic!("{how} in `{test_name}`\n--- stdout ---\n{stdout}\n--- stderr ---\n{}", tail(&stderr, 3000));
        }
    }
}

// ---- the summary --------------------------------------------------------------------------------

/// Counts and failure groups of a surface's verdicts.
pub struct Summary {
    pub surface: String,
    pub total: usize,
    pub passes: BTreeMap<String, usize>,
    pub pass_details: BTreeMap<String, usize>,
    /// Failure class -> (case index, description, detail).
    pub failures: BTreeMap<String, Vec<(usize, String, String)>>,
    pub elapsed: Duration,
}

impl Summary {
    pub fn new(surface: &str, verdicts: &[Verdict], describe: impl Fn(usize) -> String, elapsed: Duration) -> Summary {
        let mut s = Summary { surface: surface.to_string(), total: verdicts.len(), passes: BTreeMap::new(), pass_details: BTreeMap::new(), failures: BTreeMap::new(), elapsed };
        for (i, v) in verdicts.iter().enumerate() {
            match v {
                Verdict::Pass(c, d) => {
                    *s.passes.entry(c.clone()).or_default() += 1;
                    if !d.is_empty() {
                        *s.pass_details.entry(format!("{c}: {d}")).or_default() += 1;
                    }
                }
                Verdict::Fail(c, d) => s.failures.entry(c.clone()).or_default().push((i, describe(i), d.clone())),
            }
        }
        s
    }

    pub fn failed(&self) -> usize {
        self.failures.values().map(Vec::len).sum()
    }

    /// The report: one summary line, pass categories, every failure class with up to
    /// `examples` repros.
    pub fn report(&self, examples: usize) -> String {
        let mut r = format!(
            "hardening[{}]: {} generated cases in {:.1} s: {} passed, {} FAILED\n",
            self.surface,
            self.total,
            self.elapsed.as_secs_f64(),
            self.total - self.failed(),
            self.failed()
        );
        let passes: Vec<String> = self.passes.iter().map(|(c, n)| format!("{c} {n}")).collect();
        r += &format!("  passed: {}\n", passes.join(", "));
        let mut details: Vec<(&String, &usize)> = self.pass_details.iter().collect();
        details.sort_by(|a, b| b.1.cmp(a.1));
        let top: Vec<String> = details.iter().take(25).map(|(d, n)| format!("{d} x{n}")).collect();
        if !top.is_empty() {
            r += &format!("  most frequent passing outcomes: {}\n", top.join("; "));
        }
        for (class, cases) in &self.failures {
            r += &format!("  FAIL {class}: {} cases\n", cases.len());
            // Group by the first line of the detail, so distinct bugs show up.
            let mut seen: BTreeMap<String, usize> = BTreeMap::new();
            let mut shown = 0;
            for (i, desc, detail) in cases {
                let key: String = detail.lines().next().unwrap_or("").chars().filter(|c| !c.is_ascii_digit()).take(90).collect();
                let n = seen.entry(key).or_default();
                *n += 1;
                if *n == 1 && shown < examples {
                    shown += 1;
                    r += &format!("    #{i}: {desc}\n      -> {}\n", detail.replace('\n', "\n         "));
                }
            }
            if seen.len() > shown {
                r += &format!("    ({} distinct messages, {} shown)\n", seen.len(), shown);
            }
        }
        r
    }

    /// Prints the report, writes it to `<dir>/hardening-<surface>.txt`, and panics if any
    /// case failed.
    pub fn finish(&self, dir: &str) {
        let report = self.report(12);
        println!("{report}");
        let path = std::path::Path::new(dir).join(format!("hardening-{}.txt", self.surface));
        let _ = std::fs::write(&path, self.report(1000));
        assert_eq!(self.failed(), 0, "{} of {} {} cases failed (full list: {})\n{report}", self.failed(), self.total, self.surface, path.display());
    }
}
