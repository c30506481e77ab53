#!/usr/bin/env python3
"""Real TPU compiler oracle: compile StableHLO modules (holding a Mosaic
`tpu_custom_call`) for a compile-only TPU topology, with no TPU attached.

Usage:
  python tpu_compile.py --target v5e [--target v6e ...] FILE.stablehlo.mlir [...]
  python tpu_compile.py --target v5e,v6e,tpu7x FILES...
  python tpu_compile.py --target v5e @LIST     # LIST: one argument (file) per line
  python tpu_compile.py --serve            # JSON-lines requests on stdin
  python tpu_compile.py --list-targets

Output: one JSON line per (file, target):
  {"file": ..., "target": ..., "ok": bool, "error": str|null, "seconds": float}
Exit status 0 iff every compile succeeded (2 on usage errors).

--serve protocol: each stdin line is either JSON {"file": PATH, "target": T}
(optionally "text": MODULE_TEXT instead of "file", "id": anything echoed
back, and with --profile "static_profile": false, as --llo-only) or plain text
"TARGET PATH". One JSON result line per request, flushed.

Design: the parent process imports nothing heavy. For each target it starts
one worker child (this script with --worker) that imports jax once, builds
the compile-only topology and then compiles files sequentially. libtpu may
SIGSEGV/abort on malformed Mosaic, so a worker death or timeout is reported
as a rejection of the file being compiled ("ok": false, error says the
signal) and the worker is restarted for the remaining files.

Self-test: TPU_COMPILE_TEST_CRASH=SUBSTR makes a worker SIGSEGV itself on any
file whose path contains SUBSTR (exercises the crash/restart path).

Environment: workers need jax/jaxlib 0.10.2 + libtpu 0.0.52. They run under
$TPU_COMPILE_PYTHON, else <repo>/.venv/bin/python, else sys.executable; the
parent itself needs only the standard library (any python3 works). --mosaic-dump DIR sets
LIBTPU_INIT_ARGS=--xla_mosaic_dump_to=DIR for the workers.

--profile adds libtpu's static LLO profile to each result (DESIGN.md section 9): workers
dump the final VLIW bundles and the static profile of every compile into a private
directory, read them and clear it. The result gains
  "profile": {"ops": [{"name", "cycles", "bundles", "custom_call", "vector_spills",
                       "scalar_spills", "vmem_bytes"}, ...]}
one entry per HLO op the compiler estimated: the tpu_custom_call ("custom_call": true) and
whatever XLA adds around it (layout copies). "cycles" is the profile's estimated_cycles
(its cost model over the scheduled bundles, every grid step); "bundles" counts the op's
final bundles; spills count vector (VMEM) and scalar (SMEM) spill loads and stores;
"vmem_bytes" is the end of the op's highest VMEM allocation, spill slots included.
Where the profiler itself aborts (it does on some kernels that compile without it), the
verdict comes from a compile without it, whose ops are as --llo-only's below, and the profile
says why: {"ops": [...], "error": ...}.
--llo-only FILE (repeatable) profiles FILE without the static estimate: its ops have
"cycles": null and the bundles, spills and VMEM of the LLO text. For kernels whose estimate
is blind anyway (a grid dim whose trip count is data: megablox-style gmm), where libtpu's
profiler spends a minute or more on a kernel that compiles in 0.3 s.
"""
import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TOPOLOGIES = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "tpu7x": "tpu7x:2x2x1",
}
DEFAULT_TIMEOUT = 120.0
STARTUP_TIMEOUT = 60.0  # jax import + topology; not charged to --timeout


def topology_for(target):
    if ":" in target:
        return target
    if target not in TOPOLOGIES:
        raise SystemExit(f"unknown target {target!r}; known: {', '.join(TOPOLOGIES)}"
                         " (or pass a full topology name such as v5e:2x2)")
    return TOPOLOGIES[target]


# --------------------------------------------------------------------------
# Error-message trimming
# --------------------------------------------------------------------------

_NOISE_PREFIXES = ("=== Source Location Trace", "learning/", "third_party/",
                   "platforms/", "tensorflow/", "xla/", "@")


