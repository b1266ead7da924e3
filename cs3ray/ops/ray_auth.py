"""Ray token auth for every cluster cs3 starts or joins.

Ray 2.60's `ray start --head` turns token auth on only when a token already exists, and a process
reads RAY_AUTH_MODE into Ray's config when it imports ray. So cs3 makes the token itself, owner-only,
where Ray looks for it, and refreshes Ray's cached mode after setting it: a command that imported ray
first still sends the token. Nothing here prints, logs or records a token.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

MODE = "RAY_AUTH_MODE"


def token_path() -> Path:
    """The token file Ray reads: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(given).expanduser() if given else Path.home() / ".ray" / "auth_token"


def token_available() -> bool:
    """A token is given (RAY_AUTH_TOKEN) or its file exists."""
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or token_path().is_file()


def disabled_by_user() -> bool:
    """The user turned Ray's token auth off explicitly (RAY_AUTH_MODE=disabled): their call, kept."""
    return os.environ.get(MODE, "").strip().lower() == "disabled"


def ensure_token() -> Path | None:
    """The token file, made (0600 in a 0700 folder) when there is none; None when RAY_AUTH_TOKEN gives the token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = token_path()
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path  # another cs3 command made it meanwhile
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # Ray's own format: 256 random bits in hex
        return path
    # `ray get-auth-token --generate` writes it with the umask's mode (0644): whoever reads it owns the cluster.
    info = path.stat()
    if info.st_uid == os.getuid() and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        path.chmod(0o600)
    return path


def use_token_auth() -> bool:
    """Send the token from this process and its children from now on; False where the user disabled auth."""
    if disabled_by_user():
        return False
    os.environ[MODE] = "token"
    if "ray" in sys.modules:
        # Ray caches the mode in its config when imported, and the token once read; both are re-read here,
        # as Ray's own `ray.init()` does when it turns auth on.
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    return True


def join_with_token() -> None:
    """Before joining a cluster: send the token when one is at hand, unless the user disabled auth."""
    if os.environ.get(MODE, "").strip().lower() == "token" or (MODE not in os.environ and token_available()):
        use_token_auth()
