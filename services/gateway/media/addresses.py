"""Which IP addresses an image URL may reach: public unicast only, unless the operator allow-listed the host.

IPv6 forms that carry an IPv4 address (IPv4-mapped ::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16, Teredo) are
judged by the IPv4 address inside them, since that is where a packet to them ends up.
"""

from __future__ import annotations

import ipaddress
import re
import socket

_LEGACY_IPV4 = re.compile(r"(0[xX][0-9a-fA-F]+|[0-9]+)(\.(0[xX][0-9a-fA-F]+|[0-9]+)){0,3}")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(host: str) -> IPAddress | None:
    """The address if `host` is an IP literal (brackets and an IPv6 zone allowed), else None. Legacy IPv4 forms
    that the C resolver also accepts (2130706433, 0x7f.1, 127.1) count as the address they name."""
    text = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr.teredo is not None:
        return addr.teredo[1]      # (server, client): the client is where the packet goes
    return None


def refusal_reason(addr: IPAddress) -> str | None:
    """Why a connection to `addr` is refused ("a loopback address", ...), or None for a public address."""
    if isinstance(addr, ipaddress.IPv6Address):
        inner = _embedded_ipv4(addr)
        if inner is not None:
            reason = refusal_reason(inner)
            return f"{reason} ({inner} inside {addr})" if reason else None
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved", "site_local"):
        if getattr(addr, f"is_{kind}", False):
            article = "an" if kind == "unspecified" else "a"
            return f"{article} {kind.replace('_', '-')} address"
    if not addr.is_global:          # shared address space 100.64/10, documentation ranges, ...
        return "an address that is not globally routable"
    return None
