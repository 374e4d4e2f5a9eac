"""``sglang-bcg switch`` against a loopback server that misbehaves: ``--timeout`` bounds the whole
exchange (a trickled answer, trickled headers, no answer), a redirect is never followed (nothing is
reported as switched), a 2xx that is not the documented object is one ``error:`` line, and bad
arguments are one ``error:`` line and exit 2 before any connection."""

from __future__ import annotations

import http.client
import json
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sglang_bcg_plugin import cli_switch
from sglang_bcg_plugin.bench import config
from sglang_bcg_plugin.bench.usage import UsageError
from sglang_bcg_plugin.cli import _parser, main

#: What a run may take beyond --timeout here: the command's own slack, threads on a loaded machine.
SLACK_S = 2.0
#: An answer trickled at one byte per TICK_S takes far longer than the timeouts below.
TICK_S = 0.05
SWITCHED = {"mode": "on", "previous": "off", "seconds": 2.5, "pids": [7],
            "ranks": [{"pid": 7, "pool_bytes": 3 * 2**20, "resident_output_bytes": 2**20}]}
SHOWN = {"mode": "off", "pids": [7], "ranks": [{"pid": 7, "refusal": None}]}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Answer = Callable[["_Handler", Seen], None]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.seen: list[Seen] = []
        self.answers: dict[str, Answer] = {}
        self.stop = threading.Event()
        self.greeting = b""  # sent on connecting, before reading anything


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.connections += 1
        try:
            if self.server.greeting:
                self.send(self.server.greeting)
                return
            line = self.rfile.readline().decode("latin-1").split()
            if len(line) != 3:
                return
            headers = {}
            while (h := self.rfile.readline().decode("latin-1").strip()):
                name, _, value = h.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", 0)))
            seen = Seen(line[0], line[1], headers, body)
            self.server.seen.append(seen)
            answer = self.server.answers.get(f"{seen.method} {seen.path}") or self.server.answers.get("*")
            if answer is not None:
                answer(self, seen)
        except OSError:  # the client gave up (it timed out): fine
            pass

    def send(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def trickle(self, data: bytes) -> None:
        """One byte per :data:`TICK_S` until the data ends or the test does."""
        for i in range(len(data)):
            if self.server.stop.wait(TICK_S):
                return
            self.send(data[i:i + 1])


def http_answer(status: int, body: bytes, *, reason: str = "X", extra: str = "", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n{extra}\r\n"
    return head.encode() + body


def answering(data: bytes) -> Answer:
    return lambda h, seen: h.send(data)


@dataclass
class Loopback:
    server: _Server
    url: str
    answers: dict[str, Answer] = field(default_factory=dict)

    def on(self, route: str, answer: Answer) -> None:
        self.server.answers[route] = answer


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield Loopback(server, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def _switch(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str, float]:
    """``sglang-bcg switch ARGV``: exit code, stdout, the last stderr line, seconds taken."""
    start = time.monotonic()
    code = main(["switch", *argv])
    took = time.monotonic() - start
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out, out.err.strip().splitlines()[-1], took


# -- --timeout bounds the whole exchange ------------------------------------------------------------


def test_a_trickled_body_ends_at_the_timeout(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.dumps({**SWITCHED, "pad": "x" * 400}).encode()  # 20 s at one byte per tick

    def slow_body(h: _Handler, seen: Seen) -> None:
        h.send(http_answer(200, b"", length=len(body)))  # the headers at once
        h.trickle(body)

    loopback.on("POST /bcg/output_mode", slow_body)
    code, out, err, took = _switch(capsys, "--url", loopback.url, "--timeout", "1", "on")
    assert code == 1 and out == ""
    assert 0.9 <= took < 1 + SLACK_S, took
    assert err.startswith(f"error: no complete answer from {loopback.url}/bcg/output_mode within --timeout 1 s "
                          "(still reading the answer, "), err
    assert "the switch may still finish on the server: check with sglang-bcg switch --show" in err


def test_trickled_headers_end_at_the_timeout(loopback: Loopback) -> None:
    head = http_answer(200, b"", extra="X-Pad: " + "y" * 300 + "\r\n")
    loopback.on("GET /bcg/output_mode", lambda h, s: h.trickle(head))
    start = time.monotonic()
    with pytest.raises(cli_switch.SwitchError) as info:
        cli_switch.request(loopback.url, None, None, 0.8)
    took = time.monotonic() - start
    assert 0.7 <= took < 0.8 + SLACK_S, took
    text = str(info.value)
    assert "within --timeout 0.8 s (still waiting for the answer, " in text and "bytes of it so far)" in text
    received = int(text.split("waiting for the answer, ")[1].split()[0])
    assert 0 < received < len(head)  # some bytes came, never the whole head
    assert "switch" not in text.split(")")[-1]  # a GET: nothing said of a switch


def test_no_answer_at_all_ends_at_the_timeout(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    loopback.on("*", lambda h, s: h.server.stop.wait(30))
    code, out, err, took = _switch(capsys, "--url", loopback.url + "/", "--timeout", "1", "--api-key", "k", "released")
    assert code == 1 and out == "" and took < 1 + SLACK_S, took
    assert "within --timeout 1 s (still waiting for the answer, 0 bytes of it so far)" in err
    seen = loopback.server.seen
    assert [(s.method, s.path) for s in seen] == [("POST", "/bcg/output_mode")]
    assert json.loads(seen[0].body) == {"mode": "released"} and seen[0].headers["authorization"] == "Bearer k"


def test_the_deadline_counts_every_step() -> None:
    ticks = iter([0.0, 0.4, 0.9, 1.2])
    deadline = cli_switch._Deadline(1.0, clock=lambda: next(ticks))
    assert deadline.left() == pytest.approx(0.6)
    assert deadline.left() == pytest.approx(0.1)
    with pytest.raises(TimeoutError):
        deadline.left()


# -- redirects: never followed -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirected_post_is_not_a_switch(status: int, loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    """The place redirected to answers the documented switched object to a GET: still not a switch."""
    loopback.on("POST /bcg/output_mode", answering(http_answer(status, b"", extra="Location: /elsewhere/bcg/output_mode\r\n")))
    loopback.on("GET /elsewhere/bcg/output_mode", answering(http_answer(200, json.dumps(SWITCHED).encode())))
    loopback.on("POST /elsewhere/bcg/output_mode", answering(http_answer(200, json.dumps(SWITCHED).encode())))
    code, out, err, _ = _switch(capsys, "--url", loopback.url, "--timeout", "10", "on")
    assert code == 1 and out == "" and "switched in" not in err
    assert err.startswith(f"error: {status} X: {loopback.url}/bcg/output_mode redirected to "
                          f"{loopback.url}/elsewhere/bcg/output_mode; it was not followed, so nothing was switched"), err
    assert err.endswith(f"give --url {loopback.url}/elsewhere")
    assert [(s.method, s.path) for s in loopback.server.seen] == [("POST", "/bcg/output_mode")]


def test_a_redirected_get_is_not_followed(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    loopback.on("GET /bcg/output_mode", answering(http_answer(302, b"", extra="Location: http://example.invalid/x\r\n")))
    code, out, err, _ = _switch(capsys, "--url", loopback.url, "--show")
    assert code == 1 and out == ""
    assert "redirected to http://example.invalid/x; it was not followed" in err
    assert len(loopback.server.seen) == 1


# -- a 2xx that is not the documented object ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"[1, 2]", "answered 200 with a JSON list [1, 2], expected the JSON object of /bcg/output_mode (mode, previous, seconds, ranks)"),
        (b"null", "answered 200 with a JSON null null, expected the JSON object"),
        (b'"on"', "answered 200 with a JSON string \"on\", expected"),
        (b"17", "answered 200 with a JSON number 17, expected"),
        (json.dumps({**SWITCHED, "seconds": "2.5"}).encode(), "whose 'seconds' is a string \"2.5\", expected the switch's seconds, a number"),
        (json.dumps({**SWITCHED, "seconds": True}).encode(), "whose 'seconds' is a boolean true"),
        (json.dumps({**SWITCHED, "ranks": {"pid": 7}}).encode(), "whose 'ranks' is a object {\"pid\": 7}, expected a list of objects"),
        (json.dumps({**SWITCHED, "ranks": [7]}).encode(), "whose 'ranks' is a list [7], expected a list of objects"),
        (json.dumps({**SWITCHED, "previous": 1}).encode(), "whose 'previous' is a number 1"),
        (json.dumps({k: v for k, v in SWITCHED.items() if k != "mode"}).encode(), "a JSON object without 'mode'"),
        (json.dumps({k: v for k, v in SWITCHED.items() if k != "ranks"}).encode(), "a JSON object without 'ranks'"),
        (json.dumps({**SWITCHED, "mode": "off"}).encode(), "answered 200 with mode 'off', not 'on' as asked"),
        (b'{"mode": "on", "previous": "off", "seconds": NaN, "ranks": []}', "whose 'seconds' is a number NaN"),
        (b"{", "answered something that is not JSON (200, 1 bytes: '{')"),
        (b"\xff\xfe{}", "answered something that is not JSON (200, 4 bytes:"),
        (b"[" * 200_000, "answered something that is not JSON (200, 200000 bytes: '[[[["),
        (b"", "answered 200 with an empty body, expected the JSON object of /bcg/output_mode"),
        (b"  \n", "answered 200 with an empty body"),
    ],
)
def test_a_2xx_that_is_not_the_object_is_one_line(
    body: bytes, expected: str, loopback: Loopback, capsys: pytest.CaptureFixture[str]
) -> None:
    loopback.on("POST /bcg/output_mode", answering(http_answer(200, body)))
    code, out, err, _ = _switch(capsys, "--url", loopback.url, "--timeout", "10", "on")
    assert code == 1 and out == ""
    assert err.startswith(f"error: {loopback.url}/bcg/output_mode "), err
    assert expected in err, err
    assert err.endswith("check with sglang-bcg switch --show") and len(err) < 600


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"[]", "answered 200 with a JSON list [], expected the JSON object of /bcg/output_mode (mode, ranks)"),
        (b'{"mode": 3, "ranks": []}', "whose 'mode' is a number 3, expected an output mode, a list of them"),
        (b'{"mode": "on"}', "without 'ranks'"),
    ],
)
def test_a_show_answer_that_is_not_the_object(body: bytes, expected: str, loopback: Loopback) -> None:
    loopback.on("GET /bcg/output_mode", answering(http_answer(200, body)))
    with pytest.raises(cli_switch.SwitchError, match="^" + __import__("re").escape(f"{loopback.url}/bcg/output_mode answered")) as info:
        cli_switch.request(loopback.url, None, None, 10)
    assert expected in str(info.value) and "switch" not in str(info.value).rpartition(";")[2]


def test_the_documented_answers_are_printed(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    """A POST under a path prefix (a proxy's), the route not doubled; a chunked GET; an answer
    without a length, ended by closing; ranks that differ."""
    switched = json.dumps(SWITCHED).encode()
    loopback.on("POST /proxy/bcg/output_mode", answering(http_answer(201, switched)))
    chunked = json.dumps({**SHOWN, "mode": ["off", "on"]}).encode()
    loopback.on("GET /proxy/bcg/output_mode", answering(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(part), part) for part in (chunked[:10], chunked[10:])) + b"0\r\n\r\n"))
    loopback.on("GET /bcg/output_mode", answering(b"HTTP/1.0 200 OK\r\n\r\n" + json.dumps(SHOWN).encode()))
    code, out, err, _ = _switch(capsys, "--url", f" {loopback.url}/proxy/bcg/output_mode ", "ON", "--timeout", "5")
    assert code == 0 and err == f"sglang-bcg switch: switching the output mode to on at {loopback.url}/proxy/bcg/output_mode ..."
    assert out == ("output mode: on (was off), switched in 2.5 s on 1 TP rank(s) (scheduler pid 7); graph pool 3.0 MiB, "
                   "resident outputs 1.0 MiB\n")
    post = loopback.server.seen[-1]
    assert (post.method, post.path, json.loads(post.body)) == ("POST", "/proxy/bcg/output_mode", {"mode": "on"})
    assert post.headers["content-type"] == "application/json" and "authorization" not in post.headers
    assert cli_switch.request(f"{loopback.url}/proxy", None, None, 5)["mode"] == ["off", "on"]
    assert cli_switch.result_line(cli_switch.request(f"{loopback.url}/proxy", None, None, 5), None).startswith(
        "output mode: off, on (the ranks differ) on 1 TP rank(s)")
    assert cli_switch.request(loopback.url, None, None, 5) == SHOWN


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (http_answer(500, b'{"error": "re-capture failed: boom; the previous mode \'off\' was re-captured"}'),
         "error: 500: re-capture failed: boom; the previous mode 'off' was re-captured"),
        (http_answer(503, b"<html>\nbad gateway</html>"), "error: 503: <html> bad gateway</html>"),
        (http_answer(409, b'{"error": "a switch to \'on\' is running"}'), "error: 409: a switch to 'on' is running"),
        (http_answer(200, b"{}", length=50), "closed the connection after 2 bytes of its answer's body; the switch may still finish"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "did not answer in HTTP (its first line: 'SSH-2.0-OpenSSH_9.6"),
        (b"", "closed the connection without an answer; the switch may still finish on the server"),
        (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", "answered something that is not HTTP (LineTooLong: "),
        (http_answer(200, b"x" * 100, length=cli_switch.MAX_ANSWER_BYTES + 1)[:200], "closed the connection after"),
    ],
)
def test_error_answers_are_one_line(data: bytes, expected: str, loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    loopback.on("POST /bcg/output_mode", answering(data))
    code, out, err, _ = _switch(capsys, "--url", loopback.url, "--timeout", "10", "on")
    assert code == 1 and out == "" and expected in err, err


def test_an_answer_too_large_is_refused(loopback: Loopback, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_switch, "MAX_ANSWER_BYTES", 1000)
    loopback.on("GET /bcg/output_mode", answering(http_answer(200, b" " * 5000)))
    with pytest.raises(cli_switch.SwitchError, match="answered more than 0 MiB: not the answer of /bcg/output_mode$"):
        cli_switch.request(loopback.url, None, None, 5)


def test_a_closed_port_and_an_unknown_host(loopback: Loopback) -> None:
    url = loopback.url
    loopback.server.stop.set()
    loopback.server.shutdown()
    loopback.server.server_close()
    with pytest.raises(cli_switch.SwitchError, match=r"^cannot reach .*: Connection refused \(is the server up at .*\?\); nothing was switched$"):
        cli_switch.request(url, None, "off", 5)
    with pytest.raises(cli_switch.SwitchError, match=r"^cannot reach http://no-such-host\.invalid/bcg/output_mode: the host "):
        cli_switch.request("http://no-such-host.invalid", None, None, 5)


def test_a_connection_reset_and_a_tls_mismatch(loopback: Loopback) -> None:
    def reset(h: _Handler, seen: Seen) -> None:
        h.send(http_answer(200, b'{"mode"', length=100))
        h.server.stop.wait(0.2)
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
        h.connection.close()

    loopback.on("POST /bcg/output_mode", reset)
    with pytest.raises(cli_switch.SwitchError, match=r"broke while (waiting for|reading) the answer \(Connection reset by "
                                                     r"peer\); the switch may still finish on the server"):
        cli_switch.request(loopback.url, None, "on", 10)
    loopback.server.greeting = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"  # plain HTTP to a TLS hello
    https = loopback.url.replace("http://", "https://")
    with pytest.raises(cli_switch.SwitchError, match=r"^https with https://127\.0\.0\.1:\d+/bcg/output_mode failed \(.+\): "
                                                     r"does the server speak https\? \(http:// otherwise\); nothing was switched$"):
        cli_switch.request(https, None, "on", 10)


def test_a_step_no_socket_timeout_bounds_ends_too(loopback: Loopback, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name lookup that hangs (stood in by a connect that sleeps): given up SLACK_S after --timeout."""
    release = threading.Event()
    connect = http.client.HTTPConnection.connect

    def hanging(self: http.client.HTTPConnection) -> None:
        release.wait(10)

    def connected_then_hanging(self: http.client.HTTPConnection) -> None:
        connect(self)
        release.wait(10)

    try:
        for stand_in, stage in ((hanging, "connecting); nothing was switched"), (connected_then_hanging, "connecting); nothing was switched")):
            monkeypatch.setattr(http.client.HTTPConnection, "connect", stand_in)
            start = time.monotonic()
            with pytest.raises(cli_switch.SwitchError) as info:
                cli_switch.request(loopback.url, None, "off", 0.3)
            assert "within --timeout 0.3 s (still " + stage in str(info.value), info.value
            assert time.monotonic() - start < 0.3 + cli_switch.SLACK_S + SLACK_S
    finally:
        release.set()


def test_the_address_connected_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheme's port where none is given, an IPv6 literal whole."""
    tried: list[tuple[str, int]] = []

    def refuse(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        tried.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    for url in ("http://[::1]", "http://[::1]:8080/", "https://Example.invalid", "HTTP://h:81/p/bcg/output_mode/"):
        with pytest.raises(cli_switch.SwitchError, match=r"^cannot reach .*: Connection refused \(is the server up at"):
            cli_switch.request(url, "k", None, 5)
    assert tried == [("::1", 80), ("::1", 8080), ("example.invalid", 443), ("h", 81)]


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, loopback: Loopback) -> None:
    def broken(*args: Any) -> Any:
        raise ZeroDivisionError("ours")

    monkeypatch.setattr(cli_switch, "_exchange", broken)
    with pytest.raises(ZeroDivisionError):
        cli_switch.request(loopback.url, None, None, 5)
    with pytest.raises(ZeroDivisionError):
        cli_switch.run(loopback.url, None, None, 5)


# -- bad arguments: exit 2 before any connection -------------------------------------------------------


def _bad_arguments(url: str) -> list[tuple[list[str], str]]:
    host = url.removeprefix("http://")
    return [
        (["--url", "", "on"], "error: --url is empty; give the server's HTTP address"),
        (["--url", "   ", "--show"], "error: --url is empty"),
        (["--url", host, "on"], f"error: --url '{host}' has no scheme; write http:// (or https://) before the host: --url http://{host}"),
        (["--url", f"ftp://{host}", "on"], "error: --url 'ftp://127.0.0.1:"),
        (["--url", f"ws://{host}", "on"], "has the scheme 'ws'; the server's HTTP address starts with http:// or https://"),
        (["--url", "http://127.0.0.1:port", "on"], "the port 'port' is not a number from 1 to 65535"),
        (["--url", "http://127.0.0.1:99999", "on"], "the port '99999' is not a number from 1 to 65535"),
        (["--url", "http://127.0.0.1:0", "on"], "the port '0' is not"),
        (["--url", "http://127.0.0.1:" + "9" * 5000, "on"], "characters): the port "),
        (["--url", "http://", "on"], "error: --url 'http://' has no host"),
        (["--url", f"{url}/?x=1", "on"], "has a query or a fragment"),
        (["--url", f"http://admin:hunter2@{host}", "on"], "error: --url has credentials before the host (http://…@127.0.0.1:"),
        (["--url", f"{url}/a b", "on"], "contains U+0020 (SPACE)"),
        (["--url", f"{url}/é", "on"], "has characters outside ASCII in its path"),
        (["--url", "http://[::1", "on"], "is not a URL (Invalid IPv6 URL)"),
        (["--url", "http://a..b:1", "on"], "error: --url 'http://a..b:1': 'a..b' is not a host name (label empty or too long)"),
        (["--url", url, "--timeout", "soon", "on"], "error: --timeout 'soon' is not a number of seconds above 0 and at most 86400"),
        (["--url", url, "--timeout", "0", "on"], "error: --timeout '0' is not"),
        (["--url", url, "--timeout", "-5", "on"], "error: --timeout '-5' is not"),
        (["--url", url, "--timeout", "nan", "on"], "error: --timeout 'nan' is not"),
        (["--url", url, "--timeout", "inf", "on"], "error: --timeout 'inf' is not"),
        (["--url", url, "--timeout", "1e300", "on"], "error: --timeout '1e300' is not"),
        (["--url", url, "--timeout", "86401", "on"], "error: --timeout '86401' is not"),
        (["--url", url, "--api-key", "", "on"], "error: --api-key is empty"),
        (["--url", url, "--api-key", "hunter2\r\nX-Evil: 1", "on"], "error: --api-key has a line break at character 8 (the key is not shown)"),
        (["--url", url, "--api-key", "hunter2\x00", "on"], "error: --api-key has U+0000 (a control character) at character 8"),
        (["--url", url, "--api-key", "hunter2\x85", "on"], "has U+0085 (a control character)"),
        (["--url", url, "--api-key", "hunter2\u2028", "--show"], "has U+2028 (LINE SEPARATOR) at character 8"),
        (["--url", url, "--api-key", "κλειδί", "on"], "has U+03BA (GREEK SMALL LETTER KAPPA) at character 1"),
        (["--url", url, "--api-key", "hunter2 ", "on"], "error: --api-key starts or ends with a space"),
    ]


def test_bad_arguments_are_one_line_before_any_connection(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, expected in _bad_arguments(loopback.url):
        code = main(["switch", *argv])
        err = capsys.readouterr()
        lines = err.err.strip().splitlines()
        assert code == 2 and err.out == "" and len(lines) == 1, (argv, err)
        assert lines[0].startswith("error: --") and expected in lines[0], (argv, lines)
        assert "hunter2" not in lines[0] and "Traceback" not in err.err
    assert loopback.server.connections == 0


def test_a_bad_key_from_the_environment_names_the_variable(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cli_switch.ENV_KEY, "top\tsecret")
    assert main(["switch", "--url", loopback.url, "off"]) == 2
    assert capsys.readouterr().err == (f"error: {cli_switch.ENV_KEY} has U+0009 (a control character) at character 4 (the "
                                       "key is not shown); an HTTP header carries printable latin-1 characters only, so no "
                                       "server can receive this key: copy the server's --admin-api-key again\n")
    assert cli_switch.key_of("given") == "given"  # --api-key wins over the variable
    monkeypatch.setenv(cli_switch.ENV_KEY, "")
    assert cli_switch.key_of(None) is None
    assert cli_switch.key_of(None, {cli_switch.ENV_KEY: "clé"}) == "clé"  # latin-1 travels
    assert loopback.server.connections == 0


def test_argparse_errors_and_the_functions_check_too(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["switch", "--url", loopback.url, "sometimes"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: argument mode: invalid choice: 'sometimes' (choose from 'off', 'on', "
                                       "'released') (see sglang-bcg switch --help)\n")
    for call in (lambda: cli_switch.run("127.0.0.1:1", None, "on", 5), lambda: cli_switch.run(loopback.url, None, "on", 0),
                 lambda: cli_switch.request("", None, None, 5), lambda: cli_switch.run(loopback.url, "a\nb", "on", 5)):
        with pytest.raises(UsageError):
            call()
    assert cli_switch.parse_timeout(None) == 900 and cli_switch.parse_timeout(" 0.25 ") == 0.25
    assert cli_switch.parse_timeout(2) == 2.0
    for bad in (True, [], 10**400):
        with pytest.raises(UsageError, match="--timeout"):
            cli_switch.parse_timeout(bad)
    server = cli_switch.parse_url("HTTPS://[::1]:8443/a//")
    assert (server.scheme, server.host, server.port, server.base) == ("https", "::1", 8443, "/a")
    assert server.route_url == "https://[::1]:8443/a/bcg/output_mode"
    assert loopback.server.connections == 0
    assert capsys.readouterr().err == ""


def test_debug_keeps_exit_2_and_shows_the_traceback(loopback: Loopback, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--debug", "switch", "--url", "", "on"], ["switch", "--url", loopback.url, "--timeout", "x", "on", "--debug"],
                 ["-v", "switch", "--url", "ftp://x", "--show"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "UsageError" in err and err.splitlines()[-1].startswith("error: --"), err
    assert loopback.server.connections == 0


def test_debug_keeps_exit_2_in_the_real_command() -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for argv in (["--debug", "switch", "--url", "http://127.0.0.1:x", "on"], ["bench", "--debug", "--device", "tpu"]):
        proc = subprocess.run([sys.executable, "-m", "sglang_bcg_plugin", *argv], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 2, proc
        assert "Traceback" in proc.stderr and proc.stderr.splitlines()[-1].startswith("error: --"), proc.stderr


# -- flag values in any case ----------------------------------------------------------------------------


def test_flag_values_in_any_case() -> None:
    args = _parser().parse_args(["bench", "--backends", "FULL, Breakable", "--variants", "ON,Off", "--device", " CPU ",
                                 "--model", "Synthetic", "--dtype", "FP32", "--hidden", "16", "--heads", "2",
                                 "--kv-heads", "1", "--layers", "1", "--max-tokens", "8"])
    assert (args.model, args.dtype) == ("synthetic", "fp32")
    cfg = config.build_config(args, ["breakable", "full", "piecewise", "graph-trees"])
    assert (cfg.backends, cfg.variants, cfg.device) == (["full", "breakable"], ["on", "off"], "cpu")
    assert _parser().parse_args(["switch", "--url", "u", " Released "]).mode == "released"
    assert _parser().parse_args(["bench", "--backends", "Graph-Trees"]).backends == "Graph-Trees"
    assert config._names("--backends", "Graph-Trees,PIECEWISE", ["piecewise", "graph-trees"]) == ["graph-trees", "piecewise"]
    assert config._names("--backends", "Mine,mine", ["Mine", "mine"]) == ["Mine", "mine"]  # exact spelling first
    for raw, expected in (("full,FULL", "--backends 'full,FULL' lists full more than once; give each once"),
                          ("FULL,nope", "unknown backends ['nope']; give a comma-separated list of: full, piecewise")):
        with pytest.raises(UsageError) as info:
            config._names("--backends", raw, ["full", "piecewise"])
        assert str(info.value) == expected


def test_flag_values_in_any_case_through_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.bench import runner

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started")

    monkeypatch.setattr(runner, "warm_up", forbidden)
    assert main(["bench", "--backends", "FULL", "--variants", "INDUCTOR", "--device", "Cuda:x"]) == 2
    assert capsys.readouterr().err == "error: --device 'Cuda:x' is not supported; use cpu, cuda or cuda:N\n"
    assert main(["bench", "--backends", "Breakable", "--variants", "Inductor"]) == 2
    assert "--variants inductor is run only by --backends full or piecewise, and --backends breakable has none" in (
        capsys.readouterr().err)


def test_wait_follows_the_captures_between_batches_to_their_end(loopback: Loopback, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--wait`` (incremental capture): after the switch answers, a GET a second until no rank captures between
    batches; the result line has the pool as it is then. A failed step ends the wait (its sizes stay eager), the
    decode graphs still to come do not; ``--timeout`` bounds the whole command, the wait too."""
    monkeypatch.setattr(cli_switch, "POLL_S", 0.05)

    def ranks(captured: int, decode: bool = False, failed: str | None = None, pool: int = 2**20) -> list[dict[str, Any]]:
        return [{"pid": 7, "pool_bytes": pool, "resident_output_bytes": 0,
                 "incremental": {"captured": captured, "sizes": 3, "decode_pending": decode, "capture_failed": failed}}]

    shown = iter([ranks(1, decode=True), ranks(2), ranks(3, pool=3 * 2**20)])
    loopback.on("POST /bcg/output_mode", answering(http_answer(200, json.dumps({**SWITCHED, "ranks": ranks(0, True)}).encode())))
    loopback.on("GET /bcg/output_mode", lambda h, s: h.send(http_answer(200, json.dumps({**SHOWN, "ranks": next(shown)}).encode())))
    assert main(["switch", "--url", loopback.url, "--wait", "on"]) == 0
    out, err = capsys.readouterr()
    assert [s.method for s in loopback.server.seen] == ["POST", "GET", "GET", "GET"]
    assert out.startswith("output mode: on (was off), switched in 2.5 s on 1 TP rank(s) (scheduler pid 7); graph pool "
                          "3.0 MiB, resident outputs 0.0 MiB; the captures between batches ended "), out
    assert "prefill sizes captured" not in out and "waiting for the captures between batches (0 of 3 prefill sizes " \
        "captured, the others and the decode graphs come between batches) ..." in err, err
    # without --wait: the answer says what is still to come
    loopback.server.seen.clear()
    assert main(["switch", "--url", loopback.url, "on"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "; 0 of 3 prefill sizes captured, the others and the decode graphs come between batches (--show gives the "
        "progress)") and len(loopback.server.seen) == 1
    # a failed step ends the wait (the decode graphs done): its sizes stay eager
    shown = iter([ranks(1, failed="RuntimeError: CUDA out of memory")])
    assert main(["switch", "--url", loopback.url, "--wait", "on"]) == 0
    assert "; 1 of 3 prefill sizes captured, the others eager (a capture step failed: RuntimeError: CUDA out of " \
        "memory); the captures between batches ended " in capsys.readouterr().out
    # captures that never end: --timeout bounds the whole command
    loopback.on("GET /bcg/output_mode", lambda h, s: h.send(http_answer(200, json.dumps({**SHOWN, "ranks": ranks(1)}).encode())))
    start = time.monotonic()
    assert main(["switch", "--url", loopback.url, "--timeout", "0.6", "--wait", "--show"]) == 1
    assert time.monotonic() - start < 0.6 * 2 + SLACK_S
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --timeout passed while the server captures between batches (1 of 3 prefill sizes captured, the others "
        "come between batches); it serves and captures on: check with sglang-bcg switch --show")
