"""Send programs to gcore's ``python`` tool through its public call, as the tools environment does for a model.

    python benchmarks/reliability/toolcall.py PROGRAMS.json SECRET

``PROGRAMS.json`` is a list of program texts. Each goes through
``gcore.envs.tools.call_tool({"python": python}, ToolCall("python", {"code": ...}), timeout_s=30)``; one JSON line
per program is printed: the ``ToolOutcome``'s content and error kind, and the seconds the call took. ``SECRET``
is on this process's command line and in its environment (``GCORE_RELIABILITY_SECRET``): a program that prints
it has read the caller's secrets. ``{CALLER}`` in a program becomes this process's pid.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    programs_path, secret = sys.argv[1], sys.argv[2]
    os.environ["GCORE_RELIABILITY_SECRET"] = secret
    from gcore.envs.tools import ToolCall, call_tool, python

    with open(programs_path) as f:
        programs = json.load(f)
    for code in programs:
        code = code.replace("{CALLER}", str(os.getpid()))  # sandbox_programs' placeholder for this pid
        started = time.monotonic()
        outcome = call_tool({"python": python}, ToolCall("python", {"code": code}), timeout_s=30)
        print(json.dumps({"content": outcome.content, "error": outcome.error,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
