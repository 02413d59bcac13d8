"""Tenant resolvers for :mod:`payorch.integrations.fastapi`: FastAPI dependencies that
take the tenant from the request (a header, a path parameter, the authenticated principal),
never from the body. Re-exported there."""

from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeAlias

from fastapi import Depends, Header, Request

from ..errors import ConfigurationError, InvalidTenant

__all__ = ["TenantResolver", "header_tenant", "path_tenant", "principal_tenant"]

# A FastAPI dependency (sync or async, with sub-dependencies of its own) giving the tenant;
# ``None`` means "not authenticated" (401).
TenantResolver: TypeAlias = Callable[..., Any]


def header_tenant(name: str = "X-Tenant-Id") -> TenantResolver:
    """The tenant from header ``name``, set by a trusted gateway; missing or repeated: 400."""

    def tenant(
        request: Request,
        # Declared for the OpenAPI schema; the value is read below, every line of it.
        _declared: Annotated[str | None, Header(alias=name, description="the tenant")] = None,
    ) -> str:
        values = request.headers.getlist(name)
        if len(values) != 1 or not values[0].strip(" \t"):
            raise InvalidTenant(f"send exactly one non-empty {name} header")
        return values[0].strip(" \t")

    return tenant


def path_tenant(name: str = "tenant") -> TenantResolver:
    """The tenant from the path parameter ``name`` (``/t/{tenant}/payments``)."""

    def tenant(request: Request) -> str:
        value = request.path_params.get(name)
        if value is None:  # a route without it: the app's mistake, not the client's
            raise ConfigurationError(f"the route of {request.url.path!r} has no {{{name}}}")
        return str(value)

    return tenant


def principal_tenant(
    principal: Callable[..., Any] | None = None, attr: str = "tenant_id"
) -> TenantResolver:
    """The tenant of the authenticated principal: attribute (or key) ``attr`` of what the
    dependency ``principal`` returns (e.g. the app's ``current_user``), or of Starlette's
    ``request.user`` (AuthenticationMiddleware) when none is given. No principal: 401."""

    def of(user: Any) -> str | None:
        if user is None or not getattr(user, "is_authenticated", True):
            return None
        value = user.get(attr) if isinstance(user, Mapping) else getattr(user, attr, None)
        return None if value is None or value == "" else str(value)

    if principal is not None:

        def from_dependency(user: Annotated[Any, Depends(principal)]) -> str | None:
            return of(user)

        return from_dependency

    def from_scope(request: Request) -> str | None:
        return of(request.user) if "user" in request.scope else None

    return from_scope
