"""``sglang-bcg switch``: the client of a running server's ``/bcg/output_mode`` (docs/sglang.md),
standard library only. Its arguments are checked before any network work (a ``UsageError``: exit 2);
then one request, never redirected, whose whole exchange (name lookup, connect, sending, the
answer's headers and body) ``--timeout`` bounds; a progress line on stderr, one result line on
stdout, or one ``error:`` line (exit 1)."""

from __future__ import annotations

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
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

from ._version import __version__
from .bench.usage import UsageError, shown

ROUTE = "/bcg/output_mode"
#: Where the key is read when ``--api-key`` is not given (keeps it off the process list).
ENV_KEY = "SGLANG_BCG_ADMIN_API_KEY"
#: ``--timeout`` when not given: the server's own limit (``SGLANG_BCG_SWITCH_TIMEOUT``, default 900 s).
DEFAULT_TIMEOUT_S = 900.0
#: The longest ``--timeout`` accepted (a day): a re-capture takes minutes, not days.
MAX_TIMEOUT_S = 86_400.0
#: The largest answer read: the route's answer is a few KiB per TP rank.
MAX_ANSWER_BYTES = 16 * 2**20
#: How long past ``--timeout`` the command waits for a step no socket timeout bounds (a name lookup).
SLACK_S = 0.5
SCHEMES = ("http", "https")
_EXAMPLE = "e.g. --url http://127.0.0.1:30000"
_CHECK = "check with sglang-bcg switch --show"


class SwitchError(Exception):
    """One line for the user; never a traceback."""


# -- the arguments, before any network work -------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A checked ``--url``: where the request goes."""

    scheme: str
    host: str  #: as the socket takes it (an IPv6 literal without brackets)
    port: int | None  #: ``None``: the scheme's
    base: str  #: the path before :data:`ROUTE`, without a trailing ``/``
    netloc: str  #: host and port as given

    @property
    def route_url(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.base}{ROUTE}"


def _char(c: str) -> str:
    return f"U+{ord(c):04X} ({unicodedata.name(c, 'a control character')})"


def _url_problem(url: str) -> str | None:
    """What makes ``url`` (stripped, not empty) unusable, before it is split."""
    odd = next((c for c in url if c.isspace() or unicodedata.category(c) in ("Cc", "Cf")), None)
    if odd is not None:
        return f"contains {_char(odd)}"
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme or not (scheme[0].isascii() and scheme[0].isalpha()) or not all(
            c.isascii() and (c.isalnum() or c in "+-.") for c in scheme):
        plain = len(url) <= 80 and re.fullmatch(r"[\w.-]+(:\d+)?(/.*)?", url, flags=re.ASCII)  # host[:port][/path]
        return "has no scheme; write http:// (or https://) before the host" + (f": --url http://{url}" if plain else "")
    if scheme.lower() not in SCHEMES:
        return f"has the scheme {shown(scheme)}; the server's HTTP address starts with http:// or https://"
    if "?" in url or "#" in url:
        return "has a query or a fragment; give the server's address (the route /bcg/output_mode is added)"
    return None


def _port(netloc: str) -> tuple[str, str]:
    """(``:`` or ``""``, the port's text) of ``host[:port]`` or ``[v6][:port]``."""
    rest = netloc[netloc.index("]") + 1:] if netloc.startswith("[") else netloc
    _, colon, text = rest.partition(":")
    return colon, text


