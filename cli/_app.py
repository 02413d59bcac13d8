"""The ``payorch`` command: operators' tools, the reconciler daemon and the demo.

Exit codes: 0 ok, 1 not found or refused (payorch errors, database unreachable, a "no" at a
confirmation), 2 usage (unknown option, missing or malformed value). Every error is one
line on stderr, never a traceback.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from ..errors import PayorchError
from ._effects import effects_app
from ._health import health_cmd
from ._keys import keys_app
from ._once import once_app
from ._ops import ops_app
from ._outbox import outbox_app
from ._recon import recon_app
from ._reconcile import reconcile_app
from ._routing import routing_app
from ._runtime import DatabaseUrl, database_url, err, given_url, out, trimmed_stdout
from ._sandbox import sandbox_app
from ._stats import stats_cmd
from ._types import types_cmd

__all__ = ["app", "main"]


def _one_line(message: str) -> None:
    err().print(f"error: {' '.join(message.split())}", markup=False, highlight=False)


def _usage_exit(exc: typer.TyperException, root: Any) -> NoReturn:
    # Typer's own rendering is a multi-line box; operators and scripts get one line.
    if type(exc).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
        name = getattr(exc, "option_name", None)
        globals_ = {opt for param in root.params for opt in getattr(param, "opts", ())}
        if type(exc).__name__ == "NoSuchOption" and name in globals_:
            hint = f"{name} is a global option: put it before the command (payorch {name} …)"
            _one_line(f"{exc.format_message()}; {hint}")
        else:
            _one_line(f"{exc.format_message()} (see --help)")
    sys.exit(exc.exit_code)


def _quiet_flags(command: Any, ctx: Any = None) -> None:
    """Flags take no value, so their help shows none. (Typer renders ``--json <bool>``,
    which reads as though ``--json true`` were accepted; it is refused.) Duck-typed: typer
    builds its commands from its own copy of click."""
    made = command.context_class(command, parent=ctx, **command.context_settings)
    for param in [*command.params, command.get_help_option(made)]:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer's help prints a metavar, when one is set, as the type
    for sub in getattr(command, "commands", {}).values():
        _quiet_flags(sub, made)


class _Group(TyperGroup):
    """One line on stderr for every error: payorch's own and the database's exit 1."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except PayorchError as exc:
            _one_line(exc.message)
            raise typer.Exit(1) from None
        except Exception as exc:
            # Reads that bypass run_in_transaction raise SQLAlchemy's errors unmapped. Looked
            # up lazily: a command that never touched SQLAlchemy has none to raise.
            sa_exc = sys.modules.get("sqlalchemy.exc")
            if sa_exc is None or not isinstance(exc, sa_exc.SQLAlchemyError):
                raise
            from ..storage._engine import map_db_error

            _one_line(map_db_error(exc).message)
            raise typer.Exit(1) from None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        _quiet_flags(self)
        if not standalone_mode:
            return super().main(
                args, prog_name, complete_var, standalone_mode, windows_expand_args, **extra
            )
        try:
            with trimmed_stdout():
                result = super().main(
                    args, prog_name, complete_var, False, windows_expand_args, **extra
                )
        except typer.TyperException as exc:  # usage errors: exit 2
            _usage_exit(exc, self)
        except typer.Abort:
            _one_line("aborted")
            sys.exit(1)
        # Without standalone mode an explicit Exit comes back as its code.
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    name="payorch",
    cls=_Group,
    help="Durable payment-operation orchestrator: one explainable effect per operation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema (Alembic migrations) and health.", no_args_is_help=True)


class LogFormat(enum.StrEnum):
    text = "text"
    json = "json"


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@app.callback()
def _logging(
    log_format: Annotated[
        LogFormat,
        typer.Option(
            "--log-format",
            envvar="PAYORCH_LOG_FORMAT",
            case_sensitive=False,
            help="Log lines on stderr: text (time level logger event key=value) or json "
            "(one object per line).",
        ),
    ] = LogFormat.text,
    log_level: Annotated[
        LogLevel | None,
        typer.Option(
            "--log-level",
            envvar="PAYORCH_LOG_LEVEL",
            case_sensitive=False,
            help="Default: info for `reconcile`, error for `demo`, warning otherwise.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Durable payment-operation orchestrator: one explainable effect per operation."""
    import logging

    from ..observing import _logs as logs

    level = None if log_level is None else logging.getLevelNamesMapping()[log_level.upper()]
    logs.configure(log_format.value, level=level)


app.add_typer(db_app, name="db")
app.add_typer(ops_app, name="ops")
app.add_typer(once_app, name="once")
app.add_typer(outbox_app, name="outbox")
app.add_typer(effects_app, name="effects")
app.add_typer(keys_app, name="keys")
app.add_typer(reconcile_app, name="reconcile")
app.add_typer(recon_app, name="recon")
app.add_typer(routing_app, name="routing")
app.add_typer(sandbox_app, name="sandbox")
app.command("stats")(stats_cmd)
app.command("types")(types_cmd)


@db_app.command("upgrade")
def db_upgrade(database_url_: DatabaseUrl = None, revision: str = "head") -> None:
    """Apply the migrations up to REVISION (default: head)."""
    from .. import migrate

    url = database_url(database_url_)
    migrate.upgrade(url, revision)
    out().print(f"database at revision {migrate.current_revision(url)}")


@db_app.command("current")
def db_current(database_url_: DatabaseUrl = None) -> None:
    """Print the database's migration revision and the code's head."""
    from .. import migrate

    url = database_url(database_url_)
    from ..storage._schema import known_revisions

    current = migrate.current_revision(url)
    head = migrate.head_revision()
    if current == head:
        state = "up to date"
    elif current is not None and current not in known_revisions()[1]:
        state = "newer than this payorch: roll the code forward"
    else:
        state = "needs `payorch db upgrade`"
    out().print(f"current: {current or 'none'}  head: {head}  ({state})")


db_app.command("health")(health_cmd)


@db_app.command("distribute")
def db_distribute(
    database_url_: DatabaseUrl = None,
    shard_count: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Shards per table (default: the cluster's citus.shard_count). Only the "
            "first distribution reads it.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Distribute payorch's tables by tenant on a Citus coordinator (after `db upgrade`).

    Idempotent: a second run changes nothing. Exit 1, one line, nothing changed, on a
    database without Citus.
    """
    from rich.text import Text

    from .. import migrate

    url = database_url(database_url_)
    done = migrate.distribute(url, shard_count=shard_count)
    for line in done:
        out().print(Text(line))
    out().print("payorch's tables are distributed" + ("" if done else " (nothing to do)"))


DemoDatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="Run on this database (its own tenant); default: a temporary SQLite file.",
        show_default=False,
        callback=given_url,
    ),
]


@app.command("demo")
def demo_cmd(
    database_url_: DemoDatabaseUrl = None,
    payments: Annotated[int, typer.Option(help="Number of logical payments.")] = 300,
    seed: Annotated[int, typer.Option(help="Seed for clients and faults.")] = 7,
) -> None:
    """Run the end-to-end demo (SQLite and the loopback sandbox unless --database-url)."""
    import logging

    from ..observing import _logs as logs
    from ._demo import run_demo

    # The demo sums up what it saw itself; its escalations would only break the progress.
    logs.command_default(logging.ERROR)
    ok = run_demo(database_url=database_url_, payments=payments, seed=seed, console=out())
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()
