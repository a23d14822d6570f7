"""`rlfabric data KIND`: training data in VeRL's parquet schema (rlfabric.data.prep)."""

from __future__ import annotations

import sys


def cmd_data(args) -> int:
    from rlfabric.data import prep as data_prep

    if args.kind in ("synthetic", "arithmetic"):
        write = data_prep.write_synthetic if args.kind == "synthetic" else data_prep.write_arithmetic
        paths = write(args.out, args.train_size, args.val_size, args.seed)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    try:
        if args.kind == "custom":
            print(data_prep.write_custom(args.input, args.out, args.prompt_column, args.answer_column,
                                         args.data_source, args.split, args.instruction))
            return 0
        convert = {"gsm8k": data_prep.write_gsm8k, "math": data_prep.write_math,
                   "hellaswag": data_prep.write_hellaswag, "hh-rlhf": data_prep.write_hh_rlhf}[args.kind]
        print(convert(args.input, args.out, args.split))
    except (OSError, ValueError) as error:  # a missing file, a malformed record (named with its line)
        print(f"rlfabric data {args.kind}: {error}", file=sys.stderr)
        return 1
    return 0