def parse_url(raw: object) -> Server:
    """``--url``: ``http(s)://host[:port][/path]`` (the route is added; given with it, it is not
    added twice). :raises UsageError: naming ``--url``, what is wrong and what to give."""
    if not isinstance(raw, str) or not raw.strip():
        msg = f"--url is empty; give the server's HTTP address, {_EXAMPLE}"
        raise UsageError(msg)
    url = raw.strip()
    problem = _url_problem(url)
    if problem is None:
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # an unclosed IPv6 bracket
            problem = f"is not a URL ({exc})"
    if problem is not None:
        msg = f"--url {shown(url)} {problem}" + ("" if ": --url http" in problem else f"; {_EXAMPLE}")
        raise UsageError(msg)
    if "@" in parts.netloc:  # never echoed: it may hold a password
        msg = (f"--url has credentials before the host ({parts.scheme}://…@{parts.netloc.rpartition('@')[2]}); "
               f"they are not sent: give the server's --admin-api-key with --api-key or {ENV_KEY}")
        raise UsageError(msg)
    host = parts.hostname or ""
    colon, port_text = _port(parts.netloc)
    if not host:
        msg = f"--url {shown(url)} has no host; {_EXAMPLE}"
        raise UsageError(msg)
    if colon and port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5
                                    and 1 <= int(port_text) <= 65535):
        msg = f"--url {shown(url)}: the port {shown(port_text)} is not a number from 1 to 65535; {_EXAMPLE}"
        raise UsageError(msg)
    try:
        host.encode("idna")
    except UnicodeError as exc:
        why = str(exc).rpartition("UnicodeError: ")[2].rstrip(")")
        msg = f"--url {shown(url)}: {shown(host)} is not a host name ({why}); {_EXAMPLE}"
        raise UsageError(msg) from None
    base = parts.path.rstrip("/")
    if not base.isascii():
        msg = f"--url {shown(url)} has characters outside ASCII in its path; percent-encode them (%XX)"
        raise UsageError(msg)
    base = base.removesuffix(ROUTE).rstrip("/")
    return Server(parts.scheme.lower(), host, int(port_text) if port_text else None, base, parts.netloc)


def parse_timeout(raw: object) -> float:
    """``--timeout``: seconds for the whole exchange, above 0 and at most :data:`MAX_TIMEOUT_S`
    (``None``: :data:`DEFAULT_TIMEOUT_S`). :raises UsageError: naming ``--timeout``."""
    if raw is None:
        return DEFAULT_TIMEOUT_S
    seconds = math.nan
    if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
        try:
            seconds = float(raw.strip() if isinstance(raw, str) else raw)
        except (ValueError, OverflowError):
            pass
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN too
        msg = (f"--timeout {shown(raw)} is not a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (a day); "
               f"it bounds the whole exchange with the server (default {DEFAULT_TIMEOUT_S:.0f}, the server's own "
               "limit)")
        raise UsageError(msg)
    return seconds


def check_key(key: str, source: str) -> str:
    """``key`` if an HTTP header can carry it (printable latin-1, no surrounding space); the key is
    never echoed. :raises UsageError: naming ``source`` (``--api-key`` or :data:`ENV_KEY`)."""
    if not key:
        msg = (f"{source} is empty (an unset variable in --api-key \"$KEY\"?); give the server's --admin-api-key, "
               f"or leave {source} out to send none")
        raise UsageError(msg)
    for i, c in enumerate(key, 1):
        if c in "\r\n":
            why = "a line break"
        elif unicodedata.category(c) == "Cc" or ord(c) > 0xFF:
            why = _char(c)
        else:
            continue
        msg = (f"{source} has {why} at character {i} (the key is not shown); an HTTP header carries printable "
               "latin-1 characters only, so no server can receive this key: copy the server's --admin-api-key again")
        raise UsageError(msg)
    if key != key.strip():
        msg = (f"{source} starts or ends with a space, which HTTP drops from a header (the key is not shown); "
               "give the key without it")
        raise UsageError(msg)
    return key


