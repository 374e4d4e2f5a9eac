"""``sglang-bcg switch``: the client of a running server's ``/bcg/output_mode`` (docs/sglang.md),
standard library only: one request, a progress line on stderr, one result line on stdout."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

ROUTE = "/bcg/output_mode"
#: Where the key is read when ``--api-key`` is not given (keeps it off the process list).
ENV_KEY = "SGLANG_BCG_ADMIN_API_KEY"


class SwitchError(Exception):
    """One line for the user; never a traceback."""


def _error_of(status: int, data: bytes, url: str) -> str:
    try:
        text = str(json.loads(data).get("error", ""))
    except (ValueError, AttributeError):
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


def request(url: str, key: str | None, mode: str | None, timeout_s: float) -> dict[str, Any]:
    """GET (``mode=None``) or POST ``{"mode": mode}``; the JSON answer. :raises SwitchError: any failure."""
    full = url.rstrip("/") + ROUTE
    data = None if mode is None else json.dumps({"mode": mode}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(full, data=data, headers=headers, method="GET" if mode is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the operator's URL
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        raise SwitchError(_error_of(exc.code, exc.read(), full)) from None
    except urllib.error.URLError as exc:
        raise SwitchError(f"cannot reach {full}: {exc.reason} (is the server up at {url}?)") from None
    except (TimeoutError, OSError) as exc:
        raise SwitchError(f"no answer from {full} in {timeout_s:.0f} s ({exc})") from None
    except ValueError as exc:
        raise SwitchError(f"{full} answered something that is not JSON ({exc})") from None


def _mib(n: object) -> str:
    return f"{int(n) / 2**20:.1f} MiB" if isinstance(n, int) else "?"


def result_line(body: dict[str, Any], mode: str | None) -> str:
    ranks = body.get("ranks", [])
    first = ranks[0] if ranks else {}
    where = (f"on {len(ranks)} TP rank(s) (scheduler pid {','.join(str(r.get('pid')) for r in ranks)}); graph pool "
             f"{_mib(first.get('pool_bytes'))}, resident outputs {_mib(first.get('resident_output_bytes'))}")
    if mode is None:
        why = f"; switch refused here: {first['refusal']}" if first.get("refusal") else ""
        return f"output mode: {body.get('mode')} {where}{why}"
    return f"output mode: {body.get('mode')} (was {body.get('previous')}), switched in {body.get('seconds')} s {where}"


def run(url: str, key: str | None, mode: str | None, timeout_s: float) -> int:
    """The command: the request in a thread, a progress line until it answers."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["body"] = request(url, key, mode, timeout_s)
        except SwitchError as exc:
            box["error"] = str(exc)

    what = "reading the output mode of" if mode is None else f"switching the output mode to {mode} at"
    thread = threading.Thread(target=work, daemon=True)
    start = time.monotonic()
    thread.start()
    tty = sys.stderr.isatty()
    print(f"sglang-bcg switch: {what} {url} ...", file=sys.stderr, end="" if tty else "\n", flush=True)
    while thread.is_alive():
        thread.join(0.5)
        if tty:
            print(f"\rsglang-bcg switch: {what} {url} ... {time.monotonic() - start:.0f} s", file=sys.stderr, end="", flush=True)
    if tty:
        print(file=sys.stderr)
    if "error" in box:
        print(f"error: {box['error']}", file=sys.stderr)
        return 1
    print(result_line(box["body"], mode))
    return 0


def key_of(given: str | None) -> str | None:
    return given if given is not None else (os.environ.get(ENV_KEY) or None)
