"""The ``kvfn`` command: ``kvfn heads ...`` (profile a model's heads for DuoAttention)."""

import sys
from typing import Optional

COMMANDS = {"heads": "profile a model's KV heads into a DuoAttention pattern folder"}


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {k}  {v}" for k, v in COMMANDS.items())
        print(f"usage: kvfn COMMAND [options]\n\ncommands:\n{listing}", file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    from . import heads

    heads.main(argv[1:])


if __name__ == "__main__":
    main()
