"""CORS: browser pages on another origin may call the API, as vLLM's server allows by default.

vLLM wraps its app in Starlette's CORSMiddleware with `--allowed-origins`, `--allowed-methods`,
`--allowed-headers` (each default `["*"]`) and `--allow-credentials` (default off); the flags here are the same and
behave the same way:
- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered here, before the API-key
  check (browsers never send credentials on a preflight): 200 with the allowed methods and headers, or 400 naming what
  is not allowed;
- every other response to a request with an allowed `Origin` carries `Access-Control-Allow-Origin` (`*`, or the
  origin itself when credentials are allowed or origins are listed, then with `Vary: Origin`), streamed ones too
  (the headers are added as the response is prepared).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from aiohttp import web

from steploop.common import envs

PREFLIGHT_MAX_AGE = 600   # seconds a browser may cache a preflight answer (Starlette's default)
_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_methods", tuple(m.upper() for m in self.allowed_methods))
        object.__setattr__(self, "allowed_headers", tuple(h.lower() for h in self.allowed_headers))

    @property
    def any_origin(self) -> bool:
        return "*" in self.allowed_origins

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin in self.allowed_origins

    def allow_origin_value(self, origin: str) -> str:
        # A wildcard cannot go with credentials (browsers reject it), so then the origin is echoed.
        return "*" if self.any_origin and not self.allow_credentials else origin

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CorsPolicy:
        return cls(allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                   allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials)


def parse_list(text: str) -> list[str]:
    """vLLM takes these flags as JSON lists (`'["https://a.example"]'`); a comma-separated list is accepted too."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return [v.strip() for v in value if v.strip()]
    return [v.strip() for v in text.split(",") if v.strip()]


def _cors_headers(policy: CorsPolicy, origin: str) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": policy.allow_origin_value(origin)}
    if headers["Access-Control-Allow-Origin"] != "*":
        headers["Vary"] = "Origin"
    if policy.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    return headers


def _preflight(policy: CorsPolicy, request: web.Request, origin: str) -> web.Response:
    method = request.headers["Access-Control-Request-Method"].upper()
    asked = [h.strip().lower() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
             if h.strip()]
    refused = []
    if not policy.origin_allowed(origin):
        refused.append("origin")
    if "*" not in policy.allowed_methods and method not in policy.allowed_methods:
        refused.append("method")
    if "*" not in policy.allowed_headers and any(h not in policy.allowed_headers for h in asked):
        refused.append("headers")
    if refused:
        return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
    headers = _cors_headers(policy, origin)
    methods = _ALL_METHODS if "*" in policy.allowed_methods else policy.allowed_methods
    headers["Access-Control-Allow-Methods"] = ", ".join(methods)
    if asked:   # "*" allows whatever the browser asked for, echoed (a literal "*" is not honoured with credentials)
        headers["Access-Control-Allow-Headers"] = ", ".join(asked)
    headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE)
    headers["Vary"] = "Origin"
    return web.Response(status=200, text="OK", headers=headers)


def install(app: web.Application, policy: CorsPolicy):
    """Adds the response headers to `app`; returns the preflight middleware, to be placed outermost (before auth)."""
    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and policy.origin_allowed(origin) and "Access-Control-Allow-Origin" not in response.headers:
            for name, value in _cors_headers(policy, origin).items():
                if name == "Vary" and "Vary" in response.headers:
                    value = f"{response.headers['Vary']}, {value}"
                response.headers[name] = value

    app.on_response_prepare.append(add_headers)

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
            return _preflight(policy, request, origin)
        return await handler(request)

    return preflight


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = CorsPolicy()
    envs.add_flag(parser, "--allowed-origins", type=parse_list, default=list(d.allowed_origins),
                  help="origins browser pages may call the API from (CORS), a JSON list as vLLM's flag or "
                       "comma-separated; [\"*\"]: any")
    envs.add_flag(parser, "--allowed-methods", type=parse_list, default=list(d.allowed_methods),
                  help="HTTP methods a cross-origin page may use (CORS preflight)")
    envs.add_flag(parser, "--allowed-headers", type=parse_list, default=list(d.allowed_headers),
                  help="request headers a cross-origin page may send (CORS preflight)")
    envs.add_flag(parser, "--allow-credentials", type=bool, default=d.allow_credentials,
                  help="let cross-origin pages send cookies and auth headers (CORS); the origin is then echoed "
                       "instead of '*'")

