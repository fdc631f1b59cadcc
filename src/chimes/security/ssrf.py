"""Server-side request forgery: which addresses an HTTP task may connect to.

The check runs on the address actually connected to, after DNS, inside the HTTP client's
connector: a name that resolves to a denied address is refused even if it resolved elsewhere a
moment before (no DNS rebinding), and so is a redirect to one. Link-local and cloud metadata
addresses are denied by default; the operator adds deny and allow entries (networks or host names).
Loopback (the host's own services) is denied unless the operator allows it (``chimes worker`` denies
it, ``chimes up`` allows it for the one-person tour). Private ranges are allowed: internal services
are what teams call. IPv4 written inside IPv6 (mapped ``::ffff:a.b.c.d``, SIIT's translated
``::ffff:0:a.b.c.d``, compatible ``::a.b.c.d``, 6to4 ``2002::/16``, Teredo ``2001::/32`` and NAT64
``64:ff9b::/96``) is checked as the IPv4 address it reaches.

With loopback denied, a task can still reach a service on this host that listens on every address
(``0.0.0.0``, ``::``) through the host's own other addresses (its LAN or public address): those are
not loopback, and only the operator knows them. Deny them by name (``--egress-deny``, docs/security.md).

Rules, in order: a denied address or host is refused; then, if there is an allow list, only an
address or host on it is allowed; everything else is allowed.

An allow entry naming a network or address inside a default-denied range (``127.0.0.0/8``,
``169.254.169.254``) is what the operator means: that part of the range is lifted from the defaults
(:attr:`EgressPolicy.lifted`, logged at start-up). An allow entry wider than a default-denied range
(``0.0.0.0/0``, ``100.64.0.0/10`` around Alibaba's metadata address) lifts nothing: naming the whole
internet is not naming the metadata service. Entries the operator denies with ``deny`` are never lifted.
Host names are judged as the client will resolve them (:func:`normal_host`): clients percent-decode
a URL's host (``http://%76m/`` calls ``vm``), so a rule compared with the host as written in the URL
was passed by encoding one letter. Each URL's host is normalised once (:func:`outgoing_url`) and the
client is handed that very name, so the name judged and the name resolved are the same.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
import idna
from yarl import URL

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Denied unless the operator turns the defaults off: instance metadata services and link-local.
DEFAULT_DENY = (
    "169.254.0.0/16",      # IPv4 link-local: AWS, GCP, Azure, OpenStack, DigitalOcean metadata at .169.254
    "fe80::/10",           # IPv6 link-local
    "fd00:ec2::254/128",   # AWS instance metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "168.63.129.16/32",    # Azure WireServer
)
#: The host itself: denied unless ``allow_loopback`` (0.0.0.0 and :: reach it too on Linux).
LOOPBACK = ("127.0.0.0/8", "::1/128", "0.0.0.0/8", "::/128")
#: NAT64's well-known prefix (RFC 6052): 64:ff9b::a.b.c.d reaches a.b.c.d through a NAT64 gateway.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: SIIT's IPv4-translated addresses (RFC 2765): ::ffff:0:a.b.c.d reaches a.b.c.d through a translator.
_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")


class EgressDenied(OSError):
    """A connection the egress policy refuses; raised before any socket connects."""

    def __init__(self, reason: str) -> None:
        super().__init__(13, f"refused by egress policy: {reason}")  # 13: EACCES
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HostPattern:
    """``example.com`` (that host) or ``*.example.com`` / ``.example.com`` (its subdomains)."""

    name: str
    subdomains: bool

    @classmethod
    def parse(cls, text: str) -> HostPattern:
        text = text.strip()
        subdomains = text.startswith(("*.", "."))
        name = normal_host(text.removeprefix("*").removeprefix("."))  # ValueError names a bad entry
        return cls(name, subdomains)

    def matches(self, host: str) -> bool:
        return host.endswith("." + self.name) if self.subdomains else host == self.name

    def __str__(self) -> str:
        return f"*.{self.name}" if self.subdomains else self.name


@dataclass(frozen=True, slots=True)
class DefaultOverlap:
    """An allow entry (``allowed``) that overlaps a default-denied network (``default``)."""

    allowed: IPNetwork
    default: IPNetwork


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    deny_networks: tuple[IPNetwork, ...] = ()
    deny_hosts: tuple[HostPattern, ...] = ()
    allow_networks: tuple[IPNetwork, ...] = ()
    allow_hosts: tuple[HostPattern, ...] = ()
    lifted: tuple[DefaultOverlap, ...] = ()  # allow entries inside a default-denied network: turned on
    kept: tuple[DefaultOverlap, ...] = ()  # allow entries around a default-denied network: it stays denied

    @classmethod
    def build(cls, *, allow: Iterable[str] = (), deny: Iterable[str] = (), default_deny: bool = True,
              allow_loopback: bool = True) -> EgressPolicy:
        """From operator entries (CIDR networks, addresses or host names); raises ValueError naming a bad one.
        ``allow_loopback=False`` denies the host's own addresses (:data:`LOOPBACK`); the command line
        decides per role (``chimes worker`` denies them by default)."""
        defaults = (list(DEFAULT_DENY) if default_deny else []) + ([] if allow_loopback else list(LOOPBACK))
        operator_deny, deny_hosts = _parse(deny)
        allow_networks, allow_hosts = _parse(allow)
        default_networks = tuple(ipaddress.ip_network(d) for d in defaults)
        overlaps = [DefaultOverlap(a, d) for a in allow_networks for d in default_networks if _overlap(a, d)]
        lifted = tuple(o for o in overlaps if _within(o.allowed, o.default))
        still_denied = [part for network in default_networks for part in _less(network, lifted)]
        named = {o.default for o in lifted if o.allowed == o.default}  # lifted whole by another entry
        kept = tuple(o for o in overlaps if o not in lifted and o.default not in named)
        return cls(operator_deny + tuple(still_denied), deny_hosts, allow_networks, allow_hosts, lifted, kept)

    @property
    def has_allow_list(self) -> bool:
        return bool(self.allow_networks or self.allow_hosts)

    def address_refusal(self, address: str) -> str | None:
        """Why connecting to ``address`` is refused by the deny list, or None."""
        ip = _parse_address(address)
        if ip is None:
            return f"{address} is not an IP address"
        for network in self.deny_networks:
            if any(candidate in network for candidate in _forms(ip)):
                return f"address {ip} is in the denied network {network}"
        return None

    def host_refusal(self, host: str) -> str | None:
        """Why ``host`` is refused by name (before it is resolved), or None. ``host`` is judged as it
        will be resolved (:func:`normal_host`); one that is not a host name is refused."""
        try:
            name = normal_host(host.strip())
        except ValueError as exc:
            return str(exc)
        for pattern in self.deny_hosts:
            if pattern.matches(name):
                return f"host {name} is denied ({pattern})"
        return None

    def refusal(self, host: str, address: str) -> str | None:
        """Why connecting to ``address`` for ``host`` is refused, or None when it is allowed."""
        reason = self.address_refusal(address) or self.host_refusal(host)
        if reason is not None:
            return reason
        name = _normal_host(host)
        if not self.has_allow_list:
            return None
        ip = _parse_address(address)
        if any(p.matches(name) for p in self.allow_hosts) or any(
            candidate in network for network in self.allow_networks for candidate in _forms(ip)
        ):
            return None
        return f"{name} ({address}) is not on the allow list"


def _parse(entries: Iterable[str]) -> tuple[tuple[IPNetwork, ...], tuple[HostPattern, ...]]:
    networks: list[IPNetwork] = []
    hosts: list[HostPattern] = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if any(ch in entry for ch in "/: ") or not entry.strip("*."):
            raise ValueError(f"{entry!r} is neither a network (10.0.0.0/8, fd00::/8), an address nor a host name")
        hosts.append(HostPattern.parse(entry))
    return tuple(networks), tuple(hosts)


def _overlap(a: IPNetwork, b: IPNetwork) -> bool:
    return a.version == b.version and a.overlaps(b)


def _within(inner: IPNetwork, outer: IPNetwork) -> bool:
    return inner.version == outer.version and inner.subnet_of(outer)  # type: ignore[arg-type]


def _less(network: IPNetwork, lifted: Iterable[DefaultOverlap]) -> list[IPNetwork]:
    """``network`` without the lifted parts inside it, as the networks that remain."""
    parts = [network]
    for overlap in lifted:
        parts = [rest for part in parts for rest in _part_less(part, overlap.allowed)]
    return parts


def _part_less(part: IPNetwork, allowed: IPNetwork) -> list[IPNetwork]:
    if _within(part, allowed):
        return []
    if _within(allowed, part):
        return list(part.address_exclude(allowed))  # type: ignore[arg-type]
    return [part]
#: What a host name may hold once decoded: ASCII letters (IDNA-encoded), digits, ``-``, ``_`` and dots
#: between non-empty labels. HTTP clients refuse spaces, ``/``, ``@``, ``%`` and the like after decoding.
_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
_MAX_HOST_NAME = 253


@functools.lru_cache(maxsize=4096)  # a fleet calls a few hosts: each normalised once
def normal_host(host: str) -> str:
    """``host`` as a client resolves it: percent-decoded (as clients decode a URL's host), an IP address
    in its compressed form, a name lower-cased, IDNA-encoded and without its trailing dot. Raises
    ValueError, saying why, for a host that decodes to anything a host name cannot hold (control
    characters, spaces, ``%``, ``@``, ``/``, empty labels, invalid UTF-8)."""
    try:
        decoded = urllib.parse.unquote(host, errors="strict") if "%" in host else host
    except UnicodeDecodeError:
        raise ValueError(f"host {host!r} decodes to bytes that are not UTF-8") from None
    bare = decoded[1:-1] if decoded.startswith("[") and decoded.endswith("]") else decoded
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    name = bare.lower()
    name = name[:-1] if name.endswith(".") else name  # vm. is vm, the name made absolute
    if not name.isascii():
        try:
            name = idna.encode(name, uts46=True).decode("ascii")
        except idna.IDNAError as exc:
            raise ValueError(f"host {host!r} is not a valid international host name: {exc}") from None
    if len(name) > _MAX_HOST_NAME or _HOST_NAME.fullmatch(name) is None:
        shown = f"{host!r}" if decoded == host else f"{host!r} (decoded: {decoded!r})"
        raise ValueError(f"host {shown} is not a host name: a name holds letters, digits, '-', '_' and "
                         "dots between labels, an address is IPv4 or IPv6 in brackets")
    return name


@functools.lru_cache(maxsize=1024)  # a job's runs call one URL: parsed and normalised once
def outgoing_url(text: str) -> URL:
    """The ``http(s)`` URL a client is handed for ``text``: its host normalised (:func:`normal_host`),
    so that the name the egress policy judges is the name the client resolves. Raises ValueError,
    saying what is wrong, for a URL no call can be made to (no host, a port out of range, an unclosed
    IPv6 bracket, a host that is not one)."""
    try:
        url = URL(text)
    except ValueError as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {text!r}")
    if not url.raw_host:
        raise ValueError("the URL has no host")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"port {url.port} is not from 1 to 65535")
    host = normal_host(url.raw_host)
    return url if host == url.raw_host else url.with_host(host)


# A URL as most jobs write one, which yarl would hand back unchanged: http(s), a lower-case host name
# or IPv4 address, a port, then a path and a query of characters that need no escaping. Dot segments,
# "xn--" labels and a scheme's own port are also changed or judged by yarl: checked apart.
_PLAIN_URL = re.compile(r"(https?)://([a-z0-9_-]+(?:\.[a-z0-9_-]+)*)(?::([1-9][0-9]{0,4}))?"
                        r"((?:/[A-Za-z0-9._~!$&'()*+,;=:@/-]*(?:\?[A-Za-z0-9._~!$&'()*+,;=:@/?-]+)?)?)")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


class OutgoingRequest(NamedTuple):
    """Where an HTTP task's call to a URL goes (:func:`outgoing_request`): the URL's text as the client
    is handed it, its host as the policy judges it and the client resolves it, and the origin (scheme,
    host and port) that decides which headers a redirect hop keeps."""

    url: str
    host: str
    origin: tuple[str, str, int]


#: Why an HTTP task's URL may not carry user info, and what to do instead.
USER_INFO_REFUSED = ("the URL carries user info (user:password@), which Chimes does not send: put the "
                     "credentials in task.secretHeaders, where they are stored sealed, e.g. "
                     "{\"Authorization\": \"Basic <base64 of user:password>\"}")


@functools.lru_cache(maxsize=1024)
def outgoing_request(text: str) -> OutgoingRequest:
    """:func:`outgoing_url` for an HTTP task: split as its calls use it, and refused with user info
    (:data:`USER_INFO_REFUSED`), which a job would otherwise hold in plain text. Raises ValueError,
    saying why. A URL nothing would change is matched rather than parsed, at about a third of the
    cost: a burst of jobs that each call a URL of their own parses each once
    (tests/unit/test_security.py compares the two)."""
    plain = _PLAIN_URL.fullmatch(text)
    if plain is not None:
        scheme, host, port, rest = plain.groups()
        if (len(host) <= _MAX_HOST_NAME and "xn--" not in host and "/." not in rest
                and (port is None or (int(port) <= 65535 and port != _DEFAULT_PORTS[scheme]))):
            return OutgoingRequest(text, host, (scheme, host, int(port or _DEFAULT_PORTS[scheme])))
    url = outgoing_url(text)
    if url.raw_user is not None or url.raw_password is not None:
        raise ValueError(USER_INFO_REFUSED)
    host = url.raw_host or ""
    return OutgoingRequest(str(url), host, (url.scheme, host, url.port or int(_DEFAULT_PORTS[url.scheme])))


def url_problem(text: str) -> str | None:
    """Why no call can ever be made to ``text`` (:func:`outgoing_url`), or None."""
    try:
        outgoing_url(text)
    except ValueError as exc:
        return str(exc)
    return None


def request_url_problem(text: str) -> str | None:
    """Why no HTTP task may call ``text`` (:func:`outgoing_request`), or None."""
    try:
        outgoing_request(text)
    except ValueError as exc:
        return str(exc)
    return None


def _normal_host(host: str) -> str:
    """A host name as rules compare it; a host that is none keeps a form no rule matches."""
    try:
        return normal_host(host.strip())
    except ValueError:
        return host


def _parse_address(address: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return None


def _forms(ip: IPAddress | None) -> list[IPAddress]:
    """The address and the IPv4 addresses it embeds (::ffff:169.254.169.254, ::ffff:0:a9fe:a9fe,
    2002:a9fe:a9fe:: and 64:ff9b::a9fe:a9fe are all 169.254.169.254; a Teredo address names its
    server and its client)."""
    if ip is None:
        return []
    forms: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        last32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        nat64 = last32 if ip in _NAT64 else None
        translated = last32 if ip in _TRANSLATED else None
        for embedded in (ip.ipv4_mapped, translated, ip.sixtofour, _compat_v4(ip), nat64, *(ip.teredo or ())):
            if embedded is not None:
                forms.append(embedded)
    return forms


def _compat_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    # ::a.b.c.d (deprecated IPv4-compatible form), which some stacks still route to the IPv4 host.
    if int(ip) >> 32 == 0 and int(ip) > 1:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


class GuardedConnector(aiohttp.TCPConnector):
    """A TCP connector that applies an :class:`EgressPolicy` to every address it connects to.

    Two checks: after name resolution (host and address, allow and deny lists; addresses refused
    there are dropped, and the host is refused when none is left), and again when the socket is
    made for the very address being connected (deny list), so nothing can slip between the two.
    """

    def __init__(self, policy: EgressPolicy, **kwargs: Any) -> None:
        self.policy = policy
        super().__init__(socket_factory=self._make_socket, **kwargs)

    async def _resolve_host(self, host: str, port: int, traces: Sequence[Any] | None = None) -> list[Any]:
        reason = self.policy.host_refusal(host)
        if reason is not None:  # a denied name is not even looked up
            raise EgressDenied(reason)
        results = await super()._resolve_host(host, port, traces=traces)
        allowed, reasons = [], []
        for result in results:
            reason = self.policy.refusal(host, result["host"])
            if reason is None:
                allowed.append(result)
            else:
                reasons.append(reason)
        if not allowed:
            raise EgressDenied(reasons[0] if reasons else f"{host} resolved to no address")
        return allowed

    def _make_socket(self, addr_info: Any) -> socket.socket:
        family, type_, proto, _, address = addr_info
        reason = self.policy.address_refusal(str(address[0]))
        if reason is not None:
            raise EgressDenied(reason)
        return socket.socket(family=family, type=type_, proto=proto)


def egress_error(exc: BaseException) -> str | None:
    """The egress refusal behind a client error, if that is what it is."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, EgressDenied):
            return str(current.args[1]) if len(current.args) > 1 else str(current)
        os_error = getattr(current, "os_error", None)
        if isinstance(os_error, EgressDenied):
            return str(os_error.args[1])
        if isinstance(os_error, OSError) and "refused by egress policy" in str(os_error):
            return str(os_error.args[-1])
        current = current.__cause__ or current.__context__
    return None
