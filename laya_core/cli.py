"""The ``laya`` command: plugins, check, serve."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import json
from pathlib import Path

from laya_core import manifest as mf
from laya_core import planner, systemd
from laya_core.model_files import ModelFileError
from laya_core.plugins import FAMILIES, PluginError, Registry, load_registry

EXIT_DOES_NOT_FIT = 1
EXIT_MANIFEST = 2


def _load(path: str | None, registry: Registry, host: str | None = None,
          port: int | None = None) -> mf.Manifest:
    manifest = mf.load(path) if path else mf.default_manifest()
    if host is not None or port is not None:
        import attrs

        server = attrs.evolve(manifest.server, host=host or manifest.server.host,
                              port=manifest.server.port if port is None else port)
        manifest = attrs.evolve(manifest, server=server)
    return mf.resolve(manifest, registry)


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
    manifest = _load(args.manifest, registry)
    for m in manifest.models:
        print(f"ok: {m.name}: backend {m.backend}, {m.path}, max_num_seqs {m.max_num_seqs}, "
              f"replicas {m.replicas}")
    return 0


def cmd_plan(args: argparse.Namespace, registry: Registry) -> int:
    manifest = mf.resolve(mf.load(args.manifest) if args.manifest else mf.default_manifest(),
                          registry, need_backends=False)
    plan = planner.make_plan(manifest, registry)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    elif args.systemd:
        print(systemd.unit(plan, Path(args.manifest) if args.manifest else None), end="")
    else:
        print(planner.format_plan(plan))
    return 0 if plan.fits else 1


def cmd_serve(args: argparse.Namespace, registry: Registry) -> int:
    from laya_core.serve import serve

    manifest = _load(args.manifest, registry, args.host, args.port)
    plan = planner.make_plan(manifest, registry)
    if not plan.fits:
        print("laya: refusing to start: the plan does not fit its memory budget.\n"
              f"{planner.format_plan(plan)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return serve(planner.decided_manifest(manifest, plan), registry, plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laya", description="Serve LLMs, memory planned.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list loaded plugins by family").set_defaults(func=cmd_plugins)
    check = sub.add_parser("check", help="validate a manifest")
    check.add_argument("manifest")
    check.set_defaults(func=cmd_check)
    plan = sub.add_parser("plan", help="print the memory ledger; exit 1 when it does not fit")
    plan.add_argument("manifest", nargs="?")
    out = plan.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--systemd", action="store_true",
                     help="a systemd unit with MemoryMax from the plan")
    plan.set_defaults(func=cmd_plan)
    serve = sub.add_parser("serve", help="serve a manifest (default: the embedded model)")
    serve.add_argument("manifest", nargs="?")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="laya: %(levelname)s %(name)s: %(message)s")
    try:
        registry = load_registry()
    except PluginError as e:
        print(f"laya: plugin error: {e}", file=sys.stderr)
        return EXIT_MANIFEST
    try:
        return int(args.func(args, registry))
    except mf.ManifestError as e:
        print(f"laya: manifest error: {e}", file=sys.stderr)
        return EXIT_MANIFEST
    except ModelFileError as e:  # read past the manifest's checks, as a backend loads
        print(f"laya: model file error: {e}", file=sys.stderr)
        return EXIT_MANIFEST


if __name__ == "__main__":
    sys.exit(main())
