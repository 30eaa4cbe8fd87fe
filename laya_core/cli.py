"""The ``laya`` command: plugins, check, plan, serve.

``check``, ``plan`` and ``serve`` take a SOURCE: a manifest, a GGUF model file, a model folder
or ``embedded:NAME`` (nothing: the embedded default model). Flags and ``LAYA_*`` environment
variables set the common manifest keys; a flag beats its variable, which beats the manifest.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs

from laya_core import manifest as mf
from laya_core import planner, sources, systemd
from laya_core.manifest_table import Problems
from laya_core.model_files import ModelFileError
from laya_core.plugins import FAMILIES, PluginError, Registry, load_registry

EXIT_DOES_NOT_FIT = 1
EXIT_MANIFEST = 2
DEFAULT_MODEL_NAME = "smollm2"


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


@attrs.frozen
class Setting:
    """A manifest key that a flag and an environment variable can set."""

    flags: tuple[str, ...]
    env: str
    table: str  # "server", "memory", "model" or "options" (the model's backend options)
    key: str
    parse: Callable[[str], Any] = str
    help: str = ""
    many: bool = False  # the flag may repeat; its values make one list
    group: str = "model"
    metavar: str = "N"

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def key_path(self) -> str:
        if self.table == "model":
            return f"models[0].{self.key}"
        if self.table == "options":
            return f"models[0].options.{self.key}"
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
    Setting(("--threads", "-t"), "LAYA_THREADS", "options", "n_threads", _auto_or_int,
            metavar="N|auto",
            help="compute threads: 'auto' or a number (the backend's n_threads option)"),
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
    Setting(("--access-log",), "LAYA_ACCESS_LOG", "server", "access_log", _bool,
            help="a log line per request (on by default; --no-access-log turns it off)",
            group="server"),
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
    return [Override(setting.key_path(), value, setting.env)]


def _overrides(args: argparse.Namespace, problems: Problems) -> list[Override]:
    out = []
    for s in SETTINGS:
        value = getattr(args, s.dest, None)
        if value is None:
            out += _env_overrides(s, problems)
        else:
            if s.many:
                value = [v for part in value for v in part]
            out.append(Override(s.key_path(), value, s.flags[0]))
    return out


def _model_source(args: argparse.Namespace) -> tuple[str | None, str]:
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


def _single_model_data(path: str, name: str | None) -> dict[str, Any]:
    if not path.startswith("embedded:"):
        path = str(Path(path).expanduser().absolute())
    return {"models": [{"name": name or sources.model_name_for(path), "path": path}]}


def _pick_backend(data: dict[str, Any], registry: Registry) -> None:
    """A model folder served alone goes to the first installed backend that takes it."""
    model = data["models"][0]
    if "backend" in model or not Path(model["path"]).is_dir():
        return
    for name in sorted(registry.backends):
        if registry.backends[name].obj.check_model_path(model["path"]) is None:
            model["backend"] = name
            return


def _apply(data: dict[str, Any], overrides: list[Override], labels: dict[str, str]) -> None:
    models = data.get("models")
    for o in overrides:
        table, _, rest = o.key_path.partition(".")
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
        target[rest] = o.value
        labels[o.key_path] = o.label


def _build(args: argparse.Namespace, registry: Registry, need_backends: bool = True
           ) -> tuple[mf.Manifest, sources.Source | None]:
    """The manifest that SOURCE, the flags and the environment describe, checked whole."""
    labels: dict[str, str] = {}
    source = sources.classify(args.source) if args.source else None
    model, model_label = _model_source(args)
    if source is not None and source.kind == "model":
        if model is not None and model_label == "--model":
            raise mf.ManifestError("--model", f"a model is already given ({args.source}); "
                                   "give it once")
        model, model_label = source.path, "SOURCE"
    early = Problems()  # environment variables that do not parse, reported with the rest
    try:
        overrides = _overrides(args, early)
        if source is not None and source.kind == "manifest":
            path = Path(source.path)
            sources.check_manifest_text(path)
            data = copy.deepcopy(mf.read_toml(path))
            base_dir, name = path.resolve().parent, str(path)
            if model is not None:
                overrides.insert(0, Override("models[0].path",
                                             str(Path(model).expanduser().absolute())
                                             if not model.startswith("embedded:") else model,
                                             model_label))
        else:
            if model is None:
                data = _single_model_data(mf.EMBEDDED_MODEL, DEFAULT_MODEL_NAME)
            else:
                data = _single_model_data(model, None)
                labels["models[0].path"] = model_label
            base_dir, name = Path.cwd(), model or mf.EMBEDDED_MODEL
        _apply(data, overrides, labels)
        if source is None or source.kind == "model":
            _pick_backend(data, registry)
        with early.guard():
            manifest = mf.build(data, registry, source=name, base_dir=base_dir,
                                need_backends=need_backends)
        early.raise_if_any()
    except mf.ManifestError as e:
        raise _relabel(e, labels) from None
    return manifest, source


def cmd_plugins(args: argparse.Namespace, registry: Registry) -> int:
    for family in FAMILIES:
        print(f"{family}:")
        members = registry.family(family)
        for name in sorted(members):
            print(f"  {name:<14} {members[name].source}")
        if not members:
            print("  (none)")
    return 0


def cmd_check(args: argparse.Namespace, registry: Registry) -> int:
    manifest, _ = _build(args, registry)
    plan = planner.make_plan(manifest, registry)
    for m in planner.decided_manifest(manifest, plan).models:
        print(f"ok: {m.name}: backend {m.backend}, {m.path}, max_seq_len {m.max_seq_len}, "
              f"max_num_seqs {m.max_num_seqs}, kv_cache_tokens {m.kv_cache_tokens}, "
              f"replicas {m.replicas}, max_queue {m.max_queue}")
    if not plan.fits:
        print(f"laya: the plan does not fit its memory budget.\n{planner.format_plan(plan)}",
              file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def cmd_plan(args: argparse.Namespace, registry: Registry) -> int:
    manifest, source = _build(args, registry, need_backends=False)
    plan = planner.make_plan(manifest, registry)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    elif args.systemd:
        path = Path(source.path) if source and source.kind == "manifest" else None
        try:
            text = systemd.unit(plan, path, args.user, _serve_args(args, source))
        except ValueError as e:
            raise mf.ManifestError("--user", str(e)) from None
        print(text, end="")
    else:
        print(planner.format_plan(plan))
    return 0 if plan.fits else 1


def _serve_args(args: argparse.Namespace, source: sources.Source | None) -> list[str]:
    """``laya serve``'s arguments after the manifest that give what this run was given: the
    model and every setting from a flag or variable, except API keys, which a unit file
    (readable by all) must not hold."""
    out = []
    model, _ = _model_source(args)
    if source is not None and source.kind == "model":
        model = source.path
    if model is not None:
        out += ["--model", model if model.startswith("embedded:")
                else str(Path(model).expanduser().absolute())]
    for s in SETTINGS:
        if s.key == "api_keys":
            continue
        for o in _overrides(args, Problems()):
            if o.key_path != s.key_path():
                continue
            if isinstance(o.value, bool):
                out.append(s.flags[0] if o.value else f"--no-{s.flags[0][2:]}")
            elif isinstance(o.value, list):
                out += [x for v in o.value for x in (s.flags[0], v)]
            else:
                out += [s.flags[0], str(o.value)]
    if any(o.key_path == "server.api_keys" for o in _overrides(args, Problems())):
        print("laya: the API keys are not written into the unit: give them to the service "
              "in LAYA_API_KEY (systemctl edit: Environment=) or a [server] api_keys_file",
              file=sys.stderr)
    return out


def cmd_serve(args: argparse.Namespace, registry: Registry) -> int:
    from laya_core.serve import serve

    manifest, _ = _build(args, registry)
    plan = planner.make_plan(manifest, registry)
    if not plan.fits:
        print("laya: refusing to start: the plan does not fit its memory budget.\n"
              f"{planner.format_plan(plan)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return serve(planner.decided_manifest(manifest, plan), registry, plan)


def _version() -> str:
    try:
        return metadata.version("laya-core")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _add_settings(parser: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laya", description="Serve LLMs, memory planned.")
    parser.add_argument("--version", action="version", version=f"laya {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list loaded plugins by family").set_defaults(func=cmd_plugins)
    check = sub.add_parser("check", help="report every problem of a manifest or model; "
                           "print the settings it decides")
    _add_settings(check)
    check.set_defaults(func=cmd_check)
    plan = sub.add_parser("plan", help="print the memory ledger; exit 1 when it does not fit")
    _add_settings(plan)
    out = plan.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--systemd", action="store_true",
                     help="a systemd unit with MemoryMax from the plan")
    plan.add_argument("--user", default=systemd.DEFAULT_USER,
                      help="the system user the systemd unit runs as (default: %(default)s)")
    plan.set_defaults(func=cmd_plan)
    serve = sub.add_parser("serve", help="serve a manifest or one model (default: the "
                           "embedded model)")
    _add_settings(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def _report(error: mf.ManifestError, args: argparse.Namespace) -> None:
    for key, message in error.problems:
        kind = "error" if key.startswith(("-", "LAYA_", "SOURCE")) else "manifest error"
        print(f"laya: {kind}: {key}: {message}" if key else f"laya: {kind}: {message}",
              file=sys.stderr)
    if len(error.problems) > 1:
        where = f" in {args.source}" if getattr(args, "source", None) else ""
        print(f"laya: {len(error.problems)} problems{where}; nothing was started",
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from laya_core.logs import setup_logging

    setup_logging(logging.INFO)
    try:
        registry = load_registry()
    except PluginError as e:
        print(f"laya: plugin error: {e}", file=sys.stderr)
        return EXIT_MANIFEST
    try:
        return int(args.func(args, registry))
    except mf.ManifestError as e:
        _report(e, args)
        return EXIT_MANIFEST
    except ModelFileError as e:  # read past the manifest's checks, as a backend loads
        print(f"laya: model file error: {e}", file=sys.stderr)
        return EXIT_MANIFEST


if __name__ == "__main__":
    sys.exit(main())
