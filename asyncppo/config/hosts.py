"""Host names and addresses as the configuration reasons about them.

The loopback rule lives here, in config/, because validation needs it (a loopback bind with an outward advertised
address is refused) and config/ imports nothing of stream/; the stream's security module and the launcher use the
same function, so the rule is stated once.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1`` (brackets allowed)."""
    h = host.strip().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
