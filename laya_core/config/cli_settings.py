"""What the flags and ``LAYA_*`` variables of ``laya check|plan|serve`` set, and the manifest
they make with SOURCE: flags beat variables, which beat the manifest, which beats defaults.

A setting is written into the manifest's data before validation, so it passes the same
checks, and a problem with a key it set names the flag or variable too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from laya_core.config import manifest as mf
from laya_core.config import models_dir, sources
from laya_core.config.table import Problems
from laya_core.plugins import Registry

DEFAULT_MODEL_NAME = "smollm2"
# What --threads sets until the model's backend says which of its options that is.
THREADS_KEY = "models[0].threads"

def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def _auto_or_int(text: str) -> str | int:
    return "auto" if text == "auto" else _int(text)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _string_list(text: str) -> list[str]:
    """A JSON list (vLLM's ``--allowed-origins '["*"]'``) or comma-separated values."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return [part.strip() for part in text.split(",") if part.strip()]


def _lora_pairs(text: str) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs, comma-separated; each path made absolute."""
    pairs = []
    for part in _string_list(text):
        name, eq, path = part.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"{part!r}: give NAME=PATH, the adapter's name and its folder")
        pairs.append((name.strip(), str(Path(path.strip()).expanduser().absolute())))
    return pairs


@attrs.frozen
class Setting:
    """A manifest key that a flag and an environment variable can set."""

    flags: tuple[str, ...]
    env: str
    # "server", "memory", "model", or "threads": the option the model's backend names for
    # its compute threads (Backend.threads_option)
    table: str
    key: str
    parse: Callable[[str], Any] = str
    help: str = ""
    many: bool = False  # the flag may repeat; its values make one list
    # What the list of a repeated flag's values becomes in the manifest (None: the list).
    combine: Callable[[list[Any]], Any] | None = None
    group: str = "model"
    metavar: str = "N"

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def key_path(self) -> str:
        if self.table == "model":
            return f"models[0].{self.key}"
        if self.table == "threads":
            return THREADS_KEY
        return f"{self.table}.{self.key}"


SETTINGS = (
    Setting(("--served-model-name",), "LAYA_SERVED_MODEL_NAME", "model", "name",
            metavar="NAME",
            help="the name clients send as 'model' (default: the file's name without .gguf)"),
    Setting(("--backend",), "LAYA_BACKEND", "model", "backend", metavar="NAME",
            help="the backend that runs the model (`laya plugins` lists them)"),
    Setting(("--max-model-len", "--ctx-size", "-c"), "LAYA_MAX_MODEL_LEN", "model",
            "max_seq_len", _int,
            help="tokens one sequence may hold, prompt and output (max_seq_len). Unlike "
            "llama-server's -c, which its slots share, this is per sequence"),
    Setting(("--max-num-seqs", "--parallel", "-np"), "LAYA_MAX_NUM_SEQS", "model",
            "max_num_seqs", _int, help="sequences that run together (max_num_seqs)"),
    Setting(("--threads", "-t"), "LAYA_THREADS", "threads", "threads", _auto_or_int,
            metavar="N|auto",
            help="compute threads: 'auto' or a number (the backend's threads option, such "
            "as n_threads)"),
    Setting(("--host",), "LAYA_HOST", "server", "host", metavar="HOST",
            help="address to listen on", group="server"),
    Setting(("--port",), "LAYA_PORT", "server", "port", _int, metavar="PORT",
            help="port to listen on", group="server"),
    Setting(("--api-key",), "LAYA_API_KEY", "server", "api_keys", _string_list, metavar="KEY",
            help="a key clients must send as 'Authorization: Bearer KEY'; repeat for more "
            "(the variable: comma-separated); replaces the manifest's api_keys",
            many=True, group="server"),
    Setting(("--allowed-origins",), "LAYA_ALLOWED_ORIGINS", "server", "cors_origins",
            _string_list, metavar="ORIGINS",
            help="origins browsers may call from (CORS): a JSON list, comma-separated, or "
            "repeated; '*' for any", many=True, group="server"),
    Setting(("--allowed-hosts",), "LAYA_ALLOWED_HOSTS", "server", "allowed_hosts",
            _string_list, metavar="HOSTS",
            help="Host header names served besides localhost and the listen address (a "
            "proxy's, a tunnel's): a JSON list, comma-separated, or repeated; '*' for any",
            many=True, group="server"),
    Setting(("--access-log",), "LAYA_ACCESS_LOG", "server", "access_log", _bool,
            help="a log line per request (on by default; --no-access-log turns it off)",
            group="server"),
    Setting(("--models-dir",), "LAYA_MODELS_DIR", "models_dir", "path", metavar="DIR",
            help="serve every GGUF file and model folder in DIR, each loaded on demand and "
            "named after its file, and those copied in later; the model flags apply to each",
            group="model"),
    Setting(("--lora",), "LAYA_LORA", "model", "lora", _lora_pairs, metavar="NAME=PATH",
            help="serve a LoRA adapter as model NAME beside the model: a PEFT folder (torch) "
            "or a GGUF LoRA file (llamacpp); repeat for more (the variable: comma-separated)",
            many=True, combine=dict),
    Setting(("--max-loras",), "LAYA_MAX_LORAS", "model", "max_loras", _int,
            help="LoRA adapters loaded at once, those of --lora and those loaded while "
            "serving (POST /v1/load_lora_adapter); the plan holds room for each"),
    Setting(("--max-lora-rank",), "LAYA_MAX_LORA_RANK", "model", "max_lora_rank", _int,
            help="the largest rank of an adapter loaded while serving (default: the "
            "largest of --lora, else 16)"),
    Setting(("--memory-budget",), "LAYA_MEMORY_BUDGET", "memory", "budget", metavar="SIZE",
            help="memory the deployment may use: 'auto' or a size such as 12GiB",
            group="memory"),
)
MODEL_ENV = "LAYA_MODEL"


@attrs.frozen
class Override:
    key_path: str
    value: Any
    label: str  # the flag or variable that set it, for messages


def _env_overrides(setting: Setting, problems: Problems) -> list[Override]:
    text = os.environ.get(setting.env)
    if text is None or text == "":
        return []
    try:
        value = setting.parse(text)
    except ValueError as e:
        problems.add(setting.env, str(e))
        return []
    if setting.combine is not None:
        value = setting.combine(value)
    return [Override(setting.key_path(), value, setting.env)]


def overrides(args: argparse.Namespace, problems: Problems) -> list[Override]:
    out = []
    for s in SETTINGS:
        value = getattr(args, s.dest, None)
        if value is None:
            out += _env_overrides(s, problems)
        else:
            if s.many:
                value = [v for part in value for v in part]
                if s.combine is not None:
                    value = s.combine(value)
            out.append(Override(s.key_path(), value, s.flags[0]))
    return out


def model_source(args: argparse.Namespace) -> tuple[str | None, str]:
    """The model to serve alone, named by the SOURCE argument, --model or LAYA_MODEL."""
    if args.model is not None:
        return args.model, "--model"
    if os.environ.get(MODEL_ENV):
        return os.environ[MODEL_ENV], MODEL_ENV
    return None, ""


def _relabel(error: mf.ManifestError, labels: dict[str, str]) -> mf.ManifestError:
    """Name the flag or variable behind each problem's key, where one set it."""
    def label(key: str) -> str:
        for path, name in labels.items():
            if key == path or key.startswith((path + "[", path + ".")):
                return f"{name} ({key})"
        return key

    (key, message), *more = [(label(k), m) for k, m in error.problems]
    return mf.ManifestError(key, message, more)


def _model_path(text: str) -> str:
    """A model named on the command line: a file or folder path, made absolute; an
    ``embedded:`` name or a URL (for a backend without a local file) as written."""
    if text.startswith("embedded:") or "://" in text:
        return text
    return str(Path(text).expanduser().absolute())


def _single_model_data(path: str, name: str | None) -> dict[str, Any]:
    path = _model_path(path)
    return {"models": [{"name": name or sources.model_name_for(path), "path": path}]}


def _threads_path(model: dict[str, Any], registry: Registry, label: str) -> str:
    """The key path --threads writes: the option the model's backend (named, or the one it
    would get) sets its compute threads with."""
    name = model.get("backend", mf.AUTO_BACKEND)
    if name == mf.AUTO_BACKEND and isinstance(model.get("path"), str):
        path = model["path"]
        with contextlib.suppress(LookupError):
            path = registry.resolve_model_path(path) or path
        name = mf.default_backend(registry, path) or name
    entry = registry.backends.get(name) if isinstance(name, str) else None
    option = entry.obj.threads_option if entry is not None else None
    if option is None:
        raise mf.ManifestError(label, f"the {name} backend takes no count of compute threads"
                               if entry is not None else "sets the compute threads of the "
                               "model's backend, and no installed backend runs this model")
    return f"models[0].options.{option}"


def _folder_model(data: dict[str, Any]) -> dict[str, Any]:
    """A model of the models folder, for the backend its threads flag sets: the folder's
    first, with the folder's backend; none found yet, a GGUF file's."""
    table = data.get("models_dir") or {}
    folder = Path(str(table.get("path", ".")))
    first = next(iter(models_dir.found(folder).values()), str(folder / "model.gguf"))
    return {"backend": table.get("backend", mf.AUTO_BACKEND), "path": first}


def _apply(data: dict[str, Any], overrides: list[Override], labels: dict[str, str],
           registry: Registry) -> None:
    models = data.get("models")
    # With only a models folder, a model's flags set what each of its models gets.
    per_file = not models and (isinstance(data.get("models_dir"), dict) or any(
        o.key_path == "models_dir.path" for o in overrides))
    for o in overrides:
        key_path = o.key_path
        if per_file and key_path == THREADS_KEY:
            key_path = _threads_path(_folder_model(data), registry, o.label)
        elif key_path == THREADS_KEY and isinstance(models, list) and len(models) == 1 \
                and isinstance(models[0], dict):
            key_path = _threads_path(models[0], registry, o.label)
        if per_file and key_path.startswith("models[0]."):
            key_path = "models_dir." + key_path.removeprefix("models[0].")
        table, _, rest = key_path.partition(".")
        if table.startswith("models["):
            if not isinstance(models, list) or len(models) != 1 \
                    or not isinstance(models[0], dict):
                count = len(models) if isinstance(models, list) else 0
                raise mf.ManifestError(o.label, f"sets one model's {rest}, and the manifest "
                                       f"has {count} [[models]] entries; set it in each entry")
            target = models[0]
            if rest.startswith("options."):
                target = target.setdefault("options", {})
                rest = rest.removeprefix("options.")
                if not isinstance(target, dict):
                    continue  # the manifest's own error says options is not a table
        else:
            target = data.setdefault(table, {})
            if not isinstance(target, dict):
                continue
            if rest.startswith("options."):  # a models folder's: each model's options
                target = target.setdefault("options", {})
                rest = rest.removeprefix("options.")
                if not isinstance(target, dict):
                    continue
        target[rest] = o.value
        labels[key_path] = o.label


def build(args: argparse.Namespace, registry: Registry,
          need_backends: bool = True) -> tuple[mf.Manifest, sources.Source | None]:
    """The manifest that SOURCE, the flags and the environment describe, checked whole."""
    labels: dict[str, str] = {}
    source = sources.classify(args.source) if args.source else None
    model, model_label = model_source(args)
    if source is not None and source.kind == "model":
        if model is not None and model_label == "--model":
            raise mf.ManifestError("--model", f"a model is already given ({args.source}); "
                                   "give it once")
        model, model_label = source.path, "SOURCE"
    early = Problems()  # environment variables that do not parse, reported with the rest
    try:
        found = overrides(args, early)
        if source is not None and source.kind == "manifest":
            path = Path(source.path)
            sources.check_manifest_text(path)
            data = copy.deepcopy(mf.read_toml(path))
            base_dir, name = path.resolve().parent, str(path)
            if model is not None:
                found.insert(0, Override("models[0].path", _model_path(model), model_label))
        else:
            if model is None and any(o.key_path == "models_dir.path" for o in found):
                data = {}  # the folder's models only
            elif model is None:
                data = _single_model_data(mf.EMBEDDED_MODEL, DEFAULT_MODEL_NAME)
            else:
                data = _single_model_data(model, None)
                labels["models[0].path"] = model_label
            base_dir, name = Path.cwd(), model or mf.EMBEDDED_MODEL
        _apply(data, found, labels, registry)
        with early.guard():
            manifest = mf.build(data, registry, source=name, base_dir=base_dir,
                                need_backends=need_backends)
        early.raise_if_any()
    except mf.ManifestError as e:
        raise _relabel(e, labels) from None
    return manifest, source


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", metavar="SOURCE",
                        help="a manifest (TOML), a GGUF model file, a model folder or "
                        "embedded:NAME; default: the embedded SmolLM2-135M-Instruct")
    groups = {
        "model": parser.add_argument_group(
            "model", "one model's keys; with a manifest of several models, set them there"),
        "server": parser.add_argument_group("server"),
        "memory": parser.add_argument_group("memory"),
    }
    groups["model"].add_argument("--model", metavar="PATH",
                                 help=f"the model to serve (as SOURCE; env {MODEL_ENV})")
    for s in SETTINGS:
        kwargs: dict[str, Any] = {"dest": s.dest, "help": f"{s.help} (env {s.env})",
                                  "metavar": s.metavar}
        if s.parse is _bool:
            del kwargs["metavar"]
            kwargs["action"] = argparse.BooleanOptionalAction
        elif s.many:
            kwargs.update(action="append", type=s.parse)
        else:
            kwargs["type"] = s.parse
        if s.parse is str:
            del kwargs["type"]
        groups[s.group].add_argument(*s.flags, **kwargs)
