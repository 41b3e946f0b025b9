"""Who may use the server: the Host check, CORS, and network exposure.

The server runs on a person's own machine, next to their browser. Three rules
keep web pages and the network out by default:

- **Host check** (against DNS rebinding): a request whose ``Host`` is not a
  loopback name or address, the bound address, or a name in ``--allowed-hosts``
  is answered 403 before any route runs. A page on ``evil.example`` whose name
  was rebound to 127.0.0.1 still sends ``Host: evil.example``. Bound to a
  wildcard address (``0.0.0.0``, ``::``), any IP literal passes too: an address
  cannot be rebound.
- **CORS**: only the server's own origin (the scheme, host and port it was
  reached by, the Host check passed) and the origins ``--allowed-origins``
  names get ``Access-Control-Allow-*`` headers; ``*`` allows any, explicitly.
- **Exposure**: binding a non-loopback address without an API key is refused
  unless ``--no-api-key`` says it is meant.
"""

from __future__ import annotations

import ipaddress

from .settings import Settings

_WILDCARDS = ("0.0.0.0", "::", "")


def split_host(host: str) -> tuple[str, str | None]:
    """``Host`` header to (name, port): ``[::1]:8080`` -> (``::1``, ``8080``)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else None
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name, port
    return host, None


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """A loopback name or address (``localhost``, 127.0.0.0/8, ``::1``)."""
    ip = _ip(name.strip("[]"))
    return name == "localhost" or name.endswith(".localhost") or (ip is not None and ip.is_loopback)


def host_allowed(host: str | None, settings: Settings) -> bool:
    """Whether a request that says ``Host: host`` is for this server."""
    allowed = settings.allowed_hosts
    if host is None or "*" in allowed:  # HTTP/1.0 may send none; a browser always does
        return True
    name, _ = split_host(host)
    if name in allowed or is_loopback(name):
        return True
    bound = settings.host.strip("[]").lower()
    ip = _ip(name)
    return ip is not None and (bound in _WILDCARDS or ip == _ip(bound))


def cors_headers(origin: str | None, host: str | None, settings: Settings) -> dict[str, str]:
    """The CORS headers an answer to ``origin`` carries: none for an origin that
    is neither the server's own nor allowed (a refused preflight says nothing)."""
    if not origin:
        return {}
    allowed = settings.allowed_origins
    own = host is not None and origin.lower() in (f"http://{host}".lower(),
                                                  f"https://{host}".lower())  # fmt: skip
    if not (own or "*" in allowed or origin in allowed):
        return {}
    return {
        "Access-Control-Allow-Origin": "*" if "*" in allowed and not own else origin,
        "Access-Control-Allow-Headers": "*",
        "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
        "Vary": "Origin",
    }


def exposure_problem(settings: Settings) -> str | None:
    """Why the server must not start as set (None: it may)."""
    if is_loopback(settings.host) or settings.api_key or settings.no_api_key:
        return None
    return (
        f"binding {settings.host} opens the model to the network, and no API key is set: "
        "add --api-key KEY (or set MLX_NURSERY_API_KEY), or say --no-api-key to serve "
        "without one on purpose"
    )


def reach(settings: Settings) -> str:
    """Who can reach the server, for the log line at start."""
    if is_loopback(settings.host):
        who = "this machine only (loopback)"
    elif settings.api_key:
        who = f"the network through {settings.host}, with the API key"
    else:
        who = f"the network through {settings.host}, WITHOUT an API key (--no-api-key)"
    if "*" in settings.allowed_origins:
        pages = "any web page (--allowed-origins *)"
    elif settings.allowed_origins:
        pages = "its own pages and " + ", ".join(settings.allowed_origins)
    else:
        pages = "its own pages only"
    return f"{who}; browsers: {pages}"