def key_of(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The admin key: ``--api-key``, else :data:`ENV_KEY` (unset or empty: none), checked by :func:`check_key`."""
    if given is not None:
        return check_key(given, "--api-key")
    from_env = (os.environ if environ is None else environ).get(ENV_KEY) or None
    return None if from_env is None else check_key(from_env, ENV_KEY)


# -- the exchange, within one deadline --------------------------------------------------------------

CONNECTING, SENDING, HEADERS, BODY = "connecting", "sending the request", "waiting for the answer", "reading the answer"


class _Deadline:
    """The end of the exchange: each step may take what is left of ``--timeout``, no more."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        """Seconds left. :raises TimeoutError: none."""
        left = self.end - self._clock()
        if left <= 0:
            raise TimeoutError("--timeout passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes; each read waits at most what is left before the deadline, so an answer
    trickled byte by byte cannot outlast it."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        n = self._sock.recv_into(buffer)
        self.received += n
        return n


class _Socket:
    """What :class:`http.client.HTTPResponse` reads from: the socket behind the deadline."""

    def __init__(self, reader: _DeadlineReader) -> None:
        self._reader = reader

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self._reader)


class _TooLarge(Exception):
    pass


@dataclass
class _Progress:
    """Where the exchange is, for the timeout's message; the connection, to abort it."""

    stage: str = CONNECTING
    reader: _DeadlineReader | None = None
    conn: http.client.HTTPConnection | None = field(default=None, repr=False)

    def so_far(self) -> str:
        n = 0 if self.reader is None else self.reader.received
        return f"{self.stage}, {n} bytes of it so far" if self.stage in (HEADERS, BODY) else self.stage

    def abort(self) -> None:
        sock = None if self.conn is None else self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass(frozen=True)
class _Answer:
    status: int
    reason: str
    location: str | None
    data: bytes


def _read_body(answer: http.client.HTTPResponse) -> bytes:
    chunks, size = [], 0
    while chunk := answer.read(64 * 1024):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    data = b"".join(chunks)
    if answer.length:  # the connection closed before Content-Length bytes came
        raise http.client.IncompleteRead(data, answer.length)
    return data


def _exchange(server: Server, key: str | None, mode: str | None, deadline: _Deadline, progress: _Progress) -> _Answer:
    """One request on a fresh connection (``Connection: close``); redirects are answers, not followed."""
    kind = http.client.HTTPSConnection if server.scheme == "https" else http.client.HTTPConnection
    # The port always given: http.client would read an IPv6 literal's last group as one.
    conn = kind(server.host, server.port or kind.default_port, timeout=deadline.left())
    progress.conn = conn
    try:
        conn.connect()  # TCP (and TLS) within what is left; the name lookup: see request()
        progress.stage = SENDING
        method = "GET" if mode is None else "POST"
        headers = {"Accept": "application/json", "Connection": "close", "User-Agent": f"sglang-bcg/{__version__}"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = None
        if mode is not None:
            headers["Content-Type"] = "application/json"
            body = json.dumps({"mode": mode}).encode()
        assert conn.sock is not None  # connected
        conn.sock.settimeout(deadline.left())
        conn.request(method, server.base + ROUTE, body=body, headers=headers)
        progress.stage, progress.reader = HEADERS, _DeadlineReader(conn.sock, deadline)
        answer = http.client.HTTPResponse(_Socket(progress.reader), method=method)  # type: ignore[arg-type]
        try:
            answer.begin()
            progress.stage = BODY
            return _Answer(answer.status, answer.reason, answer.getheader("Location"), _read_body(answer))
        finally:
            answer.close()
    finally:
        conn.close()


def _unknown(mode: str | None, progress: _Progress) -> str:
    """What the user can know of the switch after a failure at ``progress``."""
    if mode is None:
        return ""
    if progress.stage in (CONNECTING, SENDING):
        return "; nothing was switched" if progress.stage == CONNECTING else f"; whether it switched is unknown: {_CHECK}"
    return f"; the switch may still finish on the server: {_CHECK}"


def _timed_out(server: Server, mode: str | None, seconds: float, progress: _Progress) -> str:
    return (f"no complete answer from {server.route_url} within --timeout {seconds:g} s (still {progress.so_far()})"
            f"{_unknown(mode, progress)}")


def _failure(exc: BaseException, server: Server, mode: str | None, seconds: float, progress: _Progress) -> str:
    """The line of a failed exchange. :raises BaseException: ``exc`` when it is a bug of ours."""
    route, after = server.route_url, _unknown(mode, progress)
    if isinstance(exc, TimeoutError):
        return _timed_out(server, mode, seconds, progress)
    if isinstance(exc, _TooLarge):
        return f"{route} answered more than {MAX_ANSWER_BYTES // 2**20} MiB: not the answer of {ROUTE}{after}"
    if isinstance(exc, socket.gaierror):
        return f"cannot reach {route}: the host {shown(server.host)} is not known ({exc.strerror}); check --url{after}"
    if isinstance(exc, ssl.SSLError):
        return f"https with {route} failed ({exc.reason or exc}): does the server speak https? (http:// otherwise){after}"
    if isinstance(exc, http.client.RemoteDisconnected):
        return f"{route} closed the connection without an answer{after}"
    if isinstance(exc, http.client.BadStatusLine):
        line = str(getattr(exc, "line", exc))
        return (f"{route} did not answer in HTTP (its first line: {shown(line)[:120]}): is --url the "
                f"server's HTTP address?{after}")
    if isinstance(exc, http.client.IncompleteRead):
        return f"{route} closed the connection after {len(exc.partial)} bytes of its answer's body{after}"
    if isinstance(exc, http.client.HTTPException):
        return f"{route} answered something that is not HTTP ({type(exc).__name__}: {shown(str(exc))}){after}"
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc) or type(exc).__name__
        if progress.stage == CONNECTING:
            return f"cannot reach {route}: {reason} (is the server up at {server.scheme}://{server.netloc}?){after}"
        return f"the connection to {route} broke while {progress.stage} ({reason}){after}"
    raise exc


def _error_of(status: int, data: bytes, url: str) -> str:
    try:
        text = str(json.loads(data).get("error", ""))
    except (ValueError, AttributeError, RecursionError):
        text = data.decode(errors="replace").strip()
    text = " ".join(text.split())[:500]
    if status == 401:
        return f"401 Unauthorized: {url} wants the server's --admin-api-key (--api-key KEY or {ENV_KEY})"
    if status == 403:
        return f"403 Forbidden: {url} ({text or 'the server has no --admin-api-key'})"
    if status == 404:
        return (f"404: {url} has no {ROUTE}: the server was started without --admin-api-key, or without "
                "this plugin installed (sglang-bcg doctor)")
    return f"{status}: {text or 'no reason given'}"


# -- the answer ---------------------------------------------------------------------------------------


def _is_mode_report(v: object) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, str) for m in v))