def trim_error(msg, limit=2000):
    """Keep the useful part of an XLA/Mosaic exception message."""
    lines = []
    for line in str(msg).splitlines():
        s = line.strip()
        if not s or s.startswith(_NOISE_PREFIXES):
            continue
        lines.append(line.rstrip())
    out = "\n".join(lines)
    if len(out) > limit:
        out = out[:limit] + " ...[truncated]"
    return out


# --------------------------------------------------------------------------
# The static LLO profile (--profile)
# --------------------------------------------------------------------------

_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|0)\s")
_FINAL = re.compile(r"^\d+-(.+?)-(\d+)-final_bundles\.txt$")
_STAGE = re.compile(r"^\d+-(.+?)-(\d+)-[^/]*\.txt$")
_SPILL = re.compile(r"\b(vld|vst|sld|sst)[a-z0-9.]*\s+\[(?:vmem|smem):\[#allocation\d+_spill")
_VMEM_ALLOC = re.compile(r"space=vmem, size = (0x[0-9a-f]+|\d+), offset = (0x[0-9a-f]+|\d+)")
_ESTIMATE = re.compile(r'hlo_op_name:\s*"([^"]*)"\s*estimated_cycles:\s*(\d+)')


def read_profile(llo_dir, profile_dir):
    """The profile of the compile that just wrote llo_dir and profile_dir (see --profile)."""
    estimates = {}
    for f in os.listdir(profile_dir) if profile_dir else []:
        with open(os.path.join(profile_dir, f)) as fh:
            for name, cycles in _ESTIMATE.findall(fh.read()):
                estimates[name] = int(cycles)
    finals, stages = {}, {}
    for f in os.listdir(llo_dir):
        m = _FINAL.match(f)
        if m and "schedule-analysis" not in f:
            finals[m.group(1)] = f
        m = _STAGE.match(f)
        if m:
            stages.setdefault(m.group(1), []).append((int(m.group(2)), f))
    if not profile_dir:
        # LLO text only (--llo-only): every HLO op with final bundles, no estimate (not the
        # program's own regions: `TLP`, `<late-initialization>`, ...).
        estimates = {name: None for name in finals if name != "TLP" and not name.startswith("<")}
    ops = []
    for name, cycles in estimates.items():
        op = {"name": name, "cycles": cycles, "bundles": None, "custom_call": False,
              "vector_spills": None, "scalar_spills": None, "vmem_bytes": None}
        if name in finals:
            with open(os.path.join(llo_dir, finals[name])) as fh:
                text = fh.read()
            op["bundles"] = sum(1 for line in text.splitlines() if _BUNDLE.match(line))
            op["custom_call"] = "= custom-call(" in text
            kinds = _SPILL.findall(text)
            op["vector_spills"] = sum(k in ("vld", "vst") for k in kinds)
            op["scalar_spills"] = sum(k in ("sld", "sst") for k in kinds)
            # The last stage that still lists the allocations (offsets are final by then).
            for _, f in sorted(stages.get(name, []), reverse=True):
                with open(os.path.join(llo_dir, f)) as fh:
                    allocs = _VMEM_ALLOC.findall(fh.read())
                if allocs:
                    op["vmem_bytes"] = max(int(sz, 0) + int(off, 0) for sz, off in allocs)
                    break
        ops.append(op)
    return {"ops": ops}


def profile_dirs(base, static=True):
    """Fresh `llo` and `profile` folders under `base`, and the libtpu flags that dump a
    compile's final bundles and static profile into them (read back by read_profile).
    Without `static`, only the bundles (the profile folder is None)."""
    llo = os.path.join(base, "llo")
    os.makedirs(llo)
    flags = f"--xla_jf_dump_to={llo} --xla_jf_dump_llo_text"
    if not static:
        return llo, None, flags
    prof = os.path.join(base, "profile")
    os.makedirs(prof)
    return llo, prof, flags + f" --xla_jf_dump_static_llo_profile_to={prof}"


def add_libtpu_flags(flags):
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()


def clear_dir(d):
    for f in os.listdir(d):
        p = os.path.join(d, f)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


# --------------------------------------------------------------------------
# Worker (child process): imports jax, compiles requests from a pipe.
# --------------------------------------------------------------------------

