"""The ``laya`` command: plugins, check, plan, serve.

``check``, ``plan`` and ``serve`` take a SOURCE: a manifest, a GGUF model file, a model folder
or ``embedded:NAME`` (nothing: the embedded default model). Flags and ``LAYA_*`` environment
variables set the common manifest keys; a flag beats its variable, which beats the manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from laya_core.cli import systemd
from laya_core.config import cli_settings, sources
from laya_core.config import manifest as mf
from laya_core.config.table import Problems
from laya_core.memory import planner
from laya_core.memory.report import format_plan
from laya_core.models.files import ModelFileError
from laya_core.plugins import FAMILIES, TRACE_ENV, PluginError, Registry, load_registry

EXIT_DOES_NOT_FIT = 1
EXIT_MANIFEST = 2


def cmd_plugins(args: argparse.Namespace, registry: Registry) -> int:
    for family in FAMILIES:
        print(f"{family}:")
        members = registry.family(family)
        for name in sorted(members):
            print(f"  {name:<14} {members[name].source}")
        if not members:
            print("  (none)")
    if registry.failures:
        print("failed (left out):")
        for failure in registry.failures:
            print(f"  {failure}")
        return EXIT_MANIFEST
    return 0


def cmd_check(args: argparse.Namespace, registry: Registry) -> int:
    manifest, _ = cli_settings.build(args, registry)
    plan = planner.make_plan(manifest, registry, serving=True)
    for m in planner.decided_manifest(manifest, plan).models:
        print(f"ok: {m.name}: backend {m.backend}, {m.path}, max_seq_len {m.max_seq_len}, "
              f"max_num_seqs {m.max_num_seqs}, kv_cache_tokens {m.kv_cache_tokens}, "
              f"replicas {m.replicas}, max_queue {m.max_queue}"
              + (f", load on_demand (idle_unload_s {m.idle_unload_s:g})" if m.idle_unload_s
                 else ", load on_demand" if m.on_demand else ""))
    if not plan.fits:
        print(f"laya: the plan does not fit its memory budget.\n{format_plan(plan)}",
              file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_MANIFEST if registry.failures else 0


def _machine(args: argparse.Namespace) -> planner.Machine | None:
    """The machine ``laya plan --ram --gpus`` describes; None: this one."""
    if args.ram is None and args.gpus is None:
        return None
    from laya_core.memory import budget, devices

    try:
        ram = None if args.ram is None else budget.parse_size(args.ram, minimum=2**20)
    except ValueError as e:
        raise mf.ManifestError("--ram", str(e)) from None
    try:
        gpus = None if args.gpus is None else devices.parse_gpus(args.gpus)
    except ValueError as e:
        raise mf.ManifestError("--gpus", str(e)) from None
    return planner.Machine(ram, gpus)


def cmd_plan(args: argparse.Namespace, registry: Registry) -> int:
    manifest, source = cli_settings.build(args, registry, need_backends=False)
    plan = planner.make_plan(manifest, registry, serving=True, machine=_machine(args))
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
        print(format_plan(plan))
        if manifest.cluster.engine == "ray":  # only then is Ray imported
            from laya_core.replica import ray_placement

            text, placed = ray_placement.report(plan, manifest.cluster.address)
            print(text)
            if not placed:
                return EXIT_DOES_NOT_FIT
    return 0 if plan.fits else 1


def _serve_args(args: argparse.Namespace, source: sources.Source | None) -> list[str]:
    """``laya serve``'s arguments after the manifest that give what this run was given: the
    model and every setting from a flag or variable, except API keys, which a unit file
    (readable by all) must not hold."""
    out = []
    model, _ = cli_settings.model_source(args)
    if source is not None and source.kind == "model":
        model = source.path
    if model is not None:
        out += ["--model", model if model.startswith("embedded:")
                else str(Path(model).expanduser().absolute())]
    flag_of = {s.key_path(): s.flags[0] for s in cli_settings.SETTINGS}
    for o in cli_settings.overrides(args, Problems()):
        flag = flag_of[o.key_path]
        if o.key_path == "server.api_keys":
            print("laya: the API keys are not written into the unit: give them to the "
                  "service in LAYA_API_KEY (systemctl edit: Environment=) or a [server] "
                  "api_keys_file", file=sys.stderr)
        elif isinstance(o.value, bool):
            out.append(flag if o.value else f"--no-{flag[2:]}")
        elif isinstance(o.value, list):
            out += [x for v in o.value for x in (flag, v)]
        else:
            out += [flag, str(o.value)]
    return out


def cmd_serve(args: argparse.Namespace, registry: Registry) -> int:
    from laya_core.cli.serve import serve

    manifest, _ = cli_settings.build(args, registry)
    plan = planner.make_plan(manifest, registry, serving=True)
    if not plan.fits:
        print("laya: refusing to start: the plan does not fit its memory budget.\n"
              f"{format_plan(plan)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return serve(planner.decided_manifest(manifest, plan), registry, plan)


def _version() -> str:
    try:
        return metadata.version("laya-core")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laya", description="Serve LLMs, memory planned.")
    parser.add_argument("--version", action="version", version=f"laya {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list loaded plugins by family").set_defaults(func=cmd_plugins)
    check = sub.add_parser("check", help="report every problem of a manifest or model; "
                           "print the settings it decides")
    cli_settings.add_settings(check)
    check.set_defaults(func=cmd_check)
    plan = sub.add_parser("plan", help="print the memory ledger; exit 1 when it does not fit")
    cli_settings.add_settings(plan)
    out = plan.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--systemd", action="store_true",
                     help="a systemd unit with MemoryMax from the plan")
    plan.add_argument("--ram", metavar="SIZE", help="plan for a machine with this much RAM "
                      "(such as 64GiB; a headroom is kept back as on this one)")
    plan.add_argument("--gpus", metavar="SIZES", help="plan for a machine with these GPUs: "
                      "each one's memory, comma-separated (24GiB; 2x80GiB; none)")
    plan.add_argument("--user", default=systemd.DEFAULT_USER,
                      help="the system user the systemd unit runs as (default: %(default)s)")
    plan.set_defaults(func=cmd_plan)
    serve = sub.add_parser("serve", help="serve a manifest or one model (default: the "
                           "embedded model)")
    cli_settings.add_settings(serve)
    serve.set_defaults(func=cmd_serve)
    for command in (check, plan, serve):
        command.add_argument("--trace-hooks", action="store_true",
                             help=f"log every plugin hook call with its plugin and duration "
                             f"(or {TRACE_ENV}=1)")
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
    if getattr(args, "trace_hooks", False):
        os.environ[TRACE_ENV] = "1"
    try:
        registry = load_registry()
    except PluginError as e:
        print(f"laya: plugin error: {e}", file=sys.stderr)
        return EXIT_MANIFEST
    for failure in registry.failures:  # the others loaded; what needs this one says so
        print(f"laya: plugin error: {failure}", file=sys.stderr)
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