def _is_seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


_RANKS = (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects, one per TP rank")
#: The documented answer (docs/sglang.md): field -> (check, what it must be).
FIELDS_GET: dict[str, tuple[Callable[[object], bool], str]] = {
    "mode": (_is_mode_report, "an output mode, a list of them (ranks that differ) or null"),
    "ranks": _RANKS,
}
FIELDS_POST: dict[str, tuple[Callable[[object], bool], str]] = {
    "mode": (lambda v: isinstance(v, str), "the output mode asked for"),
    "previous": (lambda v: v is None or isinstance(v, str), "the previous output mode or null"),
    "seconds": (_is_seconds, "the switch's seconds, a number"),
    "ranks": _RANKS,
}


def _json_kind(v: object) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list",
             dict: "object"}
    return f"{names.get(type(v), type(v).__name__)} {_brief(v)}"


def _brief(v: object) -> str:
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool, type(None))) else repr(v)
    return text if len(text) <= 60 else f"{text[:60]}…"


def _preview(data: bytes) -> str:
    text = " ".join(data[:200].decode("utf-8", "replace").split())
    return repr(text[:60]) + ("…" if len(text) > 60 or len(data) > 200 else "")


def check_answer(body: object, mode: str | None, route: str, status: int = 200) -> dict[str, Any]:
    """``body`` if it is the documented answer of a GET (``mode=None``) or of a POST switching to
    ``mode``. :raises SwitchError: what came and what was expected."""
    fields = FIELDS_GET if mode is None else FIELDS_POST
    after = "" if mode is None else f"; nothing is reported as switched: {_CHECK}"
    expected = f"the JSON object of {ROUTE} ({', '.join(fields)})"
    where = f"{route} answered {status} with"
    if not isinstance(body, dict):
        msg = f"{where} a JSON {_json_kind(body)}, expected {expected}: is --url the SGLang server with this plugin?{after}"
        raise SwitchError(msg)
    for name, (ok, what) in fields.items():
        if name not in body:
            msg = f"{where} a JSON object without {name!r} ({what}), expected {expected}{after}"
            raise SwitchError(msg)
        if not ok(body[name]):
            msg = f"{where} a JSON object whose {name!r} is a {_json_kind(body[name])}, expected {what}{after}"
            raise SwitchError(msg)
    if mode is not None and body["mode"] != mode:
        msg = f"{where} mode {body['mode']!r}, not {mode!r} as asked{after}"
        raise SwitchError(msg)
    return body


