"""`hixl` command line: `hixl proxy`, `hixl devices`; `hixl bench`, `hixl demo`, `hixl model export` when
hixl-tools is installed (it registers them as entry points in the group `hixl.commands`; this library
never imports the tools)."""
from __future__ import annotations

import sys
from importlib.metadata import entry_points

TOOLS_GROUP = "hixl.commands"
TOOLS = ("bench", "demo", "model")


def _tool(name: str):
    """The hixl-tools command `name` (a callable taking argv, returning the exit code), or None."""
    eps = entry_points()
    if hasattr(eps, "select"):  # Python 3.10+
        found = list(eps.select(group=TOOLS_GROUP, name=name))
    else:  # 3.9: a dict of group -> entry points
        found = [e for e in eps.get(TOOLS_GROUP, ()) if e.name == name]
    return found[0].load() if found else None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "help"
    if cmd in TOOLS:
        run = _tool(cmd)
        if run is None:
            print("hixl %s comes with hixl-tools, which is not installed: from a checkout of hixl, "
                  "pip install ./tools" % cmd, file=sys.stderr)
            return 2
        return run(argv)
    if cmd == "proxy":
        from .proxy import main as proxy
        return proxy(argv)
    if cmd == "devices":
        from . import list_devices
        for d in list_devices():
            print(f"{d['name']}\tactive_ports={d['active_ports']}")
        return 0
    print("usage: hixl {demo,bench,proxy,model export,devices} [options]", file=sys.stderr)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
