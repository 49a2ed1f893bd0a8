"""The admin key: engine control routes (pause, resume, weight updates) answer only `Authorization: Bearer
<--admin-api-key>`. They are registered only when that flag is set (otherwise they are 404 like any unknown
route), and the user key (--api-key) is not enough: it gets 403, so a leaked user key cannot stop or swap the
model. Keys are compared in constant time."""

from __future__ import annotations

import hmac

from aiohttp import web

from steploop.gateway.errors import APIError

# The routes behind the admin key (control_routes.py registers them; this list is what the middleware guards).
ADMIN_PATHS = frozenset({"/pause", "/resume", "/is_paused", "/update_weights_from_disk", "/get_weight_version",
                         "/sleep", "/wake_up", "/is_sleeping", "/init_weights_update_group",
                         "/update_weights_from_distributed"})


def _bearer(request: web.Request) -> bytes:
    header = request.headers.get("Authorization", "")
    if not header and request.headers.get("x-api-key"):
        header = f"Bearer {request.headers['x-api-key']}"
    return header.encode()


def admin_middleware(admin_key: str, user_key: str | None):
    expected = f"Bearer {admin_key}".encode()
    user = f"Bearer {user_key}".encode() if user_key else None

    @web.middleware
    async def check_admin(request: web.Request, handler) -> web.StreamResponse:
        if request.path in ADMIN_PATHS:
            sent = _bearer(request)
            if not hmac.compare_digest(sent, expected):
                if user is not None and hmac.compare_digest(sent, user):
                    raise APIError(403, f"{request.path} is an admin route: the user API key is not enough; send "
                                   "'Authorization: Bearer <admin key>' (--admin-api-key)", type="permission_error",
                                   code="permission_denied")
                raise APIError(401, "invalid or missing admin API key: send 'Authorization: Bearer <admin key>' "
                               "(--admin-api-key)", code="invalid_api_key")
        return await handler(request)

    return check_admin
