"""Who is asking, and what they may see: tenants (API keys) and operators.

With API keys on, every object a client creates (an uploaded file, a batch and
its output and error files, a request's timeline) records its owner: the
digest of the key that created it (`key_digest`: HMAC-SHA256 under the owner
secret; Redis never holds a key). A tenant sees only what it owns: any other
id answers exactly as a missing one (same 404, same message), so a tenant
cannot even learn that another tenant's id exists, and lists hold only its
own objects. Operator keys (`gateway.operator_api_keys`) call every route and
see and manage every tenant's objects; the dashboard and batch runners need
one. Without keys, everyone is one anonymous tenant that sees everything.

Batch lines run as their batch's owner: the line route runs each through the
gateway's own endpoint in process (`on_behalf_of`), so the request's timeline
belongs to the tenant whose batch it is, not to the runner's operator key.

A tenant key has limits (docs/operations.md "Tenants"): a token budget (prompt
+ output tokens per minute, gateway/ratelimit.py) and the strictest SLO tier it
may use (scheduler/tiers.py), the [gateway] defaults unless its line of the key
file says otherwise. Operator keys have neither: they are the fleet's own tools
(batch runners, the dashboard). A batch line keeps its owner's tier limit but
not the budget: the batch runner paces the lines by the fleet's load, in the
batch tier, and would turn a budget's 429s into failed lines after a few tries.

A tenant key may also be limited to named models (`models=` on its line: base models' served names
and LoRA adapters' names). It then sees only those in `/v1/models`, and a request naming any other
model is answered as one naming a model that does not exist (vLLM's 404, `NotFoundError`), the rule
of the first paragraph: a limited tenant cannot tell another tenant's adapter from a name nobody
loaded. A request that names no model is the gateway's own model's, as in `vllm serve`, so it too must
be listed. Batch lines keep their owner's models.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from skyline.core.config import GatewayConfig
from skyline.core.config_rules import ConfigError
from skyline.core.timeline import key_digest
from skyline.gateway.errors import ApiError
from skyline.gateway.prepare import check_auth

log = logging.getLogger("skyline.gateway")


@dataclass(frozen=True)
class Tenant:
    owner: str  # recorded on what it creates: its key's digest; "" on a gateway without keys
    sees_all: bool = False  # an operator key, or anyone on a gateway without keys
    tokens_per_minute: int = 0  # its token budget (prompt + output); 0 = none
    strictest_tier: str = ""  # the strictest SLO tier it may use; "" = any
    response_store_bytes: int | None = None  # what its stored responses may take; None = the [gateway] default
    models: frozenset[str] | None = None  # the models it may name (see the module docstring); None = every one

    def may_use(self, model: str) -> bool:
        """May this tenant name `model` (a base model's served name or an adapter's name)?"""
        return self.models is None or model in self.models

    def owns(self, owner: str | None) -> bool:
        """May this tenant see an object recorded with `owner` (None: recorded without one)?"""
        if self.sees_all:
            return True
        return bool(owner) and hmac.compare_digest(owner, self.owner)

    @property
    def lists_of(self) -> str:
        """Whose objects its lists show: its own, or "" (everyone's)."""
        return "" if self.sees_all else self.owner


ANONYMOUS = Tenant("", sees_all=True)

# Set by the batch line route around its in-process request (see the module docstring).
_ACTING_FOR: ContextVar[str] = ContextVar("skyline_acting_for", default="")


@contextmanager
def on_behalf_of(owner: str) -> Iterator[None]:
    """Requests authenticated inside this block (in this task) are `owner`'s: the batch line
    route, which has checked that its caller may run the batch, runs the line as the batch's
    owner. A context variable, not a header, so no client can claim to act for someone."""
    token = _ACTING_FOR.set(owner)
    try:
        yield
    finally:
        _ACTING_FOR.reset(token)


def api_key_of(request: Request) -> str | None:
    """The bearer token the request authenticated with (check_auth already validated it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def tenant_of(request: Request) -> Tenant | None:
    """The tenant `Tenants.authenticate` found for this request (None: not authenticated yet)."""
    return getattr(request.state, "tenant", None)


class Tenants:
    """The gateway's keys and owner secret, fixed for the life of the app."""

    def __init__(self, g: GatewayConfig):
        self.keys = g.api_keys + g.operator_api_keys  # either kind may call every route
        self.operator_keys = g.operator_api_keys
        self.secret = owner_secret(g)
        self.default_limits = (g.tenant_tokens_per_minute, g.tenant_strictest_tier)
        # By owner digest, the one thing known of a batch line's tenant (see the module docstring).
        self.limits: dict[str, tuple[int, str]] = {key_digest(k, self.secret): (0, "") for k in self.operator_keys}
        # Stored responses' bounds of the keys whose line names one (gateway/responses_api.py).
        self.store_bytes: dict[str, int] = {key_digest(k.key, self.secret): k.response_store_bytes
                                            for k in g.key_options if k.response_store_bytes is not None}
        # The models of the keys whose line names them (the module docstring), by owner digest too.
        self.models: dict[str, frozenset[str]] = {key_digest(k.key, self.secret): frozenset(k.models)
                                                  for k in g.key_options if k.models is not None}
        for k in g.key_options:
            tpm, tier = k.limits
            self.limits[key_digest(k.key, self.secret)] = (self.default_limits[0] if tpm is None else tpm,
                                                           self.default_limits[1] if tier is None else tier)

    @property
    def on(self) -> bool:
        return bool(self.keys)

    def authenticate(self, request: Request) -> Tenant:
        """The request's tenant (401 without a valid key, when keys are on), kept on the request
        for what runs later in it (the timeline's requester)."""
        check_auth(request, self.keys)
        if not self.keys:
            tenant = ANONYMOUS
        elif acting := _ACTING_FOR.get():  # a batch line: its owner's tier limit, no budget (module docstring)
            tenant = Tenant(acting, strictest_tier=self.limits.get(acting, self.default_limits)[1],
                            response_store_bytes=self.store_bytes.get(acting), models=self.models.get(acting))
        else:
            key = api_key_of(request) or ""
            # Constant-time, like check_auth: which keys are operators' must not show in timing either.
            operator = any(hmac.compare_digest(key.encode(), k.encode()) for k in self.operator_keys)
            owner = key_digest(key, self.secret)
            if operator:
                tenant = Tenant(owner, sees_all=True)
            else:
                tokens_per_minute, strictest_tier = self.limits.get(owner, self.default_limits)
                tenant = Tenant(owner, tokens_per_minute=tokens_per_minute, strictest_tier=strictest_tier,
                                response_store_bytes=self.store_bytes.get(owner), models=self.models.get(owner))
        request.state.tenant = tenant
        return tenant


def check_model(tenant: Tenant, model: str) -> None:
    """Refuse a tenant's request naming a model it may not use, as vLLM refuses a model that does not
    exist (404 NotFoundError, the module docstring), naming the models it may use instead of the fleet's."""
    if not tenant.may_use(model):
        allowed = ", ".join(sorted(tenant.models or ()))
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {allowed}.", type="NotFoundError",
                       param="model")


