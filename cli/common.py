"""What every command shares: the console, user-error handling (exit 2) and common options."""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

import typer
from rich.console import Console

from cs3ray.errors import UserError

console = Console()
err_console = Console(stderr=True)


def note(line: str) -> None:
    """A progress line of text that comes from elsewhere (a log, an error, a path) on stderr, as it is:
    never read as markup, where `[/path]` would raise and `[red]` would vanish."""
    err_console.print(line, markup=False, highlight=False)

F = TypeVar("F", bound=Callable)

# Shared options, defined once (as skypilot's flags.py does).
AddressOpt = typer.Option(None, "--address", envvar="RAY_ADDRESS",
                          help="Ray cluster address (host:port or ray://...); default: the cluster `cs3 up` started, "
                               "else an embedded local cluster.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object as the last line of stdout.")
OverridesArg = typer.Argument(None, help="Dotted overrides such as train.lr=3e-4 cluster.workers=2.",
                              show_default=False)
# Commands that read a run take its storage options at run time, as `cs3 train` takes overrides
# (parsed by cs3ray.config.runtime_storage_options), so credentials need not be in any file.
StorageOverridesArg = typer.Argument(None, metavar="storage.options.KEY=VALUE", show_default=False,
                                     help="Storage options for reading the run (dots for nested keys, e.g. "
                                          "storage.options.client_kwargs.endpoint_url=URL); credentials may also "
                                          "come from the environment (AWS_ACCESS_KEY_ID, ~/.aws, ...).")
# `cs3 serve` and `cs3 generate` also take the run's serve section (cs3ray.config.runtime_serve_options).
ServeOverridesArg = typer.Argument(None, metavar="[serve.KEY=VALUE | storage.options.KEY=VALUE]...", show_default=False,
                                   help="serve.KEY=VALUE overrides of the run's serve section (e.g. serve.engine=vllm "
                                        "serve.tp=2; `cs3 config explain` lists them), and storage options for reading "
                                        "the run (dots for nested keys, e.g. storage.options.client_kwargs.endpoint_url"
                                        "=URL); credentials may also come from the environment.")
StorageOptionsOpt = typer.Option(None, "--storage-options",
                                 help="fsspec storage options as JSON; storage.options.KEY=VALUE arguments go on top.")
# A stored file names locations but never makes us contact them (they would get the user's credentials):
# the replicas to fall back to are the ones the user names, or confirms.
ReplicaOpt = typer.Option(None, "--ckpt-replica", metavar="URL",
                          help="A copy of the run's checkpoints to fall back to when one is damaged or missing "
                               "(repeat it).")
StoredReplicasOpt = typer.Option(False, "--use-stored-replicas",
                                 help="Also fall back to the checkpoint.replicas the run's stored config lists "
                                      "(they get your storage options and credentials).")


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit; a URL's password in it (a storage error names its URL) is hidden."""
    from rich.markup import escape

    from cs3ray.config.redact import redact_value

    # Escaped: text in brackets (an extra such as [vllm], a list) is the message's, not rich markup.
    err_console.print(f"[bold red]error:[/] {escape(redact_value(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn UserError into one line on stderr and exit code 2 (or the error's own `exit_code`), never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            fail(str(exc), getattr(exc, "exit_code", 2))
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
    return wrapper  # type: ignore[return-value]


def overrides_list(values: Optional[list[str]]) -> list[str]:
    return list(values or [])
