"""``sglang-bcg switch``: the client of a running server's ``/bcg/output_mode`` (docs/sglang.md), standard library
only. Its arguments are checked before any network work (a ``UsageError``: exit 2); then one request, never redirected,
whose whole exchange (name lookup, connect, sending, the answer's headers and body) ``--timeout`` bounds; a progress
line on stderr, one result line on stdout, or one ``error:`` line (exit 1)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import math
import os
import re
import socket
import ssl
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from ._version import __version__
from .bench.usage import UsageError, shown
from .sglang.switch.routes import ROUTE

ENV_KEY = "SGLANG_BCG_ADMIN_API_KEY"  #: the key when ``--api-key`` is not given (keeps it off the process list)
DEFAULT_TIMEOUT_S = 900.0  #: the server's own limit (``SGLANG_BCG_SWITCH_TIMEOUT``, default 900 s)
MAX_TIMEOUT_S = 86_400.0  #: the longest ``--timeout`` (a day): a re-capture takes minutes, not days
MAX_ANSWER_BYTES = 16 * 2**20  #: the largest answer read: the route's answer is a few KiB per TP rank
POLL_S = 1.0  #: ``--wait``: seconds between two GETs while the server captures between batches
SLACK_S = 0.5  #: how long past ``--timeout`` to wait for a step no socket timeout bounds (a name lookup)
SCHEMES = ("http", "https")
_EXAMPLE = "e.g. --url http://127.0.0.1:30000"
_CHECK = "check with sglang-bcg switch --show"


class SwitchError(Exception):
    """One line for the user; never a traceback."""


@dataclass(frozen=True)
class Server:
    """A checked ``--url``: where the request goes."""

    scheme: str
    host: str  #: as the socket takes it (an IPv6 literal without brackets)
    port: int | None  #: ``None``: the scheme's
    base: str  #: the path before :data:`ROUTE`, without a trailing ``/``
    route_url: str  #: where the request goes, the route included


def _char(c: str) -> str:
    return f"U+{ord(c):04X} ({unicodedata.name(c, 'a control character')})"


def _url_problem(url: str) -> tuple[str, str]:
    """What makes ``url`` (stripped, not empty) unusable before it is split, and the example to give."""
    odd = next((c for c in url if c.isspace() or unicodedata.category(c) in ("Cc", "Cf")), None)
    scheme, sep, _ = url.partition("://")
    if odd is not None:
        return f" contains {_char(odd)}", _EXAMPLE
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        plain = len(url) <= 80 and re.fullmatch(r"[\w.-]+(:\d+)?(/.*)?", url, flags=re.ASCII)  # host[:port][/path]
        return (" has no scheme; write http:// (or https://) before the host",
                f"--url http://{url}" if plain else _EXAMPLE)
    if scheme.lower() not in SCHEMES:
        return f" has the scheme {shown(scheme)}; the server's HTTP address starts with http:// or https://", _EXAMPLE
    if "?" in url or "#" in url:
        return " has a query or a fragment; give the server's address (the route /bcg/output_mode is added)", _EXAMPLE
    return "", _EXAMPLE


def parse_url(raw: object) -> Server:
    """``--url``: ``http(s)://host[:port][/path]`` (the route is added; given with it, it is not
    added twice). :raises UsageError: naming ``--url``, what is wrong and what to give."""
    url = raw.strip() if isinstance(raw, str) else ""
    if not url:
        raise UsageError(f"--url is empty; give the server's HTTP address, {_EXAMPLE}")
    problem, example = _url_problem(url)
    if not problem:
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # an unclosed IPv6 bracket
            problem = f" is not a URL ({exc})"
    if not problem:
        if "@" in parts.netloc:  # never echoed: it may hold a password
            msg = (f"--url has credentials before the host ({parts.scheme}://…@{parts.netloc.rpartition('@')[2]}); "
                   f"they are not sent: give the server's --admin-api-key with --api-key or {ENV_KEY}")
            raise UsageError(msg)
        host = parts.hostname or ""
        port = parts.netloc.rpartition("]")[2].partition(":")[2]  # of host[:port] or [v6][:port]
        base = parts.path.rstrip("/").removesuffix(ROUTE).rstrip("/")
        if not host:
            problem = " has no host"
        elif port and not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
            problem = f": the port {shown(port)} is not a number from 1 to 65535"
        elif not base.isascii():
            problem, example = " has characters outside ASCII in its path", "percent-encode them (%XX)"
        else:
            try:
                host.encode("idna")
            except UnicodeError as exc:
                problem = f": {shown(host)} is not a host name ({str(exc).rpartition('UnicodeError: ')[2].rstrip(')')})"
    if problem:
        msg = f"--url {shown(url)}{problem}" + (f": {example}" if example.startswith("--url") else f"; {example}")
        raise UsageError(msg)
    return Server(parts.scheme, host, int(port) if port else None, base,  # urlsplit: scheme lower-case
                  f"{parts.scheme}://{parts.netloc}{base}{ROUTE}")


def parse_timeout(raw: object) -> float:
    """``--timeout``: seconds for the whole exchange, above 0 and at most :data:`MAX_TIMEOUT_S`
    (``None``: :data:`DEFAULT_TIMEOUT_S`). :raises UsageError: naming ``--timeout``."""
    if raw is None:
        return DEFAULT_TIMEOUT_S
    seconds = math.nan
    if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
        with contextlib.suppress(ValueError, OverflowError):
            seconds = float(raw.strip() if isinstance(raw, str) else raw)
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN too
        msg = (f"--timeout {shown(raw)} is not a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (a day); it "
               f"bounds the whole exchange with the server (default {DEFAULT_TIMEOUT_S:.0f}, the server's own limit)")
        raise UsageError(msg)
    return seconds


def check_key(key: str, source: str) -> str:
    """``key`` if an HTTP header can carry it (printable latin-1, no surrounding space); the key is
    never echoed. :raises UsageError: naming ``source`` (``--api-key`` or :data:`ENV_KEY`)."""
    if not key:
        raise UsageError(f"{source} is empty (an unset variable in --api-key \"$KEY\"?); give the server's "
                         f"--admin-api-key, or leave {source} out to send none")
    for i, c in enumerate(key, 1):
        if unicodedata.category(c) == "Cc" or ord(c) > 0xFF:
            why = "a line break" if c in "\r\n" else _char(c)
            raise UsageError(f"{source} has {why} at character {i} (the key is not shown); an HTTP header carries "
                             "printable latin-1 characters only, so no server can receive this key: copy the server's "
                             "--admin-api-key again")
    if key != key.strip():
        raise UsageError(f"{source} starts or ends with a space, which HTTP drops from a header (the key is not "
                         "shown); give the key without it")
    return key


def key_of(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The admin key: ``--api-key``, else :data:`ENV_KEY` (unset or empty: none), checked by :func:`check_key`."""
    if given is not None:
        return check_key(given, "--api-key")
    from_env = (os.environ if environ is None else environ).get(ENV_KEY) or None
    return None if from_env is None else check_key(from_env, ENV_KEY)