def owner_secret(g: GatewayConfig) -> bytes:
    """The HMAC key of the owner digests: `gateway.owner_secret_file`, else derived from the keys.

    A configured secret is the one to use in production: every gateway of the fleet reads the same
    file, and keys can be added, rotated or removed without touching what tenants own. Without
    it the secret is derived from the tenant keys (the operator keys when there are none), so a
    fleet whose gateways share a key list agrees on owners with nothing more to configure, and
    the secret is still nothing Redis holds; but changing that key list re-keys every owner, and
    tenants no longer see what they created before (operators still do). Operator keys are left
    out of the derivation so adding one (for a new batch runner, say) changes nothing.
    """
    if g.owner_secret_file:
        try:
            secret = Path(g.owner_secret_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"[gateway] owner_secret_file = {g.owner_secret_file!r}: {exc}") from None
        if not secret:
            raise ConfigError(f"[gateway] owner_secret_file = {g.owner_secret_file!r} is empty")
        return secret.encode()
    basis = sorted(set(g.api_keys or g.operator_api_keys))
    if basis:
        log.warning("gateway.owner_secret_file is not set: owner digests are keyed by a secret derived from the "
                    "API keys; changing the keys hides earlier files, batches and timelines from their tenants")
    return hashlib.sha256(b"skyline-owner-secret\0" + "\0".join(basis).encode()).digest()
