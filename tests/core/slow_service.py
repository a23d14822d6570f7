"""`python -m tests.core.slow_service PORT_FILE`: the probe services under the real `serve()`
entry point (signal handling included), for the graceful-shutdown test."""

import asyncio
import sys

from rlfabric.core.logs import setup_logging
from rlfabric.core.server import ServerOptions, serve

from .probe_services import probe_service

if __name__ == "__main__":
    setup_logging("probe", "shutdown-test")
    asyncio.run(serve(probe_service(), ServerOptions(port=0, metrics_port=0, grace_period_s=10), port_file=sys.argv[1]))
