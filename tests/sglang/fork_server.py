"""One interpreter per pytest run that imports torch and SGLang once, then forks a fresh child
per check (``conftest.run_child``): the child starts where a new ``python -c`` would be after
``import sglang.srt.plugins``, with nothing of SGLang's plugins loaded and no plugin module
imported, so every check still sees SGLang's ``load_plugins()`` as a new process does.

Children are forked with ``os.fork`` (not ``multiprocessing``: SGLang's launcher test reads
``multiprocessing.parent_process()``); a process SGLang spawns from one is a real spawned
interpreter. The server is started with ``python -c``, so its ``__main__`` has no file, as the
``python -c`` children it replaces had none.

Protocol, one JSON line each way per child: the client sends ``{code, env, cwd, out, err}``;
the server forks, answers ``{"pid": ...}``, waits, and answers ``{"rc": ...}`` (the exit code, or
minus the signal). The child's stdout and stderr go to the files ``out`` and ``err``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent

#: What every child imports first anyway (and nothing that changes what a plugin sees: no server
#: args, no scheduler, no plugin module).
PRELOAD = ("torch", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry")


def _child(req: dict[str, Any], reply: TextIO) -> None:  # pragma: no cover - the forked child
    """Run one check as ``python -c`` would, then leave without returning to the server loop."""
    import atexit
    import importlib
    import threading
    import traceback

    reply.close()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, (name, flags) in enumerate(((os.devnull, os.O_RDONLY), (req["out"], write),
                                       (req["err"], write))):
        os.dup2(os.open(name, flags), fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    importlib.invalidate_caches()
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    rc = 0
    try:
        exec(compile(req["code"], "<string>", "exec"), main)  # noqa: S102 - the test's own code
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would
        traceback.print_exc()
        rc = 1
    threading._shutdown()  # type: ignore[attr-defined]  # private: what interpreter exit does first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def serve() -> None:  # pragma: no cover - runs in the server process
    """The server's loop: preload, then fork one child per request line on stdin."""
    import importlib
    import warnings

    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to the log, not into the answers
    import torchvision_standin

    torchvision_standin.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's import-time warnings on CPU (conftest.py)
        for name in PRELOAD:
            importlib.import_module(name)
    sys.path.remove(str(HERE))  # the client's ``-c`` put it there for this module
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line), reply)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ForkServer:
    """The client side: starts the server with ``env`` (its ``PYTHONPATH`` decides ``sys.path``)."""

    def __init__(self, env: dict[str, str], cwd: Path, log: Path) -> None:
        self.env, self.log = env, log
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                "import fork_server; fork_server.serve()")
        with log.open("w") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                         cwd=str(cwd))
        self._read(600)

    def _read(self, timeout: float) -> dict[str, Any]:
        out: TextIO = self.proc.stdout  # type: ignore[assignment]
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else ""
        if not line:
            msg = f"fork server: no answer (rc={self.proc.poll()}):\n{self.log.read_text()[-4000:]}"
            raise RuntimeError(msg)
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, code: str, env: dict[str, str], cwd: Path, out: Path, err: Path,
            timeout: float) -> int:
        """Fork a child running ``code``; its exit code (a timeout kills it: minus SIGKILL)."""
        assert env.get("PYTHONPATH") == self.env.get("PYTHONPATH"), "sys.path is the server's"
        req = {"code": code, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        pid = self._read(60)["pid"]
        deadline = time.monotonic() + timeout
        try:
            return int(self._read(timeout)["rc"])
        except RuntimeError:
            if time.monotonic() < deadline:
                raise
            os.kill(pid, signal.SIGKILL)
            return int(self._read(60)["rc"])

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(60)
        self.proc.stdout.close()  # type: ignore[union-attr]
