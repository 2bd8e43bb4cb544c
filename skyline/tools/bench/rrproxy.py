"""A round-robin HTTP proxy: the `vllm-rr` system's front, N plain vLLM servers behind one URL.

Each POST goes to the next server in turn, whatever it holds: what a plain L7 load balancer does,
and what leaves each server's prefix cache to chance (a conversation's next turn lands on another
server). Other requests (GET /v1/models, /health) go to the first server, so polling does not shift
the turn. Responses are relayed chunk by chunk as they arrive, so TTFT and ITL measured through the
proxy are the servers' (plus a local hop); a client that disconnects closes the upstream connection,
and vLLM aborts the request. It runs as its own process (`python -m skyline.tools.bench.rrproxy
--port P URL...`), off the load generator's event loop, as Skyline's gateway does.
"""

from __future__ import annotations

import argparse
import itertools

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

# Per-connection headers: each hop sets its own.
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
MAX_BODY = 64 << 20


def _end_to_end(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def make_app(upstreams: list[str]) -> web.Application:
    """The proxy over `upstreams` (base URLs, e.g. http://127.0.0.1:8001)."""
    if not upstreams:
        raise ValueError("a round-robin proxy needs at least one upstream server")
    bases = [u.rstrip("/") for u in upstreams]
    turn = itertools.cycle(range(len(bases)))
    app = web.Application(client_max_size=MAX_BODY)

    async def client(app: web.Application):
        # No total timeout (a long stream is fine) and no pool limit (a limit would queue requests
        # here and close the bench's open loop).
        app["http"] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=30),
                                    connector=TCPConnector(limit=0), auto_decompress=False)
        yield
        await app["http"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        base = bases[next(turn)] if request.method == "POST" else bases[0]
        body = await request.read()
        resp: web.StreamResponse | None = None
        try:
            async with app["http"].request(request.method, base + request.path_qs, data=body,
                                           headers=_end_to_end(request.headers)) as up:
                resp = web.StreamResponse(status=up.status, headers=_end_to_end(up.headers))
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except ClientError as exc:
            if resp is not None and resp.prepared:
                raise  # the stream broke midway: so does the client's (a transport error, as from the server)
            # An upstream not (yet) serving: the client sees a gateway error.
            return web.Response(status=502, text=f"upstream {base}: {type(exc).__name__}: {exc}")

    app.cleanup_ctx.append(client)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m skyline.tools.bench.rrproxy", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstreams", nargs="+", help="base URLs of the servers, in turn order")
    args = p.parse_args(argv)
    web.run_app(make_app(args.upstreams), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