def worker_main(target):
    # Protocol goes over a private dup of stdout; fd 1 is pointed at stderr so
    # that anything libtpu prints cannot corrupt the protocol stream.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    t0 = time.time()
    profile = None
    if os.environ.get("TPU_COMPILE_PROFILE"):
        # libtpu reads its flags once, at import: this worker's own dump directories.
        base = tempfile.mkdtemp(prefix=f"llo-{target}-", dir=os.environ["TPU_COMPILE_PROFILE"])
        llo, prof, flags = profile_dirs(base, os.environ.get("TPU_COMPILE_STATIC_PROFILE") != "0")
        profile = (llo, prof)
        add_libtpu_flags(flags)
    try:
        import numpy as np
        from jax.experimental import topologies
        from jax._src import compiler
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client as xc
        from jax._src.lib.mlir import ir
        topo = topologies.get_topology_desc(topology_name=topology_for(target),
                                            platform="tpu")
        dev0 = topo.devices[0]
        client = dev0.client
        # A module for N partitions (`mhlo.num_partitions`, a multi-device collective)
        # compiles for the topology's first N devices; options per N, made once.
        options = {}

        def options_for(n):
            if n not in options:
                if n > len(topo.devices):
                    raise RuntimeError(f"the module has {n} partitions and topology "
                                       f"{topology_for(target)} has {len(topo.devices)} devices")
                devs = topo.devices[:n]
                options[n] = (xc.DeviceList(tuple(devs)), compiler.get_compile_options(
                    1, n, device_assignment=np.array(devs).reshape(1, n), backend=client))
            return options[n]
    except Exception as e:  # pragma: no cover - environment problem
        proto.write(json.dumps({"fatal": f"worker init failed: {e!r}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "init_seconds": time.time() - t0,
                            "device_kind": dev0.device_kind}) + "\n")
    crash_marker = os.environ.get("TPU_COMPILE_TEST_CRASH")  # self-test hook
    for line in sys.stdin:
        req = json.loads(line)
        t = time.time()
        if crash_marker and crash_marker in str(req.get("file")):
            os.kill(os.getpid(), signal.SIGSEGV)
        ok, err, prof = False, None, None
        if profile:
            for d in filter(None, profile):
                clear_dir(d)
        try:
            text = req.get("text")
            if text is None:
                with open(req["file"]) as f:
                    text = f.read()
            parts = re.search(r"mhlo\.num_partitions = (\d+)", text)
            devices, opts = options_for(int(parts.group(1)) if parts else 1)
            ctx = mlir.make_ir_context()
            with ctx:
                try:
                    module = ir.Module.parse(text)
                except Exception as e:
                    raise RuntimeError(f"StableHLO parse error: {e}") from None
                client.compile(module, executable_devices=devices,
                               compile_options=opts)
            ok = True
            if profile:
                prof = read_profile(*profile)
        except Exception as e:
            err = trim_error(e)
        proto.write(json.dumps({"ok": ok, "error": err, "profile": prof,
                                "seconds": round(time.time() - t, 4)}) + "\n")
    return 0


# --------------------------------------------------------------------------
# Parent side: worker management
# --------------------------------------------------------------------------

def worker_python():
    """Interpreter for workers: $TPU_COMPILE_PYTHON, else the repo venv
    (<repo>/.venv/bin/python next to interop/python/), else this interpreter."""
    env = os.environ.get("TPU_COMPILE_PYTHON")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    venv = os.path.join(here, "..", "..", ".venv", "bin", "python")
    return os.path.normpath(venv) if os.path.exists(venv) else sys.executable


