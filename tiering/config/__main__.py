"""`python -m tiering.config --markdown` prints the table of every configuration key;
`python -m tiering.config --schema PATH` writes the JSON Schema (`configs/kvtier.schema.json`)."""

from __future__ import annotations

import argparse
import sys

from tiering.config.generate import markdown_table, write_json_schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tiering.config", description="Generate the configuration's reference."
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--markdown", action="store_true", help="print the Markdown table of every key"
    )
    what.add_argument("--schema", metavar="PATH", help="write the JSON Schema to PATH")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        write_json_schema(args.schema)
    return 0


if __name__ == "__main__":
    sys.exit(main())
