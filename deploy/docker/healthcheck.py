"""Container healthcheck: exit 0 if http://127.0.0.1:$PORT_ENV<path> answers 200, else 1.

Usage: jitney-healthcheck PORT_ENV DEFAULT_PORT PATH (the port follows the JITNEY_* setting the
process itself reads, so overriding it does not break the check). Stdlib only: slim images have
no curl.
"""

import os
import sys
import urllib.request


def main(argv: list[str]) -> int:
    port_env, default_port, path = argv
    url = f"http://127.0.0.1:{os.environ.get(port_env) or default_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return 0 if resp.status == 200 else 1
    except OSError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