def _parsed(answer: _Answer, server: Server, mode: str | None) -> dict[str, Any]:
    """The checked JSON of a 2xx answer. :raises SwitchError: a redirect, an error status, not the object."""
    route, status = server.route_url, answer.status
    if 300 <= status < 400:
        where = urljoin(route, answer.location) if answer.location else "nowhere (no Location)"
        what = ("it was not followed, so nothing was switched (a switch is reported only from the server's own "
                "answer to the POST)") if mode is not None else "it was not followed"
        base = where.removesuffix(ROUTE)
        msg = f"{status} {answer.reason}: {route} redirected to {where}; {what}: if that is the server, give --url {base}"
        raise SwitchError(msg)
    if not 200 <= status < 300:
        raise SwitchError(_error_of(status, answer.data, route))
    after = "" if mode is None else f"; whether it switched is unknown: {_CHECK}"
    if not answer.data.strip():
        msg = f"{route} answered {status} with an empty body, expected the JSON object of {ROUTE}{after}"
        raise SwitchError(msg)
    try:
        body = json.loads(answer.data)
    except (ValueError, RecursionError):  # not UTF-8 or not JSON; nested past the parser's depth
        msg = (f"{route} answered something that is not JSON ({status}, {len(answer.data)} bytes: "
               f"{_preview(answer.data)}), expected the JSON object of {ROUTE}: is --url the SGLang server?{after}")
        raise SwitchError(msg) from None
    return check_answer(body, mode, route, status)


def request(url: str, key: str | None, mode: str | None, timeout_s: float) -> dict[str, Any]:
    """GET (``mode=None``) or POST ``{"mode": mode}``; the checked JSON answer of a 2xx, within
    ``timeout_s`` seconds in all (``SLACK_S`` more at most where a name lookup hangs).

    :raises UsageError: a bad ``url``, ``key`` or ``timeout_s``. :raises SwitchError: any other failure."""
    server, seconds = parse_url(url), parse_timeout(timeout_s)
    if key is not None:
        check_key(key, "--api-key")
    deadline, progress = _Deadline(seconds), _Progress()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["answer"] = _exchange(server, key, mode, deadline, progress)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=work, name="sglang-bcg switch", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline.end - time.monotonic()) + SLACK_S)
    if worker.is_alive():  # a step no socket timeout bounds (a name lookup, every address of a host)
        progress.abort()
        raise SwitchError(_timed_out(server, mode, seconds, progress))
    if "error" in box:
        raise SwitchError(_failure(box["error"], server, mode, seconds, progress)) from None
    return _parsed(box["answer"], server, mode)


# -- the command ---------------------------------------------------------------------------------------


def _mib(n: object) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, int) and not isinstance(n, bool) else "?"


def _mode_text(mode: object) -> str:
    return f"{', '.join(map(str, mode))} (the ranks differ)" if isinstance(mode, list) else str(mode)


def result_line(body: dict[str, Any], mode: str | None) -> str:
    ranks = body.get("ranks", [])
    first = ranks[0] if ranks else {}
    where = (f"on {len(ranks)} TP rank(s) (scheduler pid {','.join(str(r.get('pid')) for r in ranks)}); graph pool "
             f"{_mib(first.get('pool_bytes'))}, resident outputs {_mib(first.get('resident_output_bytes'))}")
    if mode is None:
        why = f"; switch refused here: {first['refusal']}" if first.get("refusal") else ""
        return f"output mode: {_mode_text(body.get('mode'))} {where}{why}"
    return f"output mode: {body.get('mode')} (was {body.get('previous')}), switched in {body.get('seconds')} s {where}"


def run(url: str, key: str | None, mode: str | None, timeout_s: float) -> int:
    """The command: the arguments checked (:raises UsageError:), then the request in a thread and a
    progress line until it answers; 0 from the server's 2xx with the documented answer, else 1."""
    parse_url(url)  # request() checks them too; here, before the progress line
    parse_timeout(timeout_s)
    if key is not None:
        check_key(key, "--api-key")
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["body"] = request(url, key, mode, timeout_s)
        except SwitchError as exc:
            box["error"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - a bug: its traceback, from the command's thread
            box["bug"] = exc

    what = "reading the output mode of" if mode is None else f"switching the output mode to {mode} at"
    thread = threading.Thread(target=work, daemon=True)
    start = time.monotonic()
    thread.start()
    tty = sys.stderr.isatty()
    print(f"sglang-bcg switch: {what} {url.strip()} ...", file=sys.stderr, end="" if tty else "\n", flush=True)
    while thread.is_alive():
        thread.join(0.5)
        if tty:
            print(f"\rsglang-bcg switch: {what} {url.strip()} ... {time.monotonic() - start:.0f} s", file=sys.stderr,
                  end="", flush=True)
    if tty:
        print(file=sys.stderr)
    if "bug" in box:
        raise box["bug"]
    if "error" in box:
        print(f"error: {box['error']}", file=sys.stderr)
        return 1
    print(result_line(box["body"], mode))
    return 0
