"""What makes a vLLM server lit-ess's: the port it is launched on is free, its answers prove it is the
process launched, and its routes are closed to whoever lacks the fleet's shared token.

vLLM's development routes (`/collective_rpc`, `/pause`, `/update_weight_version`, ...) replace the
policy's weights or call worker methods, and vLLM's `--api-key` does not guard them. Every server
lit-ess starts (launched by the engine, or `python -m lit_ess.engines.serve`) runs `Guard` as an ASGI
middleware (`--middleware lit_ess.engines.guard.Guard`), which

* answers every request with the header `x-lit-ess-server: <id>`, the id the launcher gave it in
  `LIT_ESS_SERVER_ID`: the readiness check knows the server it launched from any other process that
  answers on its port;
* when `LIT_ESS_SERVER_TOKEN` is set in the server's environment, answers 401 to any request but
  `GET /health` that lacks `Authorization: Bearer <token>`. A server reachable from other machines
  (a non-loopback `--host`) refuses to start without it; lit-ess's client sends the token of its own
  environment (`auth_headers`). The secret travels in the environment, never in a config file, which
  runs save beside their checkpoints.
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import socket

TOKEN_ENV = "LIT_ESS_SERVER_TOKEN"
ID_ENV = "LIT_ESS_SERVER_ID"
ID_HEADER = "x-lit-ess-server"
MIN_TOKEN = 16
OPEN_ROUTES = ("/health",)          # a heartbeat and a readiness probe need no secret


class Guard:
    """ASGI middleware of a lit-ess server: its id on every answer, and the shared token on every route but
    /health when LIT_ESS_SERVER_TOKEN is set (read once, when vLLM builds its app)."""

    def __init__(self, app):
        self.app = app
        self.id = os.environ.get(ID_ENV, "").encode()
        token = os.environ.get(TOKEN_ENV, "")
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.token is not None and path not in OPEN_ROUTES and not self._authorized(scope):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            body = json.dumps({"error": f"Unauthorized: this server wants the fleet's shared token "
                                        f"(Authorization: Bearer ${TOKEN_ENV})"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"www-authenticate", b"Bearer"), (ID_HEADER.encode(), self.id)]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            return await send({"type": "http.response.body", "body": body})

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (ID_HEADER.encode(), self.id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _authorized(self, scope) -> bool:
        sent = next((v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), b"")
        scheme, _, token = sent.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.token)


def auth_headers() -> dict[str, str]:
    """The headers of lit-ess's requests to servers: the shared token of this process's environment, if any."""
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def unauthorized_hint() -> str:
    """What to do about a server's 401, for the one line that reports it."""
    if os.environ.get(TOKEN_ENV):
        return f"this process's {TOKEN_ENV} is not the server's: set it to the token the server was started with"
    return f"the server wants the fleet's shared token: set {TOKEN_ENV} to the server's in this process's environment"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback (0.0.0.0 and :: are every interface)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def exposure_error(host: str, where: str) -> str | None:
    """Why a server may not listen on `host` (named by `where`, e.g. "--host 0.0.0.0") with this environment's
    token, or None: a non-loopback host needs LIT_ESS_SERVER_TOKEN; a token set must be long enough to guess."""
    token = os.environ.get(TOKEN_ENV)
    if token is not None and 0 < len(token) < MIN_TOKEN:
        return (f"{TOKEN_ENV} is {len(token)} characters: a shared secret needs {MIN_TOKEN} or more "
                f"(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    if not token and not is_loopback(host):
        return (f"{where} lets other machines reach the server's weight routes: set {TOKEN_ENV} to a shared secret of "
                f"{MIN_TOKEN} characters or more (e.g. `export {TOKEN_ENV}=$(python -c 'import secrets; "
                f"print(secrets.token_hex(16))')`) here and where the trainer runs, or listen on 127.0.0.1")
    return None


def port_holder(host: str, port: int) -> str | None:
    """None when a server can listen on (`host`, `port`); else who holds that port, in words. A port with
    connections closing (TIME_WAIT) is free, as it is for vLLM (SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None                     # another reason vLLM will give in its log (a host not here, ...)
            return f"{host}:{port} is in use by {listener(port)}"
    return None


def listener(port: int) -> str:
    """The process listening on TCP `port` of this machine, in words: "pid N (its command line)" where this
    user may see it."""
    try:
        import psutil                           # vLLM's dependency
    except ImportError:
        return "another process"
    try:
        pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                and c.status == psutil.CONN_LISTEN}
        procs = sorted((psutil.Process(p) for p in pids if p is not None), key=lambda p: p.create_time())
        if procs:                               # forked children share the socket: the oldest made it
            return f"pid {procs[0].pid} ({' '.join(procs[0].cmdline())[:200]})"
    except (psutil.Error, OSError):            # not allowed to look, or a process gone meanwhile
        return "another process"
    return "a process of another user" if pids else "a process this user cannot see"
