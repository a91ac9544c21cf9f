"""specserve's app over the scripted engine as a process of its own, for tests
that need several servers sharing something real (a Redis) but no model:

    python -m tests.scripted_server --port 8123 --api-key-file keys.json \\
        --rate-limit-store redis://127.0.0.1:6379/0
"""

import argparse
from pathlib import Path

import uvicorn

from server.app import create_app
from server.traffic.api_keys import ApiKeys, load_key_ring
from tests.unit.scripted_engine import ScriptedEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key-file", type=Path, required=True)
    parser.add_argument("--rate-limit-store")
    parser.add_argument("--rate-limit-on-store-failure", choices=["open", "closed"], default="open")
    args = parser.parse_args()
    keys = ApiKeys(load_key_ring(args.api_key_file), args.api_key_file)
    app = create_app(
        ScriptedEngine(),
        api_keys=keys,
        rate_limit_store=args.rate_limit_store,
        rate_limit_on_store_failure=args.rate_limit_on_store_failure,
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
