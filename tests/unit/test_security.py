"""The security building blocks on their own: egress rules, signatures, token buckets, sealed secrets."""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import socket
import stat
import threading
from pathlib import Path

import click
import pytest

from chimes.api.limits import RateLimiter
from chimes.cli.main import cli
from chimes.cli.security_options import egress_policy, trusted_proxies, worker_security
from chimes.jobs import JobSpec
from chimes.security import ssrf
from chimes.security.refusals import SecretNotKept
from chimes.security.secrets import (
    REDACTED,
    Keyring,
    SecretKeyError,
    SecretUnreadable,
    load_keyring,
    redact,
    reveal,
    seal_spec,
    split_sealed,
)
from chimes.security.signing import signature_header, verify
from chimes.security.ssrf import (
    EgressDenied,
    EgressPolicy,
    GuardedConnector,
    normal_host,
    outgoing_request,
    outgoing_url,
)
from chimes.security.storable import storable_problem

DEFAULT = EgressPolicy.build()
NO_LOOPBACK = EgressPolicy.build(allow_loopback=False)
ALLOW_LIST = EgressPolicy.build(allow=["10.0.0.0/8", "api.example.com", "*.partner.example"],
                                deny=["10.9.0.0/16", "evil.partner.example"])

EGRESS_CASES = [
    # policy, host, address, refused because (None: allowed)
    (DEFAULT, "example.com", "93.184.215.14", None),
    (DEFAULT, "localhost", "127.0.0.1", None),
    (DEFAULT, "169.254.169.254", "169.254.169.254", "address 169.254.169.254 is in the denied network 169.254.0.0/16"),
    (DEFAULT, "metadata.google.internal", "169.254.169.254", "in the denied network 169.254.0.0/16"),
    (DEFAULT, "x", "::ffff:169.254.169.254", "in the denied network 169.254.0.0/16"),
    (DEFAULT, "x", "::a9fe:a9fe", "in the denied network 169.254.0.0/16"),
    (DEFAULT, "x", "fd00:ec2::254", "in the denied network fd00:ec2::254/128"),
    (DEFAULT, "x", "fe80::1%eth0", "in the denied network fe80::/10"),
    (DEFAULT, "x", "100.100.100.200", "in the denied network 100.100.100.200/32"),
    (DEFAULT, "x", "not-an-address", "not-an-address is not an IP address"),
    (ALLOW_LIST, "internal", "10.1.2.3", None),
    (ALLOW_LIST, "internal", "10.9.0.1", "in the denied network 10.9.0.0/16"),
    (ALLOW_LIST, "api.example.com", "93.184.215.14", None),
    (ALLOW_LIST, "API.Example.COM.", "93.184.215.14", None),
    (ALLOW_LIST, "eu.partner.example", "198.51.100.7", None),
    (ALLOW_LIST, "partner.example", "198.51.100.7", "partner.example (198.51.100.7) is not on the allow list"),
    (ALLOW_LIST, "evil.partner.example", "198.51.100.7", "host evil.partner.example is denied"),
    (ALLOW_LIST, "other.com", "192.0.2.1", "other.com (192.0.2.1) is not on the allow list"),
    (ALLOW_LIST, "api.example.com", "169.254.169.254", "in the denied network 169.254.0.0/16"),
    (EgressPolicy.build(default_deny=False), "x", "169.254.169.254", None),
    (DEFAULT, "x", "64:ff9b::a9fe:a9fe", "in the denied network 169.254.0.0/16"),  # NAT64
    (DEFAULT, "x", "::ffff:0:a9fe:a9fe", "in the denied network 169.254.0.0/16"),  # SIIT, IPv4-translated
    (DEFAULT, "x", "::ffff:0:169.254.169.254", "in the denied network 169.254.0.0/16"),
    (DEFAULT, "x", "2002:a9fe:a9fe::1", "in the denied network 169.254.0.0/16"),  # 6to4
    (DEFAULT, "x", "2001:0:4136:e378:8000:63bf:5601:5601", "in the denied network 169.254.0.0/16"),  # Teredo client
    (DEFAULT, "x", "2001:0:a9fe:a9fe::1", "in the denied network 169.254.0.0/16"),  # Teredo server
    (DEFAULT, "x", "::ffff:0:c633:6407", None),
    (DEFAULT, "x", "2001:db8::a9fe:a9fe", None),  # documentation space: no IPv4 inside
    (DEFAULT, "x", "64:ff9b::c633:6407", None),
    (ALLOW_LIST, "x", "64:ff9b::a09:1", "in the denied network 10.9.0.0/16"),
    (NO_LOOPBACK, "localhost", "127.0.0.1", "address 127.0.0.1 is in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "x", "127.1.2.3", "in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "localhost", "::1", "in the denied network ::1/128"),
    (NO_LOOPBACK, "x", "::ffff:127.0.0.1", "in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "x", "64:ff9b::7f00:1", "in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "x", "::ffff:0:7f00:1", "in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "x", "2002:7f00:1::", "in the denied network 127.0.0.0/8"),
    (NO_LOOPBACK, "x", "0.0.0.0", "in the denied network 0.0.0.0/8"),
    (NO_LOOPBACK, "x", "::", "in the denied network ::/128"),
    (NO_LOOPBACK, "x", "10.1.2.3", None),  # private ranges: the internal services teams call
    (NO_LOOPBACK, "x", "192.168.1.10", None),
    (NO_LOOPBACK, "x", "fd12::1", None),
]


@pytest.mark.parametrize(("policy", "host", "address", "reason"), EGRESS_CASES,
                         ids=[f"{c[1]}@{c[2]}" for c in EGRESS_CASES])
def test_egress_rules(policy: EgressPolicy, host: str, address: str, reason: str | None) -> None:
    refusal = policy.refusal(host, address)
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None and reason in refusal


@pytest.mark.parametrize(("role", "args", "loopback"), [
    ("worker", [], False), ("scheduler", [], False), ("up", [], True),
    ("worker", ["--egress-allow-loopback"], True), ("up", ["--egress-deny-loopback"], False),
])
def test_workers_deny_loopback_unless_allowed_and_up_allows_it(
    monkeypatch: pytest.MonkeyPatch, role: str, args: list[str], loopback: bool
) -> None:
    monkeypatch.delenv("CHIMES_EGRESS_ALLOW_LOOPBACK", raising=False)
    params = cli.commands[role].make_context(role, list(args)).params
    policy = egress_policy(params)
    assert (policy.refusal("localhost", "127.0.0.1") is None) == loopback
    assert policy.refusal("internal", "10.1.2.3") is None, "private ranges stay allowed"
    if not args:  # the variable does what the flag does (the e2e, chaos and bench fleets set it)
        monkeypatch.setenv("CHIMES_EGRESS_ALLOW_LOOPBACK", "true")
        params = cli.commands[role].make_context(role, []).params
        assert egress_policy(params).refusal("localhost", "127.0.0.1") is None


def test_bad_egress_entries_are_named() -> None:
    with pytest.raises(ValueError, match=re.escape("'10.0.0.0/33' is neither a network")):
        EgressPolicy.build(deny=["10.0.0.0/33"])


def test_the_socket_factory_refuses_a_denied_address_without_making_a_socket() -> None:
    connector_policy = EgressPolicy.build(deny=["192.0.2.0/24"])
    factory = GuardedConnector.__dict__["_make_socket"]
    holder = type("Holder", (), {"policy": connector_policy})()
    with pytest.raises(EgressDenied, match=re.escape("refused by egress policy: address 192.0.2.9 is in")):
        factory(holder, (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.9", 80)))
    allowed = factory(holder, (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 80)))
    allowed.close()


def test_signatures_verify_and_tampering_does_not() -> None:
    header = signature_header("whsec_k", 1_700_000_000, b'{"a":1}')
    assert verify("whsec_k", header, b'{"a":1}', now=1_700_000_100)
    assert not verify("whsec_k", header, b'{"a":2}', now=1_700_000_100)
    assert not verify("whsec_other", header, b'{"a":1}', now=1_700_000_100)
    assert not verify("whsec_k", header, b'{"a":1}', now=1_700_000_301), "older than the tolerance"
    assert not verify("whsec_k", "t=abc,v1=00", b"", now=0)
    assert not verify("whsec_k", "", b"", now=0)


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    now = [100.0]
    limiter = RateLimiter(per_sec=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)
    assert limiter.take("b") == 0.0, "buckets are per key"
    now[0] += 0.5
    assert limiter.take("a") == 0.0
    assert limiter.wait("a") == pytest.approx(0.5)


def test_token_buckets_are_bounded_in_number() -> None:
    limiter = RateLimiter(per_sec=1.0, burst=1, max_keys=2, clock=lambda: 0.0)
    for key in ("a", "b", "c"):
        limiter.take(key)
    assert limiter.wait("a") == 0.0, "the least recently used bucket was forgotten (so a is full again)"
    assert limiter.wait("c") > 0


def spec(task: dict) -> JobSpec:
    return JobSpec.model_validate({"name": "s", "schedule": {"cron": "0 2 * * *"}, "task": task})


def test_sealed_values_round_trip_and_are_redacted() -> None:
    keyring = Keyring.generate()
    sealed = seal_spec(spec({"type": "http", "url": "http://x", "secretHeaders": {"Authorization": "Bearer t"}}),
                       keyring)
    wire = sealed.to_wire()
    assert wire["task"]["secretHeaders"]["Authorization"] != "Bearer t"
    assert redact(wire)["task"]["secretHeaders"] == {"Authorization": REDACTED}
    assert reveal(wire["task"], keyring)["headers"] == {"Authorization": "Bearer t"}
    with pytest.raises(SecretUnreadable, match=re.escape("cannot open task.secretHeaders.Authorization")):
        reveal(wire["task"], Keyring.generate())
    plain, kept = split_sealed(wire)
    assert "secretHeaders" not in plain["task"] and set(kept) == {"Authorization"}
    again = seal_spec(spec({"type": "http", "url": "http://x", "secretHeaders": {"Authorization": REDACTED}}),
                      keyring, kept)
    assert again.to_wire()["task"]["secretHeaders"] == kept
    with pytest.raises(SecretNotKept):
        seal_spec(spec({"type": "http", "url": "http://x", "secretHeaders": {"X-Other": REDACTED}}), keyring, kept)


def test_secret_env_goes_into_the_environment() -> None:
    keyring = Keyring.generate()
    task = seal_spec(spec({"type": "command", "argv": ["env"], "env": {"A": "1"}, "secretEnv": {"B": "2"}}),
                     keyring).to_wire()["task"]
    assert reveal(task, keyring)["env"] == {"A": "1", "B": "2"}
    assert "secretEnv" not in reveal(task, keyring)


def test_the_key_file_is_made_once_with_owner_only_permissions(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "secret.key"
    rings: list[Keyring] = []
    threads = [threading.Thread(target=lambda: rings.append(load_keyring(None, path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({ring.key for ring in rings}) == 1, "processes starting together agree on one key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret.key"], "no spare files left behind"
    assert load_keyring(Keyring.generate().key.decode(), path).key != rings[0].key, "CHIMES_SECRET_KEY wins"


def test_a_malformed_key_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SecretKeyError, match="CHIMES_SECRET_KEY does not hold a valid secret key"):
        load_keyring("not-a-key", tmp_path / "unused")


STORABLE = [
    ("text", None),
    ("a\x00b", "contains a NUL character"),
    ("\ud800", "contains a lone surrogate"),
    ({"k\x00": 1}, "contains a NUL character"),
    ([[[[1]]]], None),
]


@pytest.mark.parametrize(("value", "problem"), STORABLE)
def test_storable_values(value: object, problem: str | None) -> None:
    found = storable_problem(value)
    assert found == problem if problem is None else problem in str(found)


def test_nesting_is_limited() -> None:
    deep: list = []
    for _ in range(40):
        deep = [deep]
    assert storable_problem(deep) == "is nested deeper than 32 levels"


def test_trusted_proxies_are_addresses_or_networks() -> None:
    assert trusted_proxies(["10.0.0.5", "10.0.0.0/24", "::1"]) == ("10.0.0.5", "10.0.0.0/24", "::1")
    assert trusted_proxies([]) == ()
    for wrong in ("proxy.internal", "*", "10.0.0.0/33"):
        with pytest.raises(click.BadParameter, match="not an IP address or network"):
            trusted_proxies([wrong])


# An allow entry inside a default-denied network turns that part on; one around it turns nothing on.
LIFT_CASES = [
    # allow entries, address, refused because (None: allowed)
    (["127.0.0.0/8"], "127.0.0.1", None),
    (["127.0.0.0/8"], "::ffff:127.0.0.1", None),
    (["127.0.0.0/8"], "::1", "in the denied network ::1/128"),  # only what was named
    (["127.0.0.0/8"], "0.0.0.0", "in the denied network 0.0.0.0/8"),
    (["::1"], "::1", None),
    (["0.0.0.0/8"], "0.0.0.0", None),
    (["::/128"], "::", None),
    (["127.0.0.1"], "127.0.0.1", None),
    (["127.0.0.1"], "127.0.0.2", "in the denied network 127.0.0.2/31"),
    (["169.254.169.254"], "169.254.169.254", None),
    (["169.254.169.254"], "169.254.1.1", "in the denied network 169.254.0.0/17"),
    (["169.254.0.0/16"], "169.254.10.10", None),
    (["fe80::/10"], "fe80::1%eth0", None),
    (["fd00:ec2::254"], "fd00:ec2::254", None),
    (["100.100.100.200"], "100.100.100.200", None),
    (["168.63.129.16"], "168.63.129.16", None),
    (["0.0.0.0/0"], "127.0.0.1", "in the denied network 127.0.0.0/8"),  # wider: lifts nothing
    (["0.0.0.0/0"], "169.254.169.254", "in the denied network 169.254.0.0/16"),
    (["100.64.0.0/10"], "100.100.100.200", "in the denied network 100.100.100.200/32"),
    (["100.64.0.0/10"], "100.100.100.201", None),
    (["::/0"], "::1", "in the denied network ::1/128"),
]


@pytest.mark.parametrize(("allow", "address", "reason"), LIFT_CASES, ids=[f"{c[0][0]}->{c[1]}" for c in LIFT_CASES])
def test_an_allow_entry_inside_a_default_denied_network_turns_it_on(
    allow: list[str], address: str, reason: str | None
) -> None:
    refusal = EgressPolicy.build(allow=allow, allow_loopback=False).refusal("x", address)
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None and reason in refusal


def test_an_operator_deny_is_never_lifted_by_an_allow() -> None:
    policy = EgressPolicy.build(allow=["127.0.0.0/8"], deny=["127.0.0.9"], allow_loopback=False)
    assert policy.refusal("x", "127.0.0.1") is None
    assert policy.refusal("x", "127.0.0.9") == "address 127.0.0.9 is in the denied network 127.0.0.9/32"


@pytest.mark.parametrize("default", ["127.0.0.0/8", "::1/128", "0.0.0.0/8", "::/128", "169.254.0.0/16",
                                     "fe80::/10", "fd00:ec2::254/128", "100.100.100.200/32", "168.63.129.16/32"])
def test_every_default_denied_network_is_lifted_by_naming_it_and_logged(
    default: str, caplog: pytest.LogCaptureFixture
) -> None:
    params = cli.commands["worker"].make_context("worker", ["--egress-allow", default, "--egress-deny-loopback"]).params
    with caplog.at_level("WARNING", logger="chimes.security"):
        policy = egress_policy(params)
    first = str(ipaddress.ip_network(default).network_address)
    assert EgressPolicy.build(allow_loopback=False).refusal("x", first) is not None, "denied by default"
    assert policy.refusal("x", first) is None
    assert [(o.allowed, o.default) for o in policy.lifted] == [(ipaddress.ip_network(default),) * 2]
    assert f"egress: {default} is allowed (--egress-allow), lifting that part of the default-denied {default}" \
        in caplog.messages


def test_a_wide_allow_entry_says_at_start_up_what_stays_denied(caplog: pytest.LogCaptureFixture) -> None:
    params = cli.commands["worker"].make_context("worker", ["--egress-allow", "0.0.0.0/0"]).params
    with caplog.at_level("WARNING", logger="chimes.security"):
        egress_policy(params)
    assert ("egress: 127.0.0.0/8 stays denied although --egress-allow 0.0.0.0/0 covers it; name it "
            "(--egress-allow 127.0.0.0/8 or --egress-allow-loopback) to allow it") in caplog.messages
    assert ("egress: 169.254.0.0/16 stays denied although --egress-allow 0.0.0.0/0 covers it; name it "
            "(--egress-allow 169.254.0.0/16) to allow it") in caplog.messages
    caplog.clear()
    params = cli.commands["worker"].make_context("worker", ["--egress-allow", "0.0.0.0/0,127.0.0.0/8"]).params
    with caplog.at_level("WARNING", logger="chimes.security"):
        policy = egress_policy(params)
    assert policy.refusal("x", "127.0.0.1") is None
    assert not any(m.startswith("egress: 127.0.0.0/8 stays denied") for m in caplog.messages), "it was named"
@pytest.mark.parametrize(("written", "resolved"), [
    ("%76m", "vm"), ("VM.", "vm"), ("foo.%6Cocalhost", "foo.localhost"),
    ("b%C3%BCcher.example", "xn--bcher-kva.example"),
    ("bücher.example", "xn--bcher-kva.example"), ("[::1]", "::1"), ("%31%32%37.0.0.1", "127.0.0.1"),
    ("x_y.internal", "x_y.internal"),
])
def test_hosts_are_judged_as_the_client_resolves_them(written: str, resolved: str) -> None:
    assert normal_host(written) == resolved
    if not resolved[0].isdigit() and ":" not in resolved:  # addresses are judged when connected to
        assert EgressPolicy.build(deny=[resolved]).host_refusal(written) is not None


@pytest.mark.parametrize(("written", "why"), [
    ("a%2fb", "(decoded: 'a/b') is not a host name"), ("a%40b", "is not a host name"), ("a%20b", "is not a host name"),
    ("a%0ab", "is not a host name"), ("a%2525b", "is not a host name"), ("a..b", "is not a host name"),
    ("%2e", "is not a host name"), ("a%ffb", "not UTF-8"), ("", "is not a host name"),
])
def test_hosts_that_decode_to_what_no_name_holds_are_refused(written: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        normal_host(written)
    refusal = EgressPolicy.build().host_refusal(written)
    assert refusal is not None and why in refusal


def test_the_client_is_handed_the_name_the_policy_judged() -> None:
    assert str(outgoing_url("http://%76m:19001/x?q=1")) == "http://vm:19001/x?q=1"
    assert str(outgoing_url("https://B%C3%BCcher.example./")) == "https://xn--bcher-kva.example/"
    for url, why in [("http://[::1", "Invalid IPv6 URL"), ("http://a:65536/", "Port out of range"),
                     ("http://a:0/", "port 0"), ("ftp://a/", "not an http(s) URL")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            outgoing_url(url)


# URLs made of parts yarl leaves alone and parts it changes or refuses: a scheme's own port, dot
# segments, escapes, upper case, IDNA, addresses, empty queries, fragments, characters to encode.
_SCHEMES = ["http", "https", "HTTP", "ftp"]
_HOSTS = ["a", "example.com", "A.com", "127.0.0.1", "01.2.3.4", "1.2.3", "xn--bcher-kva.example", "xn--zz", "a_b.c",
          "a..b", "a.", "-a.b", "a-", "0x7f.1", "[::1]", "ex%41mple.com", "bücher.example", "a" * 64 + ".com",
          "a." * 126 + "b", "a." * 127 + "b", "", "u:p@a", "u@a", ":p@a", "@a"]
_PORTS = [None, "", "80", "443", "0", "1", "8080", "65535", "65536", "080", "99999"]
_PATHS = ["", "/", "/x", "/a/b/../c", "/./x", "/.x", "/x.", "/x/..", "/~u", "/%7e", "/x y", "/x;y",
          "/x'y(z)*!$,=:@", "//x", "/é", "/x#f", "/x\\y", "/a-b_c.d"]
_QUERIES = [None, "", "a=1", "a=b+c&d=e", "q=a/b?c", "x=%20", "x=é", "a==b", "$'()*!,:@-._~", "a=1#f", "a b"]


def _parsed(text: str) -> tuple[object, ...] | str:
    try:
        url = outgoing_url(text)
    except ValueError:
        return "refused"
    if url.raw_user is not None or url.raw_password is not None:
        return "refused"  # user info: never sent, the job would hold it in plain text
    host = url.raw_host or ""
    return str(url), host, (url.scheme, host, url.port)


def _targeted(text: str) -> tuple[object, ...] | str:
    try:
        return tuple(outgoing_request.__wrapped__(text))
    except ValueError:
        return "refused"


def test_a_url_is_targeted_as_parsed() -> None:
    """outgoing_request matches the URLs yarl would leave as they are, and parses the others: every
    URL of the product of the parts above gives what outgoing_url gives (text, host and origin), and a
    URL with user info is refused."""
    matched = 0
    for scheme, host, port, path, query in itertools.product(_SCHEMES, _HOSTS, _PORTS, _PATHS, _QUERIES):
        text = (f"{scheme}://{host}" + ("" if port is None else f":{port}") + path
                + ("" if query is None else f"?{query}"))
        assert _targeted(text) == _parsed(text), text
        matched += ssrf._PLAIN_URL.fullmatch(text) is not None
    assert matched > 5000  # URLs the pattern matched: the match was compared, not only the parse


@pytest.mark.parametrize(("role", "args", "share"), [
    ("worker", [], 0.8), ("up", [], 0.8),
    ("worker", ["--owner-share", "1"], 1.0), ("up", ["--owner-share", "0.5"], 0.5),
])
def test_the_owner_share_reaches_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str,
                                            args: list[str], share: float) -> None:
    monkeypatch.delenv("CHIMES_OWNER_SHARE", raising=False)
    params = cli.commands[role].make_context(role, list(args)).params
    assert worker_security(tmp_path, params).owner_share == share