class Worker:
    def __init__(self, target, env):
        self.target = target
        self.env = env
        self.proc = None
        self.errlog = None
        self.buf = b""

    def start(self, timeout):
        self.errlog = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [worker_python(), os.path.abspath(__file__), "--worker", self.target],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errlog,
            env=self.env)
        self.buf = b""
        msg = self._read_line(timeout)
        if msg is None or "ready" not in msg:
            if msg is not None:
                reason = msg.get("fatal")
            elif self.proc.poll() is None:
                reason = f"start-up timed out after {timeout:g}s"
            else:
                reason = self._death_reason()
            self.stop()
            raise RuntimeError(f"worker for {self.target} failed to start: {reason}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.kill()
                except OSError:
                    pass
            self.proc.wait()
            self.proc = None

    def _read_line(self, timeout):
        """Next JSON line from the worker, or None on EOF/timeout."""
        deadline = time.time() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _stderr_tail(self, since=0, n=1500):
        try:
            self.errlog.seek(since)
            data = self.errlog.read().decode("utf-8", "replace")
        except Exception:
            return ""
        noise = ("WARNING", "TPU_WORKER", "RAW:", "symbolize.", "Source Location",
                 "learning/", "FailureSignalHandler")
        keep = [l for l in data.splitlines()
                if l.strip() and not any(n in l for n in noise)
                and not l.startswith(("W0000", "I0000"))
                and not l.strip().startswith(("@ ", "PC: "))]
        return "\n".join(keep)[-n:]

    def _death_reason(self, since=0):
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "worker unresponsive"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            why = f"compiler crashed ({name})"
        else:
            why = f"compiler exited with status {rc}"
        tail = self._stderr_tail(since)
        return why + (": " + tail if tail else "")

    def compile(self, req, timeout):
        """Returns (ok, error, seconds, profile). Restarts the worker after a crash."""
        if not self.alive():
            self.start(max(timeout, STARTUP_TIMEOUT))
        since = self.errlog.seek(0, os.SEEK_END)
        t = time.time()
        payload = {k: req[k] for k in ("file", "text") if k in req}
        try:
            self.proc.stdin.write((json.dumps(payload) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        msg = self._read_line(timeout)
        secs = round(time.time() - t, 4)
        if msg is None:
            # EOF before the deadline is a dying worker (a crash handler may still be
            # printing): report the crash, not a timeout.
            if secs < timeout:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.stop()
                return False, f"timeout after {timeout:g}s (worker killed)", secs, None
            reason = self._death_reason(since)
            self.stop()
            return False, reason, secs, None
        return msg["ok"], msg["error"], msg["seconds"], msg.get("profile")


class Pool:
    def __init__(self, mosaic_dump=None, profile=False, static=True):
        self.mosaic_dump = mosaic_dump
        self.env = dict(os.environ)
        self.profile_dir = None
        if profile:
            self.profile_dir = tempfile.mkdtemp(prefix="tpu-compile-profile-")
            self.env["TPU_COMPILE_PROFILE"] = self.profile_dir
            self.env["TPU_COMPILE_STATIC_PROFILE"] = "1" if static else "0"
        if mosaic_dump:
            os.makedirs(mosaic_dump, exist_ok=True)
            self.env["LIBTPU_INIT_ARGS"] = (self.env.get("LIBTPU_INIT_ARGS", "") +
                                           f" --xla_mosaic_dump_to={mosaic_dump}").strip()
        self.env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # libtpu takes /tmp/libtpu_lockfile per process; compile-only workers
        # (several targets, concurrent test runs) must not exclude each other.
        self.env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        self.workers = {}
        self.llo_only = None  # bundles without the estimate: --llo-only, and where the profiler aborts
        self.static = static

    def compile(self, target, req, timeout):
        try:
            topology_for(target)  # validate
        except SystemExit as e:
            return False, str(e), 0.0, None
        if self.profile_dir and self.static and req.get("static_profile") is False:
            return self.llo_only_pool().compile(target, req, timeout)
        w = self.workers.get(target)
        if w is None:
            w = self.workers[target] = Worker(target, self.env)
        try:
            ok, err, secs, prof = w.compile(req, timeout)
        except RuntimeError as e:
            return False, str(e), 0.0, None
        if self.profile_dir and self.static and not ok and err and err.startswith(("compiler crashed", "timeout after")):
            # libtpu's static profiler aborts on some kernels that compile without it
            # (DESIGN.md section 9), and takes minutes on others (gmm in f32 on v6e,
            # libtpu 0.0.52: ~170 s on a busy 2-core machine, where a plain compile takes
            # 0.3 s): the verdict comes from a compile without the estimate, which still
            # gives the bundles, spills and VMEM, and the profile says why cycles are missing.
            ok, err2, secs2, prof = self.llo_only_pool().compile(target, req, timeout)
            # (glog's `F1207 05:43:36.122712   23799 ` prefix dropped: time and thread id.)
            why = "aborted: " + re.sub(r"\b[FE]\d{4} [\d:.]+\s+\d+ ", "", err) if err.startswith("compiler crashed") else f"did not finish ({err}; TESSERA_TPU_TIMEOUT gives it longer)"
            return ok, (err2 if not ok else None), secs + secs2, {"ops": (prof or {}).get("ops"), "error": "libtpu's static profiler " + why}
        return ok, err, secs, prof

    def llo_only_pool(self):
        """The pool (made on first use) whose workers dump the bundles without the estimate."""
        if self.llo_only is None:
            self.llo_only = Pool(self.mosaic_dump, profile=True, static=False)
        return self.llo_only

    def close(self):
        for w in self.workers.values():
            w.stop()
        if self.llo_only:
            self.llo_only.close()
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)


def result_line(file, target, ok, error, seconds, extra=None):
    d = {"file": file, "target": target, "ok": ok, "error": error,
         "seconds": seconds}
    if extra:
        d.update(extra)
    return json.dumps(d)


def serve(pool, default_target, timeout):
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            req = json.loads(line)
        else:
            parts = line.split(None, 1)
            if len(parts) == 1:
                parts = [default_target, parts[0]]
            req = {"target": parts[0], "file": parts[1]}
        target = req.get("target") or default_target
        ok, err, secs, prof = pool.compile(target, req, req.get("timeout", timeout))
        extra = {"id": req["id"]} if "id" in req else {}
        if pool.profile_dir:
            extra["profile"] = prof
        print(result_line(req.get("file"), target, ok, err, secs, extra), flush=True)


def main(argv=None):
    # `@LIST` reads arguments from a file, one a line: thousands of paths pass the
    # kernel's limit on a command line's length.
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], fromfile_prefix_chars="@")
    ap.add_argument("--target", action="append", default=[],
                    help="v4|v5e|v5p|v6e|tpu7x or topology name; repeatable or comma list")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help="seconds per compile (worker start-up gets max(this, 60))")
    ap.add_argument("--serve", action="store_true",
                    help="JSON-lines requests on stdin, results on stdout")
    ap.add_argument("--mosaic-dump", metavar="DIR",
                    help="dump Mosaic after each libtpu stage into DIR")
    ap.add_argument("--profile", action="store_true",
                    help="add libtpu's static LLO profile (cycles, bundles, spills, VMEM) to each result")
    ap.add_argument("--llo-only", metavar="FILE", action="append", default=[],
                    help="with --profile: FILE's profile without libtpu's static estimate (bundles, spills, VMEM only)")
    ap.add_argument("--list-targets", action="store_true")
    ap.add_argument("--worker", metavar="TARGET", help=argparse.SUPPRESS)
    ap.add_argument("files", nargs="*")
    a = ap.parse_args(argv)

    if a.worker:
        return worker_main(a.worker)
    if a.list_targets:
        for k, v in TOPOLOGIES.items():
            print(f"{k}\t{v}")
        return 0
    if a.llo_only and not a.profile:
        ap.error("--llo-only profiles without the estimate: it needs --profile")
    targets = [t for spec in a.target for t in spec.split(",") if t] or ["v5e"]
    for t in targets:
        topology_for(t)
    pool = Pool(a.mosaic_dump, a.profile)
    try:
        if a.serve:
            serve(pool, targets[0], a.timeout)
            return 0
        if not a.files:
            ap.error("no input files")
        all_ok = True
        llo_only = {os.path.abspath(f) for f in a.llo_only}
        for target in targets:
            for f in a.files:
                req = {"file": os.path.abspath(f)}
                if req["file"] in llo_only:
                    req["static_profile"] = False
                ok, err, secs, prof = pool.compile(target, req, a.timeout)
                all_ok &= ok
                extra = {"profile": prof} if a.profile else None
                print(result_line(f, target, ok, err, secs, extra), flush=True)
        return 0 if all_ok else 1
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(main())