def _arguments(url: str, key: str | None, timeout_s: float) -> tuple[Server, float]:
    if key is not None:
        check_key(key, "--api-key")
    return parse_url(url), parse_timeout(timeout_s)


CONNECTING, SENDING, HEADERS, BODY = "connecting", "sending the request", "waiting for the answer", "reading the answer"


class _Deadline(io.RawIOBase):
    """The end of the exchange, where the exchange is, and the answer's bytes as read: each step, each read too, may
    take what is left of ``--timeout``, no more, so an answer trickled byte by byte cannot outlast it."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock, self.end, self.stage, self.received = clock, clock() + seconds, CONNECTING, 0
        self.conn: http.client.HTTPConnection | None = None

    def left(self) -> float:
        """Seconds left. :raises TimeoutError: none."""
        left = self.end - self._clock()
        if left <= 0:
            raise TimeoutError("--timeout passed")
        return left

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        assert self.conn is not None and self.conn.sock is not None  # connected
        self.conn.sock.settimeout(self.left())
        n: int = self.conn.sock.recv_into(buffer)
        self.received += n
        return n

    def makefile(self, mode: str) -> io.BufferedReader:  # what http.client.HTTPResponse reads from
        return io.BufferedReader(self)


def _exchange(server: Server, key: str | None, mode: str | None, deadline: _Deadline
              ) -> tuple[int, str, str | None, bytes]:
    """One request on a fresh connection (``Connection: close``); redirects are answers, not followed.
    The status, reason, ``Location`` and body (more than :data:`MAX_ANSWER_BYTES`: cut one byte past)."""
    kind = http.client.HTTPSConnection if server.scheme == "https" else http.client.HTTPConnection
    # The port always given: http.client would read an IPv6 literal's last group as one.
    deadline.conn = conn = kind(server.host, server.port or kind.default_port, timeout=deadline.left())
    method, body = ("GET", None) if mode is None else ("POST", json.dumps({"mode": mode}).encode())
    headers = {"Accept": "application/json", "Connection": "close", "User-Agent": f"sglang-bcg/{__version__}",
               **({"Authorization": f"Bearer {key}"} if key else {}),
               **({} if body is None else {"Content-Type": "application/json"})}
    with contextlib.closing(conn):
        conn.connect()  # TCP (and TLS) within what is left; the name lookup: see request()
        deadline.stage = SENDING
        assert conn.sock is not None  # connected
        conn.sock.settimeout(deadline.left())
        conn.request(method, server.base + ROUTE, body=body, headers=headers)
        deadline.stage = HEADERS
        with http.client.HTTPResponse(deadline, method=method) as answer:  # type: ignore[arg-type]
            answer.begin()
            deadline.stage = BODY
            data = answer.read(MAX_ANSWER_BYTES + 1)
            if answer.length and len(data) <= MAX_ANSWER_BYTES:  # closed before Content-Length bytes came
                raise http.client.IncompleteRead(data, answer.length)
            return answer.status, answer.reason, answer.getheader("Location"), data


def _unknown(mode: str | None, stage: str) -> str:
    after = {CONNECTING: "; nothing was switched", SENDING: f"; whether it switched is unknown: {_CHECK}"}
    return "" if mode is None else after.get(stage, f"; the switch may still finish on the server: {_CHECK}")


def _failure(exc: BaseException, server: Server, mode: str | None, seconds: float, deadline: _Deadline) -> str:
    """The line of a failed exchange. :raises BaseException: ``exc`` when it is a bug of ours."""
    route, after = server.route_url, _unknown(mode, deadline.stage)
    if isinstance(exc, TimeoutError):
        so_far = f", {deadline.received} bytes of it so far" if deadline.stage in (HEADERS, BODY) else ""
        return f"no complete answer from {route} within --timeout {seconds:g} s (still {deadline.stage}{so_far}){after}"
    if isinstance(exc, socket.gaierror):
        return f"cannot reach {route}: the host {shown(server.host)} is not known ({exc.strerror}); check --url{after}"
    if isinstance(exc, ssl.SSLError):
        return (f"https with {route} failed ({exc.reason or exc}): does the server speak https? "
                f"(http:// otherwise){after}")
    if isinstance(exc, http.client.RemoteDisconnected):
        return f"{route} closed the connection without an answer{after}"
    if isinstance(exc, http.client.BadStatusLine):
        return (f"{route} did not answer in HTTP (its first line: {shown(str(getattr(exc, 'line', exc)))[:120]}): "
                f"is --url the server's HTTP address?{after}")
    if isinstance(exc, http.client.IncompleteRead):
        return f"{route} closed the connection after {len(exc.partial)} bytes of its answer's body{after}"
    if isinstance(exc, http.client.HTTPException):
        return f"{route} answered something that is not HTTP ({type(exc).__name__}: {shown(str(exc))}){after}"
    if not isinstance(exc, OSError):
        raise exc
    reason = exc.strerror or str(exc) or type(exc).__name__
    if deadline.stage == CONNECTING:
        return f"cannot reach {route}: {reason} (is the server up at {route.removesuffix(server.base + ROUTE)}?){after}"
    return f"the connection to {route} broke while {deadline.stage} ({reason}){after}"


def _error_of(status: int, data: bytes, url: str) -> str:
    try:
        text = str(json.loads(data).get("error", ""))
    except (ValueError, AttributeError, RecursionError):
        text = data.decode(errors="replace").strip()
    text = " ".join(text.split())[:500]
    return {401: f"401 Unauthorized: {url} wants the server's --admin-api-key (--api-key KEY or {ENV_KEY})",
            403: f"403 Forbidden: {url} ({text or 'the server has no --admin-api-key'})",
            404: f"404: {url} has no {ROUTE}: the server was started without --admin-api-key, or without this plugin "
                 "installed (sglang-bcg doctor)"}.get(status, f"{status}: {text or 'no reason given'}")


_RANKS = (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects, one per TP rank")
#: The documented answer (docs/sglang.md): field -> (check, what it must be).
FIELDS_GET: dict[str, tuple[Callable[[object], bool], str]] = {
    "mode": (lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, str) for m in v)),
             "an output mode, a list of them (ranks that differ) or null"),
    "ranks": _RANKS}
FIELDS_POST: dict[str, tuple[Callable[[object], bool], str]] = {
    "mode": (lambda v: isinstance(v, str), "the output mode asked for"),
    "previous": (lambda v: v is None or isinstance(v, str), "the previous output mode or null"),
    "seconds": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                "the switch's seconds, a number"),
    "ranks": _RANKS}


def _json_kind(v: object) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list",
             dict: "object"}
    text = json.dumps(v) if type(v) in names else repr(v)
    return f"{names.get(type(v), type(v).__name__)} {text if len(text) <= 60 else f'{text[:60]}…'}"


def check_answer(body: object, mode: str | None, route: str, status: int = 200) -> dict[str, Any]:
    """``body`` if it is the documented answer of a GET (``mode=None``) or of a POST switching to
    ``mode``. :raises SwitchError: what came and what was expected."""
    fields, after = (FIELDS_GET, "") if mode is None else (FIELDS_POST, f"; nothing is reported as switched: {_CHECK}")
    where, expected = f"{route} answered {status} with", f"the JSON object of {ROUTE} ({', '.join(fields)})"
    if not isinstance(body, dict):
        raise SwitchError(f"{where} a JSON {_json_kind(body)}, expected {expected}: is --url the SGLang server with "
                          f"this plugin?{after}")
    for name, (ok, what) in fields.items():
        if name not in body:
            raise SwitchError(f"{where} a JSON object without {name!r} ({what}), expected {expected}{after}")
        if not ok(body[name]):
            msg = f"{where} a JSON object whose {name!r} is a {_json_kind(body[name])}, expected {what}{after}"
            raise SwitchError(msg)
    if mode is not None and body["mode"] != mode:
        raise SwitchError(f"{where} mode {body['mode']!r}, not {mode!r} as asked{after}")
    return body


def _parsed(answer: tuple[int, str, str | None, bytes], server: Server, mode: str | None) -> dict[str, Any]:
    """The checked JSON of a 2xx answer. :raises SwitchError: too large, a redirect, an error status, not the object."""
    (status, reason, location, data), route = answer, server.route_url
    if len(data) > MAX_ANSWER_BYTES:
        raise SwitchError(f"{route} answered more than {MAX_ANSWER_BYTES // 2**20} MiB: not the answer of "
                          f"{ROUTE}{_unknown(mode, BODY)}")
    if 300 <= status < 400:
        where = urljoin(route, location) if location else "nowhere (no Location)"
        what = "it was not followed" + ("" if mode is None else ", so nothing was switched (a switch is reported only "
                                        "from the server's own answer to the POST)")
        msg = f"{status} {reason}: {route} redirected to {where}; {what}: if that is the server, give --url " + (
            where.removesuffix(ROUTE))
        raise SwitchError(msg)
    if not 200 <= status < 300:
        raise SwitchError(_error_of(status, data, route))
    after = "" if mode is None else f"; whether it switched is unknown: {_CHECK}"
    if not data.strip():
        raise SwitchError(f"{route} answered {status} with an empty body, expected the JSON object of {ROUTE}{after}")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # not UTF-8 or not JSON; nested past the parser's depth
        text = " ".join(data[:200].decode("utf-8", "replace").split())
        preview = repr(text[:60]) + ("…" if len(text) > 60 or len(data) > 200 else "")
        raise SwitchError(f"{route} answered something that is not JSON ({status}, {len(data)} bytes: {preview}), "
                          f"expected the JSON object of {ROUTE}: is --url the SGLang server?{after}") from None
    return check_answer(body, mode, route, status)


def _started(work: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    """A daemon thread running ``work``; its box gets the ``"value"`` returned or the ``"error"`` raised."""
    box: dict[str, Any] = {}

    def boxed() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
    (thread := threading.Thread(target=boxed, name="sglang-bcg switch", daemon=True)).start()
    return thread, box


def request(url: str, key: str | None, mode: str | None, timeout_s: float) -> dict[str, Any]:
    """GET (``mode=None``) or POST ``{"mode": mode}``; the checked JSON answer of a 2xx, within ``timeout_s`` seconds
    in all (``SLACK_S`` more at most where a name lookup hangs).
    :raises UsageError: a bad ``url``, ``key`` or ``timeout_s``. :raises SwitchError: any other failure."""
    server, seconds = _arguments(url, key, timeout_s)
    deadline = _Deadline(seconds)
    worker, box = _started(lambda: _exchange(server, key, mode, deadline))
    worker.join(max(0.0, deadline.end - time.monotonic()) + SLACK_S)
    if worker.is_alive():  # a step no socket timeout bounds (a name lookup, every address of a host): abandoned
        box["error"] = TimeoutError()
        if (sock := getattr(deadline.conn, "sock", None)) is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    if "error" in box:
        raise SwitchError(_failure(box["error"], server, mode, seconds, deadline)) from None
    return _parsed(box["value"], server, mode)


def _mib(n: object) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, int) and not isinstance(n, bool) else "?"


def result_line(body: dict[str, Any], mode: str | None) -> str:
    ranks = body.get("ranks", [])
    first = ranks[0] if ranks else {}
    where = (f"on {len(ranks)} TP rank(s) (scheduler pid {','.join(str(r.get('pid')) for r in ranks)}); graph pool "
             f"{_mib(first.get('pool_bytes'))}, resident outputs {_mib(first.get('resident_output_bytes'))}")
    where += _capture_progress(first.get("incremental"))
    if mode is None:
        shown_mode = f"{', '.join(map(str, m))} (the ranks differ)" if isinstance(m := body.get("mode"), list) else m
        why = f"; switch refused here: {first['refusal']}" if first.get("refusal") else ""
        return f"output mode: {shown_mode} {where}{why}"
    return f"output mode: {body.get('mode')} (was {body.get('previous')}), switched in {body.get('seconds')} s {where}"


def _capture_words(state: object) -> tuple[str, bool] | None:
    """With incremental capture, what the rank has captured in words, and whether captures are still to come between
    batches; ``None``: every size captured, or not incremental."""
    if not isinstance(state, dict) or not isinstance(total := state.get("sizes"), int):
        return None
    done, decode = f"{state.get('captured')} of {total} prefill sizes captured", bool(state.get("decode_pending"))
    if state.get("capture_failed"):
        eager = f"{done}, the others eager (a capture step failed: {state['capture_failed']})"
        return (f"{eager}; the decode graphs come between batches", True) if decode else (eager, False)
    if state.get("captured") == total and not decode:
        return None
    return f"{done}, {'the others and the decode graphs come' if decode else 'the others come'} between batches", True


def _capture_progress(state: object) -> str:
    """:func:`_capture_words` as the end of a result line (``""``: nothing to say)."""
    if (words := _capture_words(state)) is None:
        return ""
    return f"; {words[0]}" + (" (--show gives the progress)" if words[1] else "")


def still_capturing(body: dict[str, Any]) -> str | None:
    """What the first rank with captures still to come between batches (incremental capture) has captured, in words;
    ``None``: no rank has any (every size captured, the others left eager by a failed step, or not incremental)."""
    for rank in body.get("ranks", []):
        words = _capture_words(rank.get("incremental") if isinstance(rank, dict) else None)
        if words is not None and words[1]:
            return words[0]
    return None


def wait_captured(url: str, key: str | None, body: dict[str, Any], end: float, status: dict[str, str],
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                  ) -> dict[str, Any]:
    """``--wait``: a GET every :data:`POLL_S` until no rank captures between batches (``status["now"]``: the
    progress); the last answer. :raises SwitchError: ``end`` (the monotonic clock's) came first."""
    while (left := still_capturing(body)) is not None:
        status["now"] = left
        if clock() + POLL_S >= end:
            raise SwitchError(f"--timeout passed while the server captures between batches ({left}); it serves and "
                              f"captures on: {_CHECK}")
        sleep(POLL_S)
        body = request(url, key, None, end - clock())
    return body


def _in_thread(work: Callable[[], object], line: Callable[[], str]) -> dict[str, Any]:
    """``work`` in a thread and ``line()`` on stderr while it runs (rewritten every half second with the seconds so far
    on a terminal); its box (:func:`_started`)."""
    start, tty = time.monotonic(), sys.stderr.isatty()
    thread, box = _started(work)
    shown_line = line()
    print(shown_line, file=sys.stderr, end="" if tty else "\n", flush=True)
    while thread.is_alive():
        thread.join(0.5)
        if tty:
            now = f"{line()} {time.monotonic() - start:.0f} s"
            print(f"\r{now}{' ' * max(0, len(shown_line) - len(now))}", file=sys.stderr, end="", flush=True)
            shown_line = now
    print(file=sys.stderr, end="\n" if tty else "")
    return box


def run(url: str, key: str | None, mode: str | None, timeout_s: float, wait: bool = False) -> int:
    """The command: the arguments checked (:raises UsageError:), then the request in a thread and a progress line until
    it answers; with ``wait``, then until every rank has captured every size (incremental capture), within the same
    ``timeout_s``. 0 from the server's 2xx with the documented answer, else 1."""
    _arguments(url, key, timeout_s)  # request() checks them too; here, before the progress line
    what = "reading the output mode of" if mode is None else f"switching the output mode to {mode} at"
    start = time.monotonic()
    box = _in_thread(lambda: request(url, key, mode, timeout_s), lambda: f"sglang-bcg switch: {what} {url.strip()} ...")
    waited = ""
    if wait and "error" not in box and still_capturing(box["value"]) is not None:
        answer, status = box["value"], {"now": ""}
        box = _in_thread(lambda: wait_captured(url, key, answer, start + timeout_s, status),
                         lambda: f"sglang-bcg switch: waiting for the captures between batches ({status['now']}) ...")
        if "value" in box:  # the switch's answer with the ranks as they are now
            box["value"], waited = {**answer, "ranks": box["value"]["ranks"]}, (
                f"; the captures between batches ended {time.monotonic() - start:.1f} s after the request")
    if (error := box.get("error")) is not None and not isinstance(error, SwitchError):  # a bug: its traceback
        raise error
    print(f"error: {error}" if error else result_line(box["value"], mode) + waited,
          file=sys.stderr if error else sys.stdout)
    return 1 if error else 0
