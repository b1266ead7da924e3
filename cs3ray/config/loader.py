"""YAML loading, dotted overrides and one-line error messages for job configs."""

from __future__ import annotations

import hashlib
import json
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from cs3ray.errors import UserError

from .redact import redact_config
from .schema import STORED, JobConfig


class ConfigError(UserError):
    """A config the user wrote or typed is wrong; the message names the field and the fix."""


def _describe_allowed(model: type[BaseModel], path: list[str]) -> str:
    """The field names allowed at `path`, to suggest when a key is unknown."""
    for key in path:
        field = model.model_fields.get(key)
        ann = getattr(field, "annotation", None) if field else None
        # Unions such as `int | ElasticWorkers`: descend into the model member.
        ann = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if ann is None:
            return ""
        model = ann
    return ", ".join(model.model_fields)


def _format_error(err: ValidationError, source: str) -> str:
    """The most relevant validation error as one sentence: where, what value, what is allowed."""
    errors = err.errors()
    # A union (an int or a {min, max} mapping) reports one error per member; show the error of
    # the member the user evidently meant: the mapping's when they wrote a mapping.
    e = next((x for x in errors if not (isinstance(x.get("input"), dict) and x["type"].startswith("int_"))), errors[0])
    loc = [str(p) for p in e["loc"] if not _is_union_member(p)]
    where = ".".join(loc) or "config"
    if e["type"] == "extra_forbidden":
        allowed = _describe_allowed(JobConfig, loc[:-1])
        return f"{source}: unknown field '{where}' (allowed here: {allowed})."
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if e["type"] in ("value_error",) and not loc:
        return f"{source}: {msg}."
    if e["type"] == "missing":
        return f"{source}: {where} is required."
    value = e.get("input")
    if loc[:2] == ["storage", "options"]:  # the value may be a credential: name only its type
        return f"{source}: {where} is invalid (a {type(value).__name__} was given): {msg}."
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = type(value).__name__
    return f"{source}: {where}={shown} is invalid: {msg}."


def _is_union_member(part: object) -> bool:
    """pydantic names union members in error locations ('int', 'ElasticWorkers'); users do not."""
    return isinstance(part, str) and (part in ("int", "float", "str", "bool") or part[:1].isupper()
                                      or part.startswith("function-"))


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=3e-4' -> (['train', 'lr'], 0.0003); values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.field=value (e.g. train.lr=3e-4).")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{key.strip()}=...' has an empty field name.")  # the value may be a secret
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Set each dotted override in a nested dict (a copy), creating sections as needed."""
    data = json.loads(json.dumps(data))
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{'.'.join(parts)}=...': '{p}' is a value, not a section.")
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, refusing a missing file or malformed YAML with one sentence."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist.")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must be a mapping of sections, not a {type(data).__name__}.")
    return data


def build_config(data: dict, source: str = "config") -> JobConfig:
    """Validate a dict into a JobConfig, with one-line errors."""
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def stored_config(data: Any, source: str) -> JobConfig:
    """A config read back from a checkpoint or run directory: a description of that run, never a way to reach storage.

    Its storage.options are dropped (a stored endpoint_url never gets the user's credentials) and validating it
    opens nothing it names (train.init_from=hf:URL). The locations it names (checkpoint.replicas, run.dir,
    train.init_from) are opened by no reader unless the user names or confirms them.
    """
    if isinstance(data, dict) and isinstance(data.get("storage"), dict):
        data = {**data, "storage": {**data["storage"], "options": {}}}
    try:
        return JobConfig.model_validate(data, context={STORED: True})
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Load a YAML job config (or the defaults when path is None) and apply dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides)
    return build_config(data, source=str(path) if path is not None else "config")


def to_yaml(cfg: JobConfig) -> str:
    """The resolved config as YAML, as written into run directories and checkpoints (credentials as ***)."""
    return yaml.safe_dump(redact_config(cfg.model_dump(mode="json")), sort_keys=False)


def redact_config_text(text: str) -> str:
    """Config YAML text with its storage credentials as *** (unchanged, byte for byte, when it has none)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(data, dict):
        return text
    redacted = redact_config(data)
    return text if redacted == data else yaml.safe_dump(redacted, sort_keys=False)


def config_hash(cfg: JobConfig) -> str:
    """A short stable hash of the resolved config, credentials redacted (they may change, the job does not)."""
    data = redact_config(cfg.model_dump(mode="json"))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


STORAGE_OPTIONS = "storage.options"


def runtime_storage_options(overrides: Iterable[str] = (), json_text: str | None = None) -> dict:
    """Storage options given at run time: `--storage-options JSON`, then `storage.options.KEY=VALUE` overrides."""
    options: Any = {}
    if json_text:
        try:
            options = json.loads(json_text)
        except ValueError:
            options = None
        if not isinstance(options, dict):
            raise ConfigError("--storage-options must be a JSON object, e.g. '{\"anon\": true}'.")
    overrides = list(overrides)
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if key != STORAGE_OPTIONS and not key.startswith(STORAGE_OPTIONS + "."):
            # Only the key is shown: a mistyped option's value may be a credential.
            raise ConfigError(f"argument '{key}' is not a storage option: this command takes only "
                              "storage.options.KEY=VALUE after the run (e.g. "
                              "storage.options.client_kwargs.endpoint_url=URL).")
    options = apply_overrides({"storage": {"options": options}}, overrides)["storage"]["options"]
    if not isinstance(options, dict):
        raise ConfigError("storage.options must be a mapping of fsspec options, e.g. storage.options.anon=true.")
    return options


SERVE = "serve"


def runtime_serve_options(overrides: Iterable[str] = (), json_text: str | None = None) -> tuple[dict, dict]:
    """The arguments after RUN of commands that serve a run (`cs3 serve`, `cs3 generate`): storage options
    as runtime_storage_options takes them, and serve.KEY=VALUE overrides of the run's serve section;
    returns (storage options, {KEY: value}). The values are checked where the serve section is built."""
    storage, serve = [], []
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if key.startswith(SERVE + "."):
            serve.append(text)
        elif key == STORAGE_OPTIONS or key.startswith(STORAGE_OPTIONS + "."):
            storage.append(text)
        else:  # only the key: a mistyped option's value may be a credential
            raise ConfigError(f"argument '{key}' is not a storage option nor a serve override: this command takes "
                              "only storage.options.KEY=VALUE and serve.KEY=VALUE (e.g. serve.engine=vllm) after "
                              "the run.")
    values = apply_overrides({}, serve).get(SERVE, {})
    nested = next((k for k, v in values.items() if isinstance(v, dict)), None)
    if nested is not None:
        raise ConfigError(f"serve.{nested} is a field, not a section: write serve.{nested}=VALUE.")
    return runtime_storage_options(storage, json_text), values


def explain(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every field, sections expanded."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(explain(ann, dotted + "."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append((dotted, json.dumps(default), field.description or ""))
    return rows
