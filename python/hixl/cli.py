"""`hixl` command line: `hixl demo`, `hixl bench`, `hixl proxy`, `hixl model export`, `hixl devices`."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "help"
    if cmd == "demo":
        from .demo import main as demo
        return demo(argv)
    if cmd == "bench":
        from .bench import main as bench
        return bench(argv)
    if cmd == "proxy":
        from .proxy import main as proxy
        return proxy(argv)
    if cmd == "model":
        if argv[:1] != ["export"]:
            print("usage: hixl model export DIR [--gguf FILE] [--force]", file=sys.stderr)
            return 0 if argv[:1] in (["-h"], ["--help"]) else 2
        from .models.export import main as export
        return export(argv[1:])
    if cmd == "devices":
        from . import list_devices
        for d in list_devices():
            print(f"{d['name']}\tactive_ports={d['active_ports']}")
        return 0
    print("usage: hixl {demo,bench,proxy,model export,devices} [options]", file=sys.stderr)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
