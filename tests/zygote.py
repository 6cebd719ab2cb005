"""The suite's `python -m frontier.*` commands, forked from a process that has already imported what they import.

Most tests start commands, and each new interpreter spent seconds of CPU importing torch, Hydra, Optuna
and MLflow before its first line of work: most of the suite's CPU. `install()` (called by conftest.py)
makes `subprocess.Popen` -- and so `subprocess.run` -- hand such a command to this module's server, one
per pytest worker, which imported those libraries once and forks a child per command. The child takes
the command's standard streams, working directory, environment, session and ignored signals, then runs
the module as `python -m` does (runpy, `sys.argv`, the exit code of SystemExit, a traceback and 1 for an
error, death by SIGINT for an unhandled Ctrl-C, the exit handlers). It is a real process with a pid of
its own: the test signals it, kills its group and reads its exit status through the usual Popen.

A command is started as a new interpreter, as before, wherever the difference could show: any
interpreter option or other program, a working directory other than the checkout, `preexec_fn`,
`pass_fds`, user, group or umask, or an environment whose variables read at import time (PYTHON*,
OMP_*, torch's, MLflow's logging, HOME ...) differ from the server's. FRONTIER_TEST_FORK=0 starts
every command as a new interpreter.
"""
from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Read by the libraries as they are imported (or by the interpreter at its start): a command whose
# environment differs here from the server's runs as a new interpreter. Not here: TORCHINDUCTOR_* (which
# torch sets in the worker once a test compiles), TRITON_* and NEURON_* (which frontier.device sets in
# the worker), read when inductor, triton or the Neuron runtime starts, none of which the server starts;
# KMP_* (a library sets one in the worker), read by Intel's OpenMP, which torch's Linux wheels do not load.
AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "GOMP_", "ATEN_", "TORCH_", "CUDA", "NVIDIA",
             "LD_", "MALLOC", "ONEDNN_", "DNNL_", "OPENBLAS", "MPL", "MLFLOW_CONFIGURE_LOGGING",
             "MLFLOW_LOGGING_LEVEL", "HOME", "XDG_", "TMPDIR", "LANG", "LC_")

PRELOAD = ("frontier.train", "frontier.trainer", "frontier.trial", "frontier.standby", "frontier.tracking",
           "frontier.mlflow_observer", "frontier.store", "frontier.sweep_report", "frontier.eval",
           "frontier.leaderboard", "hydra_plugins.frontier_sweeper.frontier_sweeper",
           "optuna.storages.journal", "matplotlib.pyplot")

_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, max_fds)
    if not data:
        return None, fds
    (size,) = _HEADER.unpack(data[:4])
    data = data[4:]
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


# -----------------------------------------------------------------------------
# The server: one per pytest worker


