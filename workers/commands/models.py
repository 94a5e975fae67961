"""``fisherscope fetch`` and ``fisherscope models [add|remove]``: the registry from the terminal."""

from __future__ import annotations

import argparse

from workers.commands.common import UsageError, quiet_transformers


def cmd_fetch(args: argparse.Namespace) -> int:
    from backend.registry import model_dir
    from workers.models.fetch import fetch_model

    info = fetch_model(args.model, progress=True)
    print(f"{info.id}: {model_dir(info.id)} ({info.n_params:,} parameters, {info.digest[:19]}...)")
    quiet_transformers()
    from workers.models.loading import load_model

    loaded = load_model(info.id)  # certifies once per digest and engine version (cached)
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "add":
        return _models_add(args)
    if args.action == "remove":
        from workers.models.register import remove_model

        remove_model(args.id)
        print(f"removed {args.id}")
        return 0
    print(format_registry())
    return 0


def _models_add(args: argparse.Namespace) -> int:
    from backend.vocabulary import model_id_problem

    problem = model_id_problem(args.id)
    if problem is not None:  # before torch is imported: a typo costs no seconds
        raise UsageError(problem)
    quiet_transformers()
    from workers.models.register import add_model

    info, loaded = add_model(args.id, args.source, args.revision, args.dtype, args.trust_remote_code)
    print(f"added {info.id}: {info.architecture}, {info.n_params:,} parameters, {info.digest[:19]}...")
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    return 0


def format_registry() -> str:
    """The registry as a table: ids, architecture, parameters, digest and the certificate's verdict."""
    from backend.registry import is_available, list_models, model_info, read_certificate

    rows = [("id", "architecture", "parameters", "dtype", "digest", "certificate")]
    for model_id in list_models():
        if not is_available(model_id):
            rows.append((model_id, "-", "-", "-", "-", f"not fetched: fisherscope fetch {model_id}"))
            continue
        info = model_info(model_id)
        certificate = read_certificate(info.digest, info.dtype)
        verdict = "not yet (made on first load)"
        if certificate is not None:
            verdict = "exact" if certificate["passed"] else f"refused: {certificate['reason']}"
            if certificate["passed"]:
                worst = max(certificate["first_moment_error"], certificate["square_error"])
                verdict += f", max rel. error {worst:.1e}"
        rows.append(
            (model_id, info.architecture, f"{info.n_params:,}", info.dtype, info.digest[:19], verdict)
        )
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
