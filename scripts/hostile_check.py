"""Hostile-input check of the three ways fisherscope is driven: the embedded service, the API with Redis
and a worker, and the command line.

Why a script beside the tests: the tests check each guard in-process, one at a time; what an operator
meets shows up in the running programs only: a regex that holds a worker and freezes the process, a
body that crashes the framework before any handler, an /api path the dashboard answers with its HTML
page, a command that ends in a traceback. This sends a catalogue of hostile but realistic inputs to real
processes on loopback and counts what came back, so that a change in any layer is checked end to end
in a few minutes:

    .venv/bin/python scripts/hostile_check.py [--quick]

`--quick` skips the Redis target (`--only NAME` runs one target, `--keep DIR` leaves the services'
logs and folders in DIR). The table counts, per target, the requests (or commands), their
answers (2xx / 4xx / 5xx; for commands exit 0 / exit 2), hangs (no answer within 30 s, /healthz silent
for 5 s after a case, a job not finished within 120 s), broken connections, tracebacks (a command that
printed one or exited with another code than 0 or 2) and HTML answers under /api/. Exit code 1 when
any of 5xx, hangs, broken connections, tracebacks or HTML under /api/ is not zero, or a target could not
be started; 0 otherwise. Cases that ended otherwise than expected without failing (a 404 where a 405
belongs, an error message of two lines) are listed under the table all the same.

Everything runs on 127.0.0.1 with its own folders under a temporary directory, Redis in db 15 only. The
script never imports torch: models load in the processes it starts, and it stops every one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from frontend.devserver import (  # noqa: E402  (after the path, when run from elsewhere)
    ServiceDidNotStart,
    free_port,
    wait_for_health,
    wait_until_ready,
)

PYTHON = sys.executable
FISHERSCOPE = str(Path(sys.executable).with_name("fisherscope"))
MODEL = "tiny-random"
REDIS_URL = "redis://127.0.0.1:6379/15"
QUEUE_NAME = "hostile-check"
REQUEST_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
RECOVERY_S = 30.0  # after a silent /healthz: how long the service may take to answer again
JOB_TIMEOUT_S = 120.0
CLI_TIMEOUT_S = 120.0
START_TIMEOUT_S = 180.0
READY_TIMEOUT_S = 300.0
ZEROS = "0" * 64
SEED = secrets.randbelow(2**31)  # fresh study ids on every run: the studies run, none comes from a cache

CLIENT_ERROR = range(400, 500)
ANSWERED = range(200, 500)  # anything but a server error
ACCEPTED_OR_REFUSED = (200, 202, *CLIENT_ERROR)
JOB_ROUTES = ("/api/v1/analyses", "/api/v1/studies")
CALLBACK = "/_dash-update-component"
FAILURES = ("5xx", "hangs", "errors", "tracebacks", "html")
COLUMNS = (
    ("cases", "cases"),
    ("ok", "2xx|0"),
    ("refused", "4xx|2"),
    ("5xx", "5xx"),
    ("other", "other"),
    ("hangs", "hangs"),
    ("errors", "errors"),
    ("tracebacks", "tracebacks"),
    ("html", "html/api"),
    ("unexpected", "unexpected"),
)

REGEX_PATTERNS = {  # reward patterns a person may send; none may hold a worker
    "backtracking with a look-ahead": r"([\s\S]|[\s\S])*(?!)",
    "repeat count 2**32-1": "a{4294967295}",
    "repeat range to 10**11": "a{1,99999999999}",
    "499 open parentheses": "(" * 499,
    "target as a group name": "(?P<{target}>.)",
    "backreference": r"(a)\1",
    "empty pattern": "",
    "nested repeats 100**3": "((a{100}){100}){100}",
}
RE2_ONLY = r"([\s\S]|[\s\S])*\x00{target}"  # backtracks in Python's re, linear in RE2: must finish fast
PROMPT = {"prompt": "Two plus three is", "target": " 2+3"}


class TargetDown(RuntimeError):
    """The service stopped answering /healthz: the rest of its cases would only time out."""


@dataclass
class Tally:
    """What one target answered: counts per kind, and every case that was not as expected."""

    target: str
    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a burst counts from several threads

    def add(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    def note(self, case: str, what: str) -> None:
        with self.lock:
            self.counts["unexpected"] += 1
            self.notes.append(f"{case}: {what}")

    def failed(self) -> bool:
        return any(self.counts[kind] for kind in (*FAILURES, "unstarted"))


def describe(expect: Container[int]) -> str:
    if expect == CLIENT_ERROR:
        return "4xx"
    if expect == ANSWERED:
        return "no 5xx"
    if expect == ACCEPTED_OR_REFUSED:
        return "202 or 4xx"
    codes = sorted(expect)  # type: ignore[call-overload]
    if len(codes) <= 4:
        return " or ".join(map(str, codes))
    missing = sorted(set(range(codes[0], codes[-1] + 1)) - set(codes))
    return f"{codes[0]}-{codes[-1]}" + (f" but {', '.join(map(str, missing))}" if missing else "")


def status_kind(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if 400 <= status < 500:
        return "refused"
    if status >= 500:
        return "5xx"
    return "other"


def is_html(answer: httpx.Response) -> bool:
    start = answer.content[:64].lstrip().lower()
    return "text/html" in answer.headers.get("content-type", "") or start.startswith((b"<!doctype", b"<html"))


def brief(answer: httpx.Response, limit: int = 160) -> str:
    text = " ".join(answer.text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- HTTP


class HttpTarget:
    """Sends the cases to one running service and judges each answer, then checks /healthz."""

    def __init__(self, tally: Tally, url: str) -> None:
        self.tally = tally
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self.client.close()

    def send(
        self,
        case: str,
        method: str,
        path: str,
        expect: Container[int],
        *,
        health: bool = True,
        client: httpx.Client | None = None,
        **kwargs: Any,
    ) -> httpx.Response | None:
        """One request; counted and judged. An accepted job (202/200 from a job route) is followed."""
        self.tally.add("cases")
        answer = self._request(case, client or self.client, method, path, **kwargs)
        if answer is not None:
            self._judge(case, method, path, expect, answer)
            if method == "POST" and path in JOB_ROUTES and answer.status_code in (200, 202):
                self.follow_job(case, path, answer)
        if health:
            self.check_health(case)
        return answer

    def _request(
        self, case: str, client: httpx.Client, method: str, path: str, **kwargs: Any
    ) -> httpx.Response | None:
        try:
            return client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            self.tally.add("hangs")
            self.tally.note(case, f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
        except httpx.HTTPError as error:
            self.tally.add("errors")
            self.tally.note(case, f"connection failed: {type(error).__name__}: {error}")
        return None

    def _judge(
        self, case: str, method: str, path: str, expect: Container[int], answer: httpx.Response
    ) -> None:
        status = answer.status_code
        self.tally.add(status_kind(status))
        under_api = path.startswith("/api/")
        if under_api and is_html(answer):
            self.tally.add("html")
            self.tally.note(case, f"{status} text/html under /api/: {brief(answer, 80)}")
        elif status not in expect:
            self.tally.note(case, f"{status} {brief(answer)} (expected {describe(expect)})")
        elif (
            under_api
            and status >= 400
            and method != "HEAD"
            and "json" not in answer.headers.get("content-type", "")
        ):
            self.tally.note(case, f"{status} answered as {answer.headers.get('content-type')!r}, not JSON")

    def healthy(self) -> bool:
        try:
            return self.client.get("/healthz", timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def check_health(self, case: str) -> None:
        """A silent /healthz after a case is a hang; if it stays silent, the target is abandoned."""
        if self.healthy():
            return
        self.tally.add("hangs")
        self.tally.note(case, f"/healthz did not answer within {HEALTH_TIMEOUT_S:.0f} s after it")
        deadline = time.monotonic() + RECOVERY_S
        while time.monotonic() < deadline:
            if self.healthy():
                return
            time.sleep(1)
        raise TargetDown(f"/healthz silent for {RECOVERY_S:.0f} s after {case!r}")

    def follow_job(self, case: str, route: str, answer: httpx.Response) -> None:
        """Wait for an accepted job to end (done, or failed with a reason), /healthz answering meanwhile."""
        try:
            public = answer.json()
            url, status = f"{route}/{public['id']}", public["status"]
        except (ValueError, KeyError, TypeError):
            self.tally.note(case, f"accepted without an id and status: {brief(answer)}")
            return
        started = time.monotonic()
        while status not in ("done", "failed"):
            if time.monotonic() - started > JOB_TIMEOUT_S:
                self.tally.add("hangs")
                self.tally.note(case, f"the job was still {status} after {JOB_TIMEOUT_S:.0f} s")
                return
            time.sleep(1)
            self.check_health(f"{case} (while its job runs)")
            polled = self._request(f"{case} (polling its job)", self.client, "GET", url)
            if polled is None:
                return
            if polled.status_code != 200:
                self.tally.add(status_kind(polled.status_code))
                self.tally.note(case, f"polling the job: {polled.status_code} {brief(polled)}")
                return
            try:
                public = polled.json()
                status = public["status"]
            except (ValueError, KeyError, TypeError):
                self.tally.note(case, f"polling the job: not a job's JSON: {brief(polled)}")
                return
        self._report_job(case, public, time.monotonic() - started)

    def _report_job(self, case: str, public: dict, seconds: float) -> None:
        reason = public.get("error") or next(
            (part.get("error") for part in public.get("parts") or [] if part.get("error")), None
        )
        if public["status"] == "failed" and not reason:
            self.tally.note(case, "the job failed without a reason")
        said = f": {' '.join(str(reason).split())[:140]}" if reason else ""
        self.tally.info.append(f"{case}: job {public['status']} after {seconds:.0f} s{said}")


# --------------------------------------------------------------------------------- HTTP catalogue


@dataclass(frozen=True)
class Probe:
    """One request of a catalogue and the statuses that are right for it."""

    case: str
    method: str
    path: str
    expect: Container[int]
    options: dict[str, Any] = field(default_factory=dict)  # httpx keyword arguments: json, content, headers

    def send(self, target: HttpTarget) -> httpx.Response | None:
        return target.send(self.case, self.method, self.path, self.expect, **self.options)


def study_body(pattern: str, prompt: dict | None = None) -> dict:
    prompts = [prompt or PROMPT]
    reward = {"kind": "regex", "pattern": pattern}
    return {
        "model": MODEL,
        "prompts": prompts,
        "samples": 1,
        "max_tokens": 32,
        "seed": SEED,
        "reward": reward,
    }


def regex_probes() -> Iterator[Probe]:
    """Reward patterns: refused at POST (4xx) or run to an end, the service answering throughout."""
    studies = JOB_ROUTES[1]
    for name, pattern in REGEX_PATTERNS.items():
        yield Probe(
            f"study reward regex: {name}", "POST", studies, ACCEPTED_OR_REFUSED, {"json": study_body(pattern)}
        )
    yield Probe(
        "study reward regex: RE2-only pattern", "POST", studies, (200, 202), {"json": study_body(RE2_ONLY)}
    )
    expanding = {"prompt": "Say ab", "target": "ab" * 5_000}  # the pattern repeats a 10k target 125 times
    yield Probe(
        "study reward regex: target expanded 125 times",
        "POST",
        studies,
        ACCEPTED_OR_REFUSED,
        {"json": study_body("{target}" * 125, expanding)},
    )


def unrouted_probes() -> Iterator[Probe]:
    """Paths and methods no route serves, or parameters out of range: JSON 4xx, never the dashboard."""
    for method in ("GET", "DELETE", "PUT", "HEAD"):
        yield Probe(f"{method} /api/v1/nope", method, "/api/v1/nope", (404,))
    analysis, study = f"/api/v1/analyses/{ZEROS}", f"/api/v1/studies/{ZEROS}"
    table = [
        ("DELETE /api/v1/models", "DELETE", "/api/v1/models", (405,)),
        ("OPTIONS /api/v1/analyses", "OPTIONS", "/api/v1/analyses", (405,)),
        ("PATCH /api/v1/studies", "PATCH", "/api/v1/studies", (405,)),
        ("tensor name with %2f", "GET", f"{analysis}/tensors/model.layers.0%2fmlp", (404,)),
        ("study mask name with %2f", "GET", f"{study}/masks/a%2fb", (404,)),
        (
            "analysis id ..%2f..%2fetc%2fpasswd",
            "GET",
            "/api/v1/analyses/..%2f..%2fetc%2fpasswd/safetensors",
            CLIENT_ERROR,
        ),
        ("GET /api/v2/x", "GET", "/api/v2/x", (404,)),
        ("GET /api/", "GET", "/api/", (404,)),
        ("GET /api/v1/models/ (trailing slash)", "GET", "/api/v1/models/", (307, 308, 404, 405)),
        ("analysis id not hex", "GET", "/api/v1/analyses/ZZ", CLIENT_ERROR),
        ("position 10**20", "GET", f"{analysis}/positions/{10**20}", CLIENT_ERROR),
        ("top limit 0", "GET", f"{analysis}/top?limit=0", CLIENT_ERROR),
        ("tensor rows -1", "GET", f"{analysis}/tensors/x?rows=-1", CLIENT_ERROR),
        ("mask q=nan", "GET", f"{study}/masks/x?q=nan", CLIENT_ERROR),
        ("compare unknown ids", "GET", f"/api/v1/compare?a={ZEROS}&b={ZEROS}", CLIENT_ERROR),
        ("study compare unknown ids", "GET", f"/api/v1/studies/compare?a={ZEROS}&b={ZEROS}", CLIENT_ERROR),
        ("tokenize text %ff (not UTF-8)", "GET", f"/api/v1/tokenize?model={MODEL}&text=%ff", ANSWERED),
        ("tokenize a surrogate's bytes", "GET", f"/api/v1/tokenize?model={MODEL}&text=%ED%B2%80", ANSWERED),
        ("tokenize model ../../etc", "GET", "/api/v1/tokenize?model=../../etc&text=hi", CLIENT_ERROR),
        (
            "tokenize 15 000 characters",
            "GET",
            f"/api/v1/tokenize?model={MODEL}&text={'ab' * 7_500}",
            ANSWERED,
        ),
    ]
    for case, method, path, expect in table:
        yield Probe(case, method, path, expect)


def job_bodies() -> Iterator[tuple[str, str, Any, Container[int]]]:
    """(case, route, body, expected): JSON bodies a client may send to the two job routes."""
    a, s = JOB_ROUTES
    hi = {"model": MODEL, "prefix": "hi"}
    yield "unknown field", a, {**hi, "evil": 1}, CLIENT_ERROR
    yield "unknown field in a prompt", s, {"model": MODEL, "prompts": [{**PROMPT, "evil": 1}]}, CLIENT_ERROR
    yield "prefix is a number", a, {**hi, "prefix": 5}, CLIENT_ERROR
    yield "prompts is a string", s, {"model": MODEL, "prompts": "x"}, CLIENT_ERROR
    yield "model is null", a, {**hi, "model": None}, CLIENT_ERROR
    yield "reward is a list", a, {**hi, "reward": [1]}, CLIENT_ERROR
    yield "reward value is a string", a, {**hi, "reward": {"a": "1"}}, CLIENT_ERROR
    yield (
        "samples is true",
        s,
        {"model": MODEL, "prompts": [PROMPT], "samples": True, "seed": SEED},
        ACCEPTED_OR_REFUSED,
    )
    yield "model ../../etc/passwd", a, {**hi, "model": "../../etc/passwd"}, CLIENT_ERROR
    yield "unknown reward kind", s, {**study_body(""), "reward": {"kind": "eval"}}, CLIENT_ERROR
    yield "method mc:1e999", a, {**hi, "method": "mc:1e999"}, CLIENT_ERROR
    yield "method mc:10**25", a, {**hi, "method": f"mc:{10**25}"}, CLIENT_ERROR
    yield "method truncated:nan", a, {**hi, "method": "truncated:nan"}, CLIENT_ERROR
    yield "20 000-character prefix", a, {**hi, "prefix": "a " * 10_000}, CLIENT_ERROR
    yield "257 prompts", s, {"model": MODEL, "prompts": [PROMPT] * 257}, CLIENT_ERROR
    yield "1025 reward tokens", a, {**hi, "reward": {f"#{i}": 1 for i in range(1025)}}, CLIENT_ERROR
    yield "reward token #10**30", a, {**hi, "reward": {f"#{10**30}": 1}}, CLIENT_ERROR
    yield "seed 10**30", s, {**study_body(r"\b{target}"), "seed": 10**30}, CLIENT_ERROR
    yield "sampled max_tokens 10**20", a, {**hi, "continuation_sample": {"max_tokens": 10**20}}, CLIENT_ERROR
    yield "mask densities 0 and 1", s, {"model": MODEL, "prompts": [PROMPT], "q": [0, 1]}, CLIENT_ERROR
    yield "top_k 10**30", a, {**hi, "sampler": {"top_k": 10**30}}, ACCEPTED_OR_REFUSED
    yield "prefix of NUL characters", a, {**hi, "prefix": "\0" * 8}, ACCEPTED_OR_REFUSED
    yield "data token of 3 tokens", a, {**hi, "sampler": {"kind": "data", "data_token": "a b c"}}, (422,)
    yield "body is a JSON array", a, [], CLIENT_ERROR
    yield "body is a JSON string", a, "hi", CLIENT_ERROR
    yield "body is null", a, None, CLIENT_ERROR


def raw_bodies() -> Iterator[tuple[str, str, bytes, Container[int]]]:
    """(case, route, bytes, expected): bodies that are not JSON, or JSON that json.dumps never writes."""
    a, s = JOB_ROUTES
    hi = b'{"model":"tiny-random","prefix":"hi",'
    one = b'{"model":"tiny-random","prompts":[{"prompt":"x"}],'
    surrogate_pattern = json.dumps(study_body("\\udc80")).encode().replace(b"\\\\udc80", b"\\udc80")
    yield "100k nested [", a, b"[" * 100_000, (400,)
    yield "100k nested [ in a field", s, b'{"model":"tiny-random","prompts":' + b"[" * 100_000, (400,)
    yield "invalid UTF-8", a, b'{"model":"tiny-random","prefix":"\xff\xfe"}', (400,)
    yield "truncated JSON", a, b'{"model":"tiny-random","prefix":"h', (400,)
    yield "empty body", a, b"", CLIENT_ERROR
    yield "NaN reward", a, hi + b'"reward":{"a":NaN}}', CLIENT_ERROR
    yield "Infinity temperature", a, hi + b'"sampler":{"temperature":Infinity}}', CLIENT_ERROR
    yield "1e400 top_p", a, hi + b'"sampler":{"top_p":1e400}}', CLIENT_ERROR
    yield "-Infinity samples", s, one + b'"samples":-Infinity}', CLIENT_ERROR
    yield "NaN mask density", s, one + b'"q":[NaN]}', CLIENT_ERROR
    yield "5000-digit samples", s, one + b'"samples":1' + b"0" * 5000 + b"}", CLIENT_ERROR
    yield "lone surrogate in prefix", a, b'{"model":"tiny-random","prefix":"\\udc80"}', CLIENT_ERROR
    yield "lone surrogate in continuation", a, hi + b'"continuation":"\\udc80"}', CLIENT_ERROR
    yield "lone surrogate in a reward token", a, hi + b'"reward":{"\\udc80":1}}', CLIENT_ERROR
    yield (
        "lone surrogate in data_token",
        a,
        hi + b'"sampler":{"kind":"data","data_token":"\\udc80"}}',
        CLIENT_ERROR,
    )
    yield "lone surrogate in the model id", a, b'{"model":"\\udc80","prefix":"hi"}', CLIENT_ERROR
    yield (
        "lone surrogate in a study prompt",
        s,
        one.replace(b'"x"', b'"\\udc80"') + b'"samples":1}',
        CLIENT_ERROR,
    )
    yield (
        "lone surrogate in a study target",
        s,
        b'{"model":"tiny-random","prompts":[{"prompt":"hi","target":"\\udc80"}]}',
        CLIENT_ERROR,
    )
    yield "lone surrogate in a reward pattern", s, surrogate_pattern, CLIENT_ERROR
    yield "duplicate keys", a, b'{"model":"tiny-random","prefix":"hi","prefix":5}', CLIENT_ERROR


def chunks(size: int = 1 << 20, count: int = 50) -> Iterator[bytes]:
    for _ in range(count):
        yield b"[" * size


def body_probes() -> Iterator[Probe]:
    """Bodies of every shape a careless or hostile client sends: refused with a 4xx that says why."""
    as_json = {"content-type": "application/json"}
    for case, route, body, expect in job_bodies():
        yield Probe(case, "POST", route, expect, {"json": body})
    for case, route, raw, expect in raw_bodies():
        yield Probe(case, "POST", route, expect, {"content": raw, "headers": as_json})
    fifty_mb = b'{"model":"tiny-random","prefix":"' + b"a" * (50 << 20) + b'"}'
    yield Probe("50 MB body", "POST", JOB_ROUTES[0], (413,), {"content": fifty_mb, "headers": as_json})
    yield Probe(
        "50 MB chunked body", "POST", JOB_ROUTES[1], (413,), {"content": chunks(), "headers": as_json}
    )
    cheap = json.dumps({"model": MODEL, "prefix": "hi", "method": "mc:2"})
    yield Probe(
        "JSON sent as text/plain",
        "POST",
        JOB_ROUTES[0],
        ACCEPTED_OR_REFUSED,
        {"content": cheap, "headers": {"content-type": "text/plain"}},
    )
    yield Probe(
        "form-encoded body", "POST", JOB_ROUTES[0], CLIENT_ERROR, {"data": {"model": MODEL, "prefix": "hi"}}
    )


def host_probes() -> Iterator[Probe]:
    """Host headers of a DNS-rebinding page: 400, the API and the dashboard alike."""
    evil = {"Host": "evil.example"}
    for path in ("/api/v1/models", "/", "/healthz"):
        yield Probe(f"GET {path} with Host evil.example", "GET", path, (400,), {"headers": evil})
    yield Probe(
        "POST /api/v1/analyses with Host evil.example",
        "POST",
        JOB_ROUTES[0],
        (400,),
        {"json": {"model": MODEL, "prefix": "hi"}, "headers": evil},
    )
    for host, expect in (("127.0.0.1.evil.example", 400), ("[::1", 400), ("localhost:1", 200)):
        yield Probe(f"Host {host}", "GET", "/api/v1/models", (expect,), {"headers": {"Host": host}})


def burst(target: HttpTarget, threads: int = 10, each: int = 20) -> None:
    """threads x each GETs of /api/v1/models and /healthz at once; every one must be a 200."""

    def worker(_: int) -> None:
        with httpx.Client(base_url=target.url, timeout=REQUEST_TIMEOUT_S) as client:
            for i in range(each):
                path = "/api/v1/models" if i % 2 else "/healthz"
                target.send(f"burst GET {path}", "GET", path, (200,), health=False, client=client)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    target.check_health("the burst")


def api_cases(target: HttpTarget) -> None:
    for probes in (unrouted_probes(), host_probes(), body_probes(), regex_probes()):
        for probe in probes:
            probe.send(target)
    burst(target)


# ----------------------------------------------------------------------------------- Dash internals


def split_output(output: str) -> list[tuple[Any, str]] | None:
    """(id, property) of each output of a callback key ('id.prop' or '..a.p...b.q..'); None when an id
    is a pattern (the renderer would send concrete ids, which this check does not make up)."""
    parts = output[2:-2].split("...") if output.startswith("..") else [output]
    pairs = []
    for part in parts:
        name, _, prop = part.rpartition(".")
        if name.startswith("{"):
            return None
        pairs.append((name, prop))
    return pairs


def callback_body(dependency: dict, value: Any) -> dict | None:
    """A callback request shaped as the renderer sends it, every input and state value ``value``."""
    outputs = split_output(dependency["output"])
    props = [*dependency.get("inputs", []), *dependency.get("state", [])]
    if outputs is None or any(not isinstance(item.get("id"), str) for item in props):
        return None
    listed = [{"id": name, "property": prop} for name, prop in outputs]
    inputs = [{**item, "value": value} for item in dependency.get("inputs", [])]
    return {
        "output": dependency["output"],
        "outputs": listed if dependency["output"].startswith("..") else listed[0],
        "inputs": inputs,
        "state": [{**item, "value": value} for item in dependency.get("state", [])],
        "changedPropIds": [f"{inputs[0]['id']}.{inputs[0]['property']}"] if inputs else [],
    }


def dash_probes() -> Iterator[Probe]:
    """Requests the dashboard's renderer never sends: a 4xx, not Dash's HTML 500."""
    as_json = {"content-type": "application/json"}
    for name, raw in (
        ("{}", b"{}"),
        ("[]", b"[]"),
        ("not json", b"not json"),
        ('{"output": 5}', b'{"output": 5}'),
        ("100k nested [", b"[" * 100_000),
    ):
        yield Probe(
            f"dash callback body {name}", "POST", CALLBACK, CLIENT_ERROR, {"content": raw, "headers": as_json}
        )
    yield Probe("study page callback body {}", "POST", "/studies" + CALLBACK, CLIENT_ERROR, {"json": {}})
    for path in ("/_dash-component-suites/dash/nope.js", "/_dash-component-suites/nope/x.js"):
        yield Probe(f"GET {path}", "GET", path, CLIENT_ERROR)


def callback_probes(dependencies: list[dict], limit: int = 60) -> Iterator[Probe]:
    """A real callback's output with wrong inputs (4xx), and every callback with object values where
    its inputs hold strings or numbers (the callback may refuse, but not with a 500)."""
    served = [dep for dep in dependencies if not dep.get("clientside_function")]
    first = next((dep for dep in served if dep.get("inputs")), None)
    if first is not None:
        wrong = {"output": first["output"], "inputs": [], "state": [], "changedPropIds": []}
        yield Probe(
            f"dash callback {first['output'][:40]} with no inputs",
            "POST",
            CALLBACK,
            CLIENT_ERROR,
            {"json": wrong},
        )
        five = {**wrong, "inputs": [5] * len(first["inputs"])}
        yield Probe(
            f"dash callback {first['output'][:40]} with inputs 5",
            "POST",
            CALLBACK,
            CLIENT_ERROR,
            {"json": five},
        )
    junk = {"unexpected": [1, None, {"$": "x" * 10}]}
    for dependency in served[:limit]:
        body = callback_body(dependency, junk)
        if body is not None:
            yield Probe(
                f"dash callback {dependency['output'][:50]} with object values",
                "POST",
                CALLBACK,
                ANSWERED,
                {"json": body},
            )


def dash_cases(target: HttpTarget) -> None:
    for probe in dash_probes():
        probe.send(target)
    answer = target.send("GET /_dash-dependencies", "GET", "/_dash-dependencies", (200,))
    if answer is not None and answer.status_code == 200:
        for probe in callback_probes(answer.json()):
            probe.send(target)


# ------------------------------------------------------------------------------- token and rate limit


def auth_probes(token: str) -> Iterator[Probe]:
    """With FISHERSCOPE_API_TOKEN set: compute routes and the dashboard need it, reads stay open."""
    compute: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("POST", "/api/v1/analyses", {"json": {"model": MODEL}}),
        ("POST", "/api/v1/studies", {"json": {"model": MODEL}}),
        ("GET", f"/api/v1/analyses/{ZEROS}/safetensors", {}),
    )
    not_401 = [code for code in ANSWERED if code != 401]
    credentials: tuple[tuple[str, dict[str, str], Container[int]], ...] = (
        ("without a token", {}, (401,)),
        ("with a wrong token", bearer("x" * 32), (401,)),
        ("with the token", bearer(token), not_401),
    )
    for method, path, options in compute:
        for said, headers, expect in credentials:
            yield Probe(f"{method} {path[:30]} {said}", method, path, expect, {**options, "headers": headers})
    yield Probe("GET /api/v1/models without a token (reads stay open)", "GET", "/api/v1/models", (200,))
    yield Probe("dashboard / without credentials", "GET", "/", (401,))
    yield Probe("study page /studies/ without credentials", "GET", "/studies/", (401,))
    yield Probe("dash callback without credentials", "POST", CALLBACK, (401,), {"json": {}})
    yield Probe(
        "dashboard / with the token as Basic password", "GET", "/", (200,), {"auth": ("anyone", token)}
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth_cases(target: HttpTarget, token: str) -> None:
    for probe in auth_probes(token):
        probe.send(target)
    rate_burst(target, token)


def rate_burst(target: HttpTarget, token: str, count: int = 8) -> None:
    """With FISHERSCOPE_RATE_LIMIT=5/minute, 8 compute requests in a row: some 429 with Retry-After."""
    statuses = []
    for i in range(count):
        answer = target.send(
            f"rate burst POST {i + 1}/{count}",
            "POST",
            JOB_ROUTES[0],
            (422, 429),
            health=False,
            json={"model": MODEL},
            headers=bearer(token),
        )
        if answer is not None:
            statuses.append(answer.status_code)
            if answer.status_code == 429 and not answer.headers.get("retry-after"):
                target.tally.note(f"rate burst POST {i + 1}", "429 without Retry-After")
    target.check_health("the rate burst")
    if 429 not in statuses:
        target.tally.note("rate burst", f"no 429 among {statuses} with FISHERSCOPE_RATE_LIMIT=5/minute")
    target.tally.info.append(f"rate burst of {count} at 5/minute: {dict(Counter(statuses))}")


# ---------------------------------------------------------------------------------------- processes


@contextmanager
def started(name: str, command: list[str], env: dict[str, str], logs: Path) -> Iterator[subprocess.Popen]:
    """A subprocess with its output in ``logs/name.log``; terminated (then killed) on leaving."""
    with open(logs / f"{name}.log", "wb") as log:
        process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=20)


def base_env(folder: Path, **extra: str) -> dict[str, str]:
    """The environment of a started process: its own folders, no Redis, no token unless given."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("FISHERSCOPE_")}
    env.pop("REDIS_URL", None)
    if "FISHERSCOPE_CACHE" in os.environ:
        env["FISHERSCOPE_CACHE"] = os.environ["FISHERSCOPE_CACHE"]  # the models stay where they are
    for name in ("results", "exports", "studies"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        env[f"FISHERSCOPE_{name.upper()}_DIR"] = str(folder / name)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def log_tracebacks(tally: Tally, logs: Path, names: tuple[str, ...]) -> None:
    """What the services' own logs say went wrong: each traceback's last line, for the report."""
    for name in names:
        path = logs / f"{name}.log"
        if not path.exists():
            continue
        lines = path.read_text(errors="replace").splitlines()
        for index, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                tail = next((later for later in lines[index + 1 :] if later and not later[0].isspace()), "?")
                tally.info.append(f"{name} log: traceback ending {tail[:150]}")


def run_http_target(
    tally: Tally,
    port: int,
    processes: list[tuple[str, list[str], dict[str, str]]],
    logs: Path,
    cases: Callable[[HttpTarget], None],
    ready: bool = False,
) -> None:
    """Start the processes (the first serves ``port``), wait for /healthz (and /readyz when ``ready``:
    a job must not race the preload of the default model), run ``cases``, stop them all."""
    url = f"http://127.0.0.1:{port}"
    names = tuple(name for name, _, _ in processes)
    try:
        with ExitStack() as stack:
            running = [
                stack.enter_context(started(name, command, env, logs)) for name, command, env in processes
            ]
            try:
                wait_for_health(running[0], url, START_TIMEOUT_S)
                if ready:
                    wait_until_ready(url, READY_TIMEOUT_S)
            except (ServiceDidNotStart, httpx.HTTPError) as error:
                tally.add("unstarted")
                tally.note("start", f"{error}; its log ends: {last_line(logs / f'{names[0]}.log')}")
                return
            target = stack.enter_context(closing(HttpTarget(tally, url)))
            try:
                cases(target)
            except TargetDown as error:
                tally.note("abandoned the rest", str(error))
    finally:
        log_tracebacks(tally, logs, names)


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(empty)"


def serve_command(port: int) -> list[str]:
    return [FISHERSCOPE, "serve", "--host", "127.0.0.1", "--port", str(port)]


def embedded_target(work: Path) -> Tally:
    """(a) `fisherscope serve`: the API, the dashboard and a worker thread in one process."""
    tally = Tally("embedded")
    port = free_port()
    env = base_env(
        work / "embedded", FISHERSCOPE_LANDING_ANALYSIS="false", FISHERSCOPE_RATE_LIMIT="100000/minute"
    )

    def cases(target: HttpTarget) -> None:
        api_cases(target)
        dash_cases(target)

    run_http_target(tally, port, [("embedded", serve_command(port), env)], work, cases, ready=True)
    return tally


def token_target(work: Path) -> Tally:
    """(a) again, started with a 32-character API token and a rate limit of 5 a minute."""
    tally = Tally("embedded+token")
    token = secrets.token_hex(16)
    port = free_port()
    env = base_env(
        work / "token",
        FISHERSCOPE_LANDING_ANALYSIS="false",
        FISHERSCOPE_API_TOKEN=token,
        FISHERSCOPE_RATE_LIMIT="5/minute",
    )
    run_http_target(
        tally,
        port,
        [("embedded-token", serve_command(port), env)],
        work,
        lambda target: auth_cases(target, token),
    )
    return tally


def redis_reachable() -> str | None:
    """None when Redis answers at REDIS_URL, else why not."""
    from redis import Redis
    from redis.exceptions import RedisError

    try:
        Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    except RedisError as error:
        return f"{type(error).__name__}: {error}"
    return None


def redis_target(work: Path) -> Tally:
    """(b) `uvicorn backend.main:app` with REDIS_URL, and one `fisherscope worker` on its queue."""
    tally = Tally("redis")
    problem = redis_reachable()
    if problem is not None:
        tally.add("unstarted")
        tally.note("start", f"Redis is not reachable at {REDIS_URL} ({problem})")
        return tally
    port = free_port()
    env = base_env(
        work / "redis",
        REDIS_URL=REDIS_URL,
        FISHERSCOPE_QUEUE_NAME=QUEUE_NAME,
        FISHERSCOPE_RATE_LIMIT="100000/minute",
        FISHERSCOPE_RESULT_TTL_S="900",
    )
    api = [
        PYTHON,
        "-m",
        "uvicorn",
        "backend.main:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    processes = [("redis-api", api, env), ("redis-worker", [FISHERSCOPE, "worker"], env)]
    run_http_target(tally, port, processes, work, api_cases)
    return tally


# ---------------------------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class Command:
    case: str
    args: list[str | bytes]
    expect: tuple[int, ...] = (2,)  # exit codes that are right: 2 = refused, with one line on stderr
    timeout_s: float = CLI_TIMEOUT_S
    empty_cache: bool = False  # run with a model cache of its own (commands that would write to it)


PROMPT_FILES = {  # name -> content: the study's prompt files
    "target.jsonl": json.dumps(PROMPT),
    "deep.jsonl": "[" * 100_000,
    "deep_object.jsonl": '{"prompt": ' + "[" * 100_000,
    "surrogate.jsonl": '{"prompt": "\\udc80 hi"}',  # a JSON escape: the parsed text holds a lone surrogate
    "surrogate_target.jsonl": '{"prompt": "hi", "target": "\\udc80"}',
}
MASK_FILES = {  # name -> (what `masks info` is shown, its exit code)
    "qnan.safetensors": ("key qnan/w", (2,)),
    "qodd.safetensors": ("keys q-1/w, q5/w, qinf/w", (2,)),
    "qfloat.safetensors": ("float32 under q0.5/w", (2,)),
    "values7.safetensors": ("values 7 in a mask", (2,)),
    "mismatch.safetensors": ("densities over other parameters", (2,)),
    "metadata.safetensors": ("metadata thresholds not JSON", (0,)),
    "header_bomb.safetensors": ("header length 2**63", (2,)),
    "text.safetensors": ("a text file", (2,)),
}


def write_files(folder: Path) -> None:
    """The prompt and mask files the commands read, and folders they must not write onto."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name, content in PROMPT_FILES.items():
        (folder / name).write_text(content + "\n")
    ones = np.ones((2, 2), dtype=np.uint8)
    save_file({"qnan/w": ones}, str(folder / "qnan.safetensors"))
    save_file({"q-1/w": ones, "q5/w": ones, "qinf/w": ones}, str(folder / "qodd.safetensors"))
    save_file({"q0.5/w": ones.astype(np.float32)}, str(folder / "qfloat.safetensors"))
    save_file({"q0.5/w": ones * 7}, str(folder / "values7.safetensors"))
    save_file({"q0.1/a": ones, "q0.2/b": ones}, str(folder / "mismatch.safetensors"))
    save_file({"q0.5/w": ones}, str(folder / "metadata.safetensors"), metadata={"thresholds": "[1,"})
    (folder / "header_bomb.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    (folder / "text.safetensors").write_text("not a safetensors file\n")
    for name in ("existing-folder", "somefolder"):
        (folder / name).mkdir(exist_ok=True)


def study_args(files: Path, out: Path, prompts: str = "target.jsonl") -> list[str | bytes]:
    """A small study (1 response of at most 8 tokens, no uniform comparison) of one prompt file."""
    return [
        "study",
        "--model",
        MODEL,
        "--prompts",
        str(files / prompts),
        "--samples",
        "1",
        "--max-tokens",
        "8",
        "--compare-uniform",
        "none",
        "--masks",
        str(out / "m.safetensors"),
        "--summary",
        str(out / "s.json"),
    ]


def analyze_commands(files: Path) -> Iterator[Command]:
    analyze = ["analyze", "--model", MODEL, "--prefix", "hi"]
    for option, value in (
        ("--device", "cuda:7"),
        ("--device", "bogus"),
        ("--device", "meta"),
        ("--save", "/nonexistent/dir/x.safetensors"),
        ("--summary", str(files / "existing-folder")),
        ("--method", "mc:1e999"),
        ("--max-cost-tflop", "nan"),
        ("--reward", "x=nan"),
        ("--temperature", "nan"),
    ):
        yield Command(f"analyze {option} {value}", [*analyze, option, value])
    yield Command("analyze --prefix of a non-UTF-8 byte", [*analyze[:-1], b"\x80hi"])
    yield Command("analyze --prefix ''", [*analyze[:-1], ""])
    yield Command("analyze --model ../../etc", ["analyze", "--model", "../../etc", "--prefix", "hi"])


def study_commands(files: Path, out: Path) -> Iterator[Command]:
    yield Command("study: a line nested 100k deep", study_args(files, out, "deep.jsonl"))
    yield Command("study: a prompt nested 100k deep", study_args(files, out, "deep_object.jsonl"))
    yield Command("study: a lone surrogate in a prompt", study_args(files, out, "surrogate.jsonl"))
    yield Command(
        "study: a lone surrogate in a target",
        [*study_args(files, out, "surrogate_target.jsonl"), "--reward-exact"],
    )
    yield Command("study --prompts /dev/zero", study_args(Path("/dev"), out, "zero"))
    yield Command("study --prompts a folder", study_args(files, out, "existing-folder"))
    yield Command("study --q nan", [*study_args(files, out), "--q", "nan"])
    yield Command("study --samples 10**20", [*study_args(files, out), "--samples", str(10**20)])
    for name, pattern in REGEX_PATTERNS.items():  # RE2 reads some as literal text: a study that runs
        yield Command(
            f"study --reward-regex: {name}", [*study_args(files, out), "--reward-regex", pattern], (0, 2)
        )
    yield Command(
        "study --reward-regex: RE2-only pattern", [*study_args(files, out), "--reward-regex", RE2_ONLY], (0,)
    )


def other_commands(files: Path) -> Iterator[Command]:
    for name, (what, expect) in MASK_FILES.items():
        yield Command(f"masks info: {what}", ["masks", "info", str(files / name)], expect)
    yield Command(
        "masks compare a folder",
        ["masks", "compare", str(files / "existing-folder"), str(files / "qnan.safetensors")],
    )
    folder = str(files / "somefolder")
    yield Command("models add a..b", ["models", "add", "a..b", folder], empty_cache=True)
    yield Command("models add an empty folder", ["models", "add", "empty-one", folder], empty_cache=True)
    yield Command("models remove an unknown id", ["models", "remove", "empty-one"], empty_cache=True)
    yield Command("fetch an unknown id", ["fetch", "nope"], empty_cache=True)
    yield Command(
        "serve --host 0.0.0.0 without a token",
        ["serve", "--host", "0.0.0.0", "--port", str(free_port())],
        timeout_s=60,
        empty_cache=True,
    )
    yield Command("serve --port 99999", ["serve", "--port", "99999"], timeout_s=60, empty_cache=True)
    yield Command("worker without REDIS_URL", ["worker", "--burst"], timeout_s=30)
    closed = f"redis://127.0.0.1:{free_port()}/15"
    yield Command(
        "worker --redis-url to a closed port", ["worker", "--burst", "--redis-url", closed], timeout_s=30
    )


def run_command(tally: Tally, command: Command, env: dict[str, str], cwd: Path) -> None:
    """One CLI run: exit 2 with one line on stderr where refused, never a traceback or another code."""
    tally.add("cases")
    try:
        done = subprocess.run(
            [FISHERSCOPE, *command.args],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=command.timeout_s,
        )
    except subprocess.TimeoutExpired:
        tally.add("hangs")
        tally.note(command.case, f"still running after {command.timeout_s:.0f} s (killed)")
        return
    stderr = done.stderr.decode("utf-8", "replace")
    lines = [line for line in stderr.splitlines() if line.strip()]
    rc = done.returncode
    tally.add("ok" if rc == 0 else "refused" if rc == 2 else "other")
    if "Traceback" in stderr or rc not in (0, 2):
        tally.add("tracebacks")
    last = lines[-1][:160] if lines else "(nothing on stderr)"
    if rc not in command.expect:
        expected = " or ".join(map(str, command.expect))
        tally.note(command.case, f"exit {rc} (expected {expected}); stderr {len(lines)} lines, last: {last}")
    elif rc == 0 and 2 in command.expect:
        tally.info.append(f"{command.case}: accepted, exit 0")
    elif rc == 2 and len(lines) != 1:
        tally.note(command.case, f"exit 2 with {len(lines)} lines on stderr, last: {last}")


def cli_target(work: Path) -> Tally:
    """(c) `fisherscope` commands, each a subprocess."""
    tally = Tally("cli")
    folder = work / "cli"
    files, out, cache = folder / "files", folder / "out", folder / "cache"
    write_files(files)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env = base_env(folder)
    commands = [*analyze_commands(files), *study_commands(files, out), *other_commands(files)]
    for command in commands:
        run_command(
            tally, command, {**env, "FISHERSCOPE_CACHE": str(cache)} if command.empty_cache else env, folder
        )
    return tally


# -------------------------------------------------------------------------------------------- report


def table(tallies: list[Tally]) -> str:
    width = max(len(tally.target) for tally in tallies) + 2
    head = "target".ljust(width) + "".join(f"{title:>11}" for _, title in COLUMNS)
    rows = [head, "-" * len(head)]
    for tally in tallies:
        cells = "".join(f"{tally.counts[key]:>11}" for key, _ in COLUMNS)
        rows.append(
            tally.target.ljust(width) + cells + ("   (not started)" if tally.counts["unstarted"] else "")
        )
    return "\n".join(rows)


def merged(lines: list[str]) -> list[str]:
    """Each distinct line once, with how often it came (a burst repeats the same failure)."""
    counts = Counter(lines)
    return [line if counts[line] == 1 else f"{line} (x{counts[line]})" for line in dict.fromkeys(lines)]


def report(tallies: list[Tally]) -> str:
    parts = [table(tallies)]
    notes = [f"  {tally.target} | {note}" for tally in tallies for note in merged(tally.notes)]
    parts.append("\nnot as expected:" if notes else "\nevery case was as expected")
    parts.extend(notes)
    info = [f"  {tally.target} | {line}" for tally in tallies for line in merged(tally.info)]
    if info:
        parts.append("\njobs and logs:")
        parts.extend(info)
    return "\n".join(parts)


@contextmanager
def work_folder(kept: Path | None) -> Iterator[Path]:
    """Where the services' folders and logs go: ``kept`` (left for reading), else a temporary folder."""
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        yield kept.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="fisherscope-hostile-") as folder:
        yield Path(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the Redis target")
    parser.add_argument("--only", action="append", choices=list(TARGETS), help="run only these (repeat)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and leave the logs there")
    args = parser.parse_args(argv)
    chosen = args.only or [name for name in TARGETS if not (args.quick and name == "redis")]
    tallies = []
    with work_folder(args.keep) as folder:
        for name in chosen:
            began = time.monotonic()
            print(f"{name} ...", end=" ", flush=True)
            tallies.append(TARGETS[name](folder))
            print(f"{time.monotonic() - began:.0f} s", flush=True)
    print()
    print(report(tallies))
    failed = [tally.target for tally in tallies if tally.failed()]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'passed'} (seed {SEED})")
    return 1 if failed else 0


TARGETS: dict[str, Callable[[Path], Tally]] = {
    "embedded": embedded_target,
    "token": token_target,
    "redis": redis_target,
    "cli": cli_target,
}

if __name__ == "__main__":
    sys.exit(main())
