"""The ``payorch`` command: operators' tools, the reconciler daemon and the demo.

Exit codes: 0 ok, 1 not found or refused, 2 usage. A user mistake is one line on stderr,
never a traceback.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from orchestrator import migrate
from orchestrator.errors import PayorchError
from orchestrator.settings import Settings

__all__ = ["app", "main"]


class _Group(TyperGroup):
    """Turns payorch's own errors into one line on stderr and exit code 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except PayorchError as exc:
            err.print(
                f"error: {' '.join(exc.message.split())}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None


app = typer.Typer(
    name="payorch",
    cls=_Group,
    help="Durable payment-operation orchestrator: one explainable effect per operation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")

out = Console()
err = Console(stderr=True)

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="SQLAlchemy URL; defaults to PAYORCH_DATABASE_URL, else sqlite:///payorch.db.",
        show_default=False,
    ),
]


def database_url(value: str | None) -> str:
    return value or Settings().database_url


@db_app.command("upgrade")
def db_upgrade(database_url_: DatabaseUrl = None, revision: str = "head") -> None:
    """Apply the migrations up to REVISION (default: head)."""
    url = database_url(database_url_)
    migrate.upgrade(url, revision)
    out.print(f"database at revision {migrate.current_revision(url)}")


@db_app.command("current")
def db_current(database_url_: DatabaseUrl = None) -> None:
    """Print the database's migration revision and the code's head."""
    url = database_url(database_url_)
    current = migrate.current_revision(url)
    head = migrate.head_revision()
    state = "up to date" if current == head else "needs `payorch db upgrade`"
    out.print(f"current: {current or 'none'}  head: {head}  ({state})")


@app.command("demo")
def demo_cmd(
    database_url_: DatabaseUrl = None,
    payments: Annotated[int, typer.Option(help="Number of logical payments.")] = 300,
    seed: Annotated[int, typer.Option(help="Seed for clients and faults.")] = 7,
) -> None:
    """Run the end-to-end demo (SQLite and the loopback sandbox unless --database-url)."""
    from .demo import run_demo

    ok = run_demo(database_url=database_url_, payments=payments, seed=seed, console=out)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()