def serve(name: str) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    for module in PRELOAD:
        __import__(module)
    import gc

    gc.collect()
    gc.freeze()  # the children share these pages rather than copy them at their first collection

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return  # the worker is gone; its children go on as orphans, as they would have
        if wake_read in ready:
            os.read(wake_read, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            client = children.pop(pid, None)
            if client is not None:
                with contextlib.suppress(OSError):  # a client that went away
                    _send(client, {"status": status})
                client.close()
        if listener in ready:
            client, _ = listener.accept()
            request, fds = _receive(client, max_fds=3)
            if request is None:
                client.close()
                continue
            started_read, started_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 255
                try:
                    listener.close()
                    os.close(started_read)
                    code = _child(request, fds, started_write, wake_read, wake_write)
                finally:  # whatever happens, the child never returns into this loop
                    os._exit(code)
            for fd in (*fds, started_write):
                os.close(fd)
            os.read(started_read, 1)  # as Popen returns once the exec succeeded: the child's session is set
            os.close(started_read)
            children[pid] = client
            with contextlib.suppress(OSError):  # a client that went away
                _send(client, {"pid": pid})


def _child(request: dict, fds: list[int], started: int, *server_fds: int) -> int:
    """Becomes the command's process and runs it as `python -m MODULE ARGS` would; its exit code."""
    signal.set_wakeup_fd(-1)
    for fd in server_fds:
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    elif request["process_group"] is not None and request["process_group"] >= 0:
        os.setpgid(0, request["process_group"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, started)  # the server's socket, the pipes' other ends
    os.closerange(started + 1, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum in signal.valid_signals():  # as a new interpreter starts: what its parent ignored stays ignored
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        ignored = signum in request["ignored"] or signum in (signal.SIGPIPE, signal.SIGXFSZ)
        handler = signal.SIG_IGN if ignored else signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.write(started, b"1")
    os.close(started)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    return _run_module(request["module"], request["args"])


def _run_module(module: str, args: list[str]) -> int:
    import atexit
    import runpy
    import traceback
    import warnings

    import frontier
    from frontier import timing

    sys.argv = [module, *args]
    sys.orig_argv = [sys.executable, "-m", module, *args]  # what frontier reads to know it runs as a command
    frontier._start_command()  # what importing frontier did in a command's process, not in the server
    timing.restart()  # the process's work began at the fork, not at the server's start
    code, interrupted = 0, False
    try:
        with warnings.catch_warnings():
            # runpy's note that the module was imported before (by this server): a new interpreter had not
            warnings.filterwarnings("ignore", r".* found in sys\.modules after import of package", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code & 0xFF
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as the interpreter's exit: its other threads end, then the exit handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # an unhandled Ctrl-C ends a Python process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


# -----------------------------------------------------------------------------
# The client: Popen, in the pytest worker

_PARAMETERS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]


class _Server:
    """This worker's server, started at its first command."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.path = ""
        self.env: dict[str, str] = {}
        self.failed = False

    def address(self) -> str | None:
        with self.lock:
            if self.failed:
                return None
            if self.process is None or self.process.poll() is not None:
                self.start()
            return None if self.failed else "\0" + self.path

    def start(self) -> None:
        # in Linux's abstract namespace: no file to clean up, and no path that a test's TMPDIR could make too long
        self.path = f"frontier-zygote-{os.getpid()}-{os.urandom(6).hex()}"
        self.process = _ORIGINAL_POPEN([sys.executable, __file__, self.path], cwd=ROOT, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=self.env)
        if self.process.stdout.readline().strip() != b"ready":
            self.failed = True
            print(f"tests/zygote.py: the server did not start (exit {self.process.wait()}); commands run as "
                  "new interpreters", file=sys.stderr)


_SERVER = _Server()
_ORIGINAL_POPEN = subprocess.Popen


def _forkable(kw: dict) -> dict | None:
    """The request for the server, or None where the command must run as a new interpreter."""
    args = kw["args"]
    if (kw["shell"] or kw["executable"] is not None or kw["preexec_fn"] is not None or kw["pass_fds"]
            or not kw["close_fds"] or kw["gid"] is not None or kw["gids"] is not None or kw["uid"] is not None
            or kw["umask"] >= 0 or not kw["restore_signals"] or isinstance(args, (str, bytes))):
        return None
    args = [os.fsdecode(arg) for arg in args]
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or not args[2].startswith("frontier."):
        return None
    cwd = os.path.realpath(os.fsdecode(kw["cwd"]) if kw["cwd"] is not None else os.getcwd())
    if cwd != str(ROOT):
        return None
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in (kw["env"] if kw["env"] is not None else os.environ).items()}
    return {"module": args[2], "args": args[3:], "cwd": cwd, "env": env,
            "new_session": bool(kw["start_new_session"]), "process_group": kw.get("process_group"),
            "ignored": [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                        and signal.getsignal(s) is signal.SIG_IGN]}


def _differs_at_import(env: dict, server_env: dict) -> list[str]:
    keys = {key for key in (*env, *server_env) if key.startswith(AT_IMPORT)}
    return sorted(key for key in keys if env.get(key) != server_env.get(key))


class ForkedPopen(_ORIGINAL_POPEN):
    _zygote: socket.socket | None = None
    not_forked = ""  # why the command started as a new interpreter

    def _execute_child(self, *args):
        kw = dict(zip(_PARAMETERS, args))
        request = _forkable(kw)
        address = _SERVER.address() if request is not None else None
        differ = _differs_at_import(request["env"], _SERVER.env) if address is not None else []
        if request is None or address is None or differ:
            self.not_forked = ("not a frontier command from the checkout" if request is None else
                               "no server" if address is None else f"{', '.join(differ)} read at import")
            return super()._execute_child(*args)
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = (kw[name] for name in (
            "p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite"))
        streams = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            _send(sock, request, streams)
            reply, _ = _receive(sock)
        except OSError:
            sock.close()
            return super()._execute_child(*args)
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if reply is None or "pid" not in reply:
            sock.close()
            raise OSError(errno.ECHILD, "the zygote server could not start the command")
        self.pid, self._child_created, self._zygote = reply["pid"], True, sock

    def _zygote_status(self, block: bool) -> int | None:
        if not block and not select.select([self._zygote], [], [], 0)[0]:
            return None
        reply, _ = _receive(self._zygote)
        self._zygote.close()
        return reply["status"] if reply is not None else 0xFF00  # the server died: exit code 255

    def _try_wait(self, wait_flags):
        if self._zygote is None:
            return super()._try_wait(wait_flags)
        status = self._zygote_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **kw):
        if self._zygote is None:
            return super()._internal_poll(_deadstate, **kw)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._zygote_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install() -> None:
    """`subprocess.Popen` (and so `subprocess.run`) forks the suite's frontier commands from the server."""
    if os.environ.get("FRONTIER_TEST_FORK", "1") != "0" and sys.platform == "linux":
        _SERVER.env = dict(os.environ)  # the worker's, before any test changes it: the server imports under it
        subprocess.Popen = ForkedPopen


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it: the checkout first, as for the commands
    serve(sys.argv[1])
